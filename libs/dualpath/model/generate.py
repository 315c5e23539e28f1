"""``greedy_generate``: a reference generation loop over ``Decoder.forward_layer``.

Tests and tools use it as the ground truth an engine's output is compared with: all
prompts are prefilled in one batched call per layer, then decoded one token per step,
batched, with each sequence's KV kept here as plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from dualpath.model.decoder import Decoder
from dualpath.model.errors import ModelInputError

__all__ = ["GreedyResult", "greedy_generate"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GreedyResult:
    """Generated ids per prompt, and per step the top-1 minus top-2 logit (nats)."""

    tokens: list[list[int]]
    margins: list[list[float]]


@torch.no_grad()
def greedy_generate(decoder: Decoder, prompts: Sequence[Sequence[int]], max_tokens: int) -> GreedyResult:
    """Greedily extend every prompt by ``max_tokens`` tokens (no EOS stop).

    Raises:
        ModelInputError: no prompts, an empty prompt, ``max_tokens < 1`` or a bad token id.
    """
    if not prompts or any(len(p) == 0 for p in prompts) or max_tokens < 1:
        raise ModelInputError("greedy_generate needs non-empty prompts and max_tokens >= 1")
    lengths = [len(p) for p in prompts]
    flat = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(decoder.device)
    starts = [sum(lengths[:i]) for i in range(len(prompts))]
    segments = list(zip(starts, lengths))
    past: list[list[tuple[torch.Tensor, torch.Tensor] | None]] = []
    hidden = decoder.embed(flat)
    for layer in range(decoder.num_layers):
        hidden, k, v = decoder.forward_layer(layer, hidden, positions, segments, [None] * len(prompts))
        past.append([(k[s : s + n], v[s : s + n]) for s, n in segments])
    logits = decoder.logits(hidden[[s + n - 1 for s, n in segments]])  # [B, V]
    tokens: list[list[int]] = [[] for _ in prompts]
    margins: list[list[float]] = [[] for _ in prompts]
    step_segments = [(i, 1) for i in range(len(prompts))]
    for step in range(max_tokens):
        top = logits.topk(2, dim=-1).values  # [B, 2]
        chosen = logits.argmax(dim=-1)  # lowest id on ties
        for i in range(len(prompts)):
            tokens[i].append(int(chosen[i]))
            margins[i].append(float(top[i, 0] - top[i, 1]))
        if step == max_tokens - 1:
            break
        hidden = decoder.embed(chosen)
        positions = torch.tensor([n + step for n in lengths], device=decoder.device)
        for layer in range(decoder.num_layers):
            hidden, k, v = decoder.forward_layer(layer, hidden, positions, step_segments, past[layer])
            past[layer] = [
                (torch.cat((pk, k[i : i + 1])), torch.cat((pv, v[i : i + 1])))
                for i, (pk, pv) in enumerate(cast("list[tuple[torch.Tensor, torch.Tensor]]", past[layer]))
            ]  # all set
        logits = decoder.logits(hidden)
    return GreedyResult(tokens=tokens, margins=margins)
