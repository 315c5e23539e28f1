"""Sampling: greedy, temperature, top-k, top-p, with OpenAI-style logprobs.

Logprobs are ``log_softmax`` of the raw logits (temperature-independent, as OpenAI and vLLM
report them). ``temperature == 0`` is greedy (ties to the lowest id).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["SampledToken", "SamplingParams", "sample"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SampledToken:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    x = logits / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix reaching top_p
        x = x.scatter(-1, idx, sorted_x.masked_fill(drop, float("-inf")))
    return x


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None], *,
           suppress_eos: Sequence[bool] | None = None, eos_ids: frozenset[int] = frozenset()) -> list[SampledToken]:
    """One token per row of ``logits`` ``[B, V]`` (float32, any device)."""
    logits = logits.float()
    if suppress_eos is not None and eos_ids:
        rows = [i for i, s in enumerate(suppress_eos) if s]
        if rows:
            logits = logits.clone()
            cols = torch.tensor(sorted(eos_ids), device=logits.device)
            logits[torch.tensor(rows, device=logits.device)[:, None], cols[None, :]] = float("-inf")
    logp = torch.log_softmax(logits, dim=-1)
    out = []
    for i, p in enumerate(params):
        row = logits[i]
        if p.temperature <= 0:
            token = int(torch.argmax(row))  # first maximum: lowest id on ties
        else:
            probs = torch.softmax(_filter(row, p), dim=-1).cpu()
            token = int(torch.multinomial(probs, 1, generator=generators[i]))
        top = ()
        if p.top_logprobs:
            vals, ids = torch.topk(logp[i], min(p.top_logprobs, logp.shape[-1]))
            top = tuple((int(t), float(v)) for t, v in zip(ids.tolist(), vals.tolist()))
        out.append(SampledToken(token_id=token, logprob=float(logp[i, token]), top_logprobs=top))
    return out
