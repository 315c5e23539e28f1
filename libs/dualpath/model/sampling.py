"""Token sampling: greedy, temperature, top-k, top-p, grammar masks, with OpenAI-style logprobs.

Logprobs are ``log_softmax`` of the raw logits, before temperature, top-k/top-p, EOS
suppression or a grammar mask (what OpenAI and vLLM report), so they do not change with the
sampling knobs.

Structured outputs: ``SamplingParams.grammar`` (an llguidance grammar the gateway built from
``response_format`` or a forced ``tool_choice``) travels with the request; each engine makes
the request's ``TokenConstraint`` with ``grammar_constraint`` and passes it to ``sample``,
which masks the row before choosing and advances the grammar past the chosen token.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dualpath.model.errors import ModelInputError

if TYPE_CHECKING:
    from dualpath.structured.constraint import TokenConstraint

__all__ = ["MAX_TOP_LOGPROBS", "SampledToken", "SamplingParams", "grammar_constraint", "sample", "warm_grammar_vocabulary"]

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for `top_logprobs`


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI / vLLM semantics).

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` are off. ``min_tokens``
    and ``ignore_eos`` are enforced by the caller through ``sample(suppress_eos=...)``.

    Raises:
        ModelInputError: a field out of range (negative temperature, ``top_p`` outside
            ``(0, 1]``, ``max_tokens < 1``, ``min_tokens > max_tokens``, ``top_logprobs``
            outside ``[0, 20]``, a negative stop token id).
    """

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
    grammar: str | None = None  # llguidance grammar (dualpath.structured.grammar); None: unconstrained

    def __post_init__(self) -> None:
        checks = (
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (0 <= self.min_tokens <= self.max_tokens, f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"),
            (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"),
            (all(t >= 0 for t in self.stop_token_ids), f"stop_token_ids must be >= 0: {self.stop_token_ids}"),
        )
        for ok, message in checks:
            if not ok:
                raise ModelInputError(message)


@dataclass(frozen=True, slots=True, kw_only=True)
class SampledToken:
    """One chosen token, its logprob and the most likely alternatives (best first)."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    *,
    suppress_eos: Sequence[bool] | None = None,
    eos_ids: Collection[int] = frozenset(),
    constraints: Sequence[TokenConstraint | None] | None = None,
) -> list[SampledToken]:
    """Choose one token per row of ``logits [B, V]``.

    Row ``i`` uses ``params[i]`` and draws from ``generators[i]`` (``None``: torch's default
    generator; pass a seeded one for reproducible sampling; it must live on the logits'
    device or on CPU). Greedy rows take the argmax, ties going to the lowest id. Where
    ``suppress_eos[i]`` is true the ids in ``eos_ids`` cannot be chosen (min_tokens,
    ignore_eos), unless the row's grammar allows nothing else. Where ``constraints[i]`` is set,
    tokens its grammar forbids cannot be chosen and the chosen token advances it (a finished
    grammar allows only EOS). ``top_logprobs`` holds ``params[i].top_logprobs`` entries (none when 0); the
    chosen token's ``logprob`` is always filled, since it costs nothing.

    Raises:
        ModelInputError: ``logits`` not 2-D, or lengths of ``params``, ``generators``,
            ``suppress_eos`` or ``constraints`` differing from ``B``.
        GrammarError: a grammar does not compile (``dualpath.chat.errors``).
    """
    if logits.dim() != 2:
        raise ModelInputError(f"logits must be [B, V], got {tuple(logits.shape)}")
    batch, vocab = logits.shape
    suppress = list(suppress_eos) if suppress_eos is not None else [False] * batch
    cons = list(constraints) if constraints is not None else [None] * batch
    if not len(params) == len(generators) == len(suppress) == len(cons) == batch:
        raise ModelInputError(
            f"{batch} logit rows but {len(params)} params, {len(generators)} generators, "
            f"{len(suppress)} suppress_eos entries, {len(cons)} constraints"
        )
    raw = logits.float()
    logprobs = torch.log_softmax(raw, dim=-1)  # [B, V]
    eos = torch.tensor(sorted(i for i in eos_ids if 0 <= i < vocab), dtype=torch.long, device=raw.device)
    if all(c is None and p.temperature < _GREEDY_BELOW and not p.top_logprobs for c, p in zip(cons, params)):
        # the common decode batch: every row greedy and unconstrained, in a few batched ops
        return _greedy_rows(raw, logprobs, eos, suppress)
    out = []
    for i, p in enumerate(params):
        row = raw[i]
        con = cons[i]
        if con is not None:
            row = con.apply(row)
        if suppress[i] and eos.numel():
            kept = row.index_fill(0, eos, float("-inf"))
            row = kept if con is None or bool(torch.isfinite(kept).any()) else row
        # A temperature too small for float32 (1e-300 divides logits into inf, then NaN) is greedy, as in vLLM.
        token = int(row.argmax()) if p.temperature < _GREEDY_BELOW else _draw(row, p, generators[i])
        if con is not None:
            con.accept(token)
        top: tuple[tuple[int, float], ...] = ()
        if p.top_logprobs:
            # Stable sort: equal logprobs are listed lowest id first, like the greedy choice.
            values, ids = torch.sort(logprobs[i], descending=True, stable=True)
            top = tuple(zip(ids[: p.top_logprobs].tolist(), values[: p.top_logprobs].tolist()))
        out.append(SampledToken(token_id=token, logprob=float(logprobs[i, token]), top_logprobs=top))
    return out


_GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)


def _greedy_rows(raw: torch.Tensor, logprobs: torch.Tensor, eos: torch.Tensor, suppress: list[bool]) -> list[SampledToken]:
    """``sample`` of a batch whose rows are all greedy, unconstrained and without top logprobs:
    the row loop's choices (argmax, ties to the lowest id, EOS masked where suppressed) as
    whole-batch operations, so a decode step of B requests costs a few tensor ops instead of
    B times four (the per-row loop was most of a modeled decode engine's host time per step)."""
    rows = raw
    if eos.numel() and any(suppress):
        rows = raw.index_fill(1, eos, float("-inf"))
        if not all(suppress):
            rows = torch.where(torch.tensor(suppress, device=raw.device).unsqueeze(1), rows, raw)
    tokens = rows.max(dim=-1).indices  # [B]; the first maximum, as the row loop's argmax (and faster than argmax on CPU)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return [SampledToken(token_id=t, logprob=lp, top_logprobs=()) for t, lp in zip(tokens.tolist(), chosen.tolist())]


def _draw(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """Sample from ``row [V]`` after temperature, top-k and top-p."""
    scaled = row / p.temperature
    if 0 < p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
        drop[0] = False  # a top_p that is 0.0 in float32 (5e-324) would otherwise drop every token
        scaled = scaled.index_fill(0, order[drop], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))


def grammar_constraint(params: SamplingParams, model_dir: str, *, prefix: Iterable[int] = ()) -> TokenConstraint | None:
    """The request's grammar state, or ``None`` when it is unconstrained.

    ``model_dir`` is the checkpoint (its ``tokenizer.json`` gives the grammar's vocabulary);
    ``prefix`` are tokens already sampled under the grammar (the decode engine replays the
    prefill engine's first token).
    """
    if not params.grammar:
        return None
    from dualpath.structured.constraint import TokenConstraint

    return TokenConstraint(params.grammar, model_dir, prefix=prefix)


async def warm_grammar_vocabulary(model_dir: str, n_vocab: int) -> str:
    """Build the checkpoint's grammar vocabulary off the event loop (about 1 s per 100K tokens), so
    the first structured-output request does not stall an engine loop. Returns "" or the error,
    which the first structured request will then raise."""
    import asyncio

    from dualpath.structured.grammar import vocabulary

    try:
        await asyncio.to_thread(vocabulary, str(model_dir), n_vocab)
    except Exception as exc:  # noqa: BLE001 - reported, and raised again by the request that needs it
        return str(exc)
    return ""
