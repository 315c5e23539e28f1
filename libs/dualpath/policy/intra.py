"""Intra-engine batching for a prefill engine (paper §6.2): FIFO packing under a compute
quota, with chunked prefill for the request that would exceed it.

With data parallelism every GPU runs its own batch and waits for the slowest at each
synchronisation point, so each batch is sized to a *time* (the quota, default 300 ms)
rather than a token count. ``predict`` says how long a batch of (cached, new) pairs takes
(a profiled table or the roofline cost model); it must not decrease when any pair's
``new`` grows, which is what makes the binary search valid.

Chunks end on block boundaries (absolute token positions that are multiples of
``block_tokens``), so every chunk but a request's last leaves full blocks behind it and the
next chunk starts aligned; the last chunk is whatever remains.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from dualpath.policy.errors import InvalidRequestError, InvalidThresholdError

__all__ = ["DEFAULT_QUOTA_S", "Chunk", "chunk_sizes", "Predict", "PrefillBatch", "PrefillWork", "pack_prefill_batch"]

DEFAULT_QUOTA_S = 0.300

Predict = Callable[[Sequence[tuple[int, int]]], float]
"""Predicted seconds for a batch of ``(cached_tokens, new_tokens)`` pairs."""


# The hot dataclasses below spell out ``__init__`` (``init=False``): mypyc compiles a written
# ``__init__`` natively, ~15x faster than the one ``dataclasses`` generates (a simulated
# rollout builds tens of millions of these); fields, eq and repr stay the dataclass's.
@dataclass(frozen=True, slots=True, kw_only=True, init=False)
class PrefillWork:
    """A request queued on a prefill engine: ``cached`` tokens already in its KV (hits
    plus chunks computed so far), ``remaining`` tokens still to compute.

    Raises:
        InvalidRequestError: ``cached < 0`` or ``remaining < 1``.
    """

    request_id: int
    cached: int
    remaining: int

    def __init__(self, *, request_id: int, cached: int, remaining: int) -> None:
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "cached", cached)
        object.__setattr__(self, "remaining", remaining)
        self.__post_init__()

    def __post_init__(self) -> None:
        if self.cached < 0 or self.remaining < 1:
            raise InvalidRequestError(
                self.request_id, f"prefill work needs cached >= 0 and remaining >= 1, got {self.cached}, {self.remaining}"
            )


@dataclass(frozen=True, slots=True, kw_only=True, init=False)
class Chunk:
    """Part of a request in a batch: compute ``new`` tokens on top of ``cached``;
    ``completes`` is false when a remainder continues in a later batch."""

    request_id: int
    cached: int
    new: int
    completes: bool

    def __init__(self, *, request_id: int, cached: int, new: int, completes: bool) -> None:
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "cached", cached)
        object.__setattr__(self, "new", new)
        object.__setattr__(self, "completes", completes)


@dataclass(frozen=True, slots=True, kw_only=True, init=False)
class PrefillBatch:
    """One batch: chunks in queue order (all complete but possibly the last), its
    predicted time, and ``over_quota`` when it is a lone minimal chunk that the quota
    cannot hold (taken anyway so the engine makes progress)."""

    chunks: tuple[Chunk, ...]
    predicted_s: float
    over_quota: bool

    def __init__(self, *, chunks: tuple[Chunk, ...], predicted_s: float, over_quota: bool) -> None:
        object.__setattr__(self, "chunks", chunks)
        object.__setattr__(self, "predicted_s", predicted_s)
        object.__setattr__(self, "over_quota", over_quota)


def chunk_sizes(cached: int, remaining: int, block_tokens: int) -> range:
    """The allowed partial chunk sizes of a request, ascending: every size that ends on a
    block boundary and leaves at least one token for later (empty when the request ends
    before its next boundary)."""
    first = block_tokens - cached % block_tokens  # tokens up to the next boundary
    return range(first, remaining, block_tokens)


def pack_prefill_batch(
    queue: Iterable[PrefillWork],
    predict: Predict,
    *,
    quota_s: float = DEFAULT_QUOTA_S,
    block_tokens: int = 64,
) -> PrefillBatch:
    """Pack the next batch from ``queue`` (FIFO; read only as far as the batch reaches, so a
    lazy iterable of a long queue costs the batch, not the queue): whole requests while the prediction
    stays within ``quota_s``; the first request that does not fit is cut to its largest
    block-aligned chunk that fits, and the batch ends there. When not even the smallest
    chunk of the queue's head fits an empty batch, that chunk alone is the batch
    (``over_quota``).

    Raises:
        InvalidThresholdError: ``quota_s`` or ``block_tokens`` is not positive.
    """
    if not quota_s > 0:
        raise InvalidThresholdError("quota_s", quota_s)
    if block_tokens < 1:
        raise InvalidThresholdError("block_tokens", block_tokens)
    pairs: list[tuple[int, int]] = []  # [(cached, new)] of the batch so far
    chunks: list[Chunk] = []
    predicted = 0.0
    for work in queue:
        whole = predict([*pairs, (work.cached, work.remaining)])
        if whole <= quota_s:
            pairs.append((work.cached, work.remaining))
            chunks.append(Chunk(request_id=work.request_id, cached=work.cached, new=work.remaining, completes=True))
            predicted = whole
            continue
        sizes = chunk_sizes(work.cached, work.remaining, block_tokens)
        best = _largest_fit(pairs, work.cached, sizes, predict, quota_s)
        if best is not None:
            new, predicted = best
            chunks.append(Chunk(request_id=work.request_id, cached=work.cached, new=new, completes=False))
        elif not chunks:
            new = sizes[0] if sizes else work.remaining
            predicted = predict([(work.cached, new)])
            chunks.append(
                Chunk(
                    request_id=work.request_id,
                    cached=work.cached,
                    new=new,
                    completes=new == work.remaining,
                )
            )
            return PrefillBatch(chunks=tuple(chunks), predicted_s=predicted, over_quota=True)
        break
    return PrefillBatch(chunks=tuple(chunks), predicted_s=predicted, over_quota=False)


def _largest_fit(
    pairs: list[tuple[int, int]], cached: int, sizes: Sequence[int], predict: Predict, quota_s: float
) -> tuple[int, float] | None:
    """Binary search of the largest size in ``sizes`` whose batch fits the quota, with
    its prediction; None when even the smallest does not fit."""
    lo, hi = 0, len(sizes) - 1
    best: tuple[int, float] | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        t = predict([*pairs, (cached, sizes[mid])])
        if t <= quota_s:
            best = (sizes[mid], t)
            lo = mid + 1
        else:
            hi = mid - 1
    return best
