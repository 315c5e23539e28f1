"""``PrefillBatcher``: a prefill engine's core — ready requests in, the next batch out.

No I/O and no clock of its own. A driver (the prefill engine service with real or modeled
compute, or the simulator in virtual time) steps it through the loop phases SGLang names:

1. *receive*: ``add(request_id, cached=, total=)`` once a request's cached KV is ready
   (``cached`` hit tokens of a ``total``-token prompt; ``remove`` on a cancel);
2. *next batch*: ``next_batch()`` packs the queue by the paper's intra-engine rule (§6.2),
   through ``dualpath.policy.intra.pack_prefill_batch``, the one implementation: FIFO, whole
   requests while the predicted batch time stays within the compute quota, the request that
   would exceed it binary-searched down to its largest block-aligned chunk that fits; a lone
   minimal chunk (one block, or the prompt's short remainder) when nothing fits, so the
   engine always progresses;
3. *run*: the driver runs the batch (its ``items``) however it computes;
4. *process result*: ``finish_batch()`` turns each chunk's tokens into cached ones (chunk
   continuation: the remainder of a cut request stays at the head of the queue) and returns
   the requests whose prompt is done; ``fail_batch()`` drops the batch's requests instead.

``predict`` maps a batch of ``(cached, new)`` pairs to seconds: the roofline cost model on
the modeled backend, a profile measured at start-up on the torch backend (see
``dualpath.engine.profile``). It must not decrease when a pair's ``new`` grows.
One batch is in flight at a time, as on an engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

from dualpath.core.batch_errors import (
    BatchOrderError,
    DuplicateRequestError,
    InvalidRequestError,
)
from dualpath.policy.errors import InvalidThresholdError
from dualpath.policy.intra import (
    DEFAULT_QUOTA_S,
    Predict,
    PrefillWork,
    pack_prefill_batch,
)

__all__ = ["BatchItem", "PrefillBatch", "PrefillBatcher"]


# The hot dataclasses below spell out ``__init__`` (``init=False``): mypyc compiles a written
# ``__init__`` natively, ~15x faster than the one ``dataclasses`` generates (a simulated
# rollout builds tens of millions of these); fields, eq and repr stay the dataclass's.
@dataclass(frozen=True, slots=True, kw_only=True, init=False)
class BatchItem:
    """One request's chunk in a batch: compute tokens ``[cached, cached + new)`` of its prompt;
    ``last`` when the chunk ends the prompt (its logits give the first token)."""

    request_id: str
    cached: int
    new: int
    last: bool

    def __init__(self, *, request_id: str, cached: int, new: int, last: bool) -> None:
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "cached", cached)
        object.__setattr__(self, "new", new)
        object.__setattr__(self, "last", last)


@dataclass(frozen=True, slots=True, kw_only=True, init=False)
class PrefillBatch:
    """The next batch: its chunks in queue order, the predicted seconds, the quota it was
    packed under, and ``over_quota`` when it is a lone minimal chunk the quota cannot hold."""

    items: tuple[BatchItem, ...]
    predicted_s: float
    quota_s: float
    over_quota: bool

    def __init__(self, *, items: tuple[BatchItem, ...], predicted_s: float, quota_s: float, over_quota: bool) -> None:
        object.__setattr__(self, "items", items)
        object.__setattr__(self, "predicted_s", predicted_s)
        object.__setattr__(self, "quota_s", quota_s)
        object.__setattr__(self, "over_quota", over_quota)

    @property
    def chunked(self) -> bool:
        """True when a request of the batch was cut (its remainder runs in a later batch)."""
        return any(not it.last for it in self.items)

    @property
    def new_tokens(self) -> int:
        return sum(it.new for it in self.items)

    @property
    def cached_tokens(self) -> int:
        return sum(it.cached for it in self.items)

    def pairs(self) -> list[tuple[int, int]]:
        """``(cached, new)`` per chunk: what ``predict`` and the cost model take."""
        return [(it.cached, it.new) for it in self.items]


@dataclass(slots=True, init=False)
class _Entry:
    request_id: str
    cached: int  # tokens whose KV exists (hits, then chunks computed so far)
    total: int  # prompt tokens

    def __init__(self, request_id: str, cached: int, total: int) -> None:
        self.request_id = request_id
        self.cached = cached
        self.total = total


class PrefillBatcher:
    """FIFO queue of ready prefill requests packed under a compute quota (module docstring).

    Raises:
        InvalidThresholdError: ``quota_s`` or ``block_tokens`` is not positive.
    """

    def __init__(self, predict: Predict, *, quota_s: float = DEFAULT_QUOTA_S, block_tokens: int = 64) -> None:
        if not quota_s > 0:
            raise InvalidThresholdError("quota_s", quota_s)
        if block_tokens < 1:
            raise InvalidThresholdError("block_tokens", block_tokens)
        self.predict, self.quota_s, self.block_tokens = predict, quota_s, block_tokens
        self._queue: dict[str, _Entry] = {}  # insertion order is FIFO order
        self._in_flight: PrefillBatch | None = None
        self._dropped: set[str] = set()  # removed while their batch was in flight

    # ---- receive -------------------------------------------------------------------------
    def add(self, request_id: str, *, cached: int, total: int) -> None:
        """Queue a request whose first ``cached`` tokens' KV is ready; ``total - cached`` to compute.

        Raises:
            DuplicateRequestError: the request is already queued.
            InvalidRequestError: ``cached < 0`` or no token left to compute.
        """
        if request_id in self._queue:
            raise DuplicateRequestError(request_id)
        if cached < 0 or total <= cached:
            raise InvalidRequestError(request_id, f"needs 0 <= cached < total, got cached={cached}, total={total}")
        self._queue[request_id] = _Entry(request_id, cached, total)

    def remove(self, request_id: str) -> bool:
        """Forget a request (cancelled or failed); False when it is not here. A request of
        the batch in flight is left out of that batch's result."""
        if self._queue.pop(request_id, None) is None:
            return False
        if self._in_flight is not None and any(it.request_id == request_id for it in self._in_flight.items):
            self._dropped.add(request_id)
        return True

    # ---- next batch ----------------------------------------------------------------------
    def next_batch(self) -> PrefillBatch | None:
        """Pack and hand out the next batch (None when nothing is queued).

        Raises:
            BatchOrderError: the previous batch is not finished or failed yet.
        """
        if self._in_flight is not None:
            raise BatchOrderError("the previous batch is still in flight: report it finished or failed first")
        if not self._queue:
            return None
        # Packing stops at the quota: only the queue's head is read (lazily); the packer's
        # request ids are queue positions.
        work = (PrefillWork(request_id=i, cached=e.cached, remaining=e.total - e.cached) for i, e in enumerate(self._queue.values()))
        packed = pack_prefill_batch(work, self.predict, quota_s=self.quota_s, block_tokens=self.block_tokens)
        head = list(islice(self._queue.values(), len(packed.chunks)))
        items = tuple(
            BatchItem(request_id=head[c.request_id].request_id, cached=c.cached, new=c.new, last=c.completes) for c in packed.chunks
        )
        self._in_flight = PrefillBatch(items=items, predicted_s=packed.predicted_s, quota_s=self.quota_s, over_quota=packed.over_quota)
        return self._in_flight

    # ---- process result ------------------------------------------------------------------
    def finish_batch(self) -> list[str]:
        """The batch in flight ran: advance its requests; return those whose prompt is done
        (they leave the queue), in batch order.

        Raises:
            BatchOrderError: no batch is in flight.
        """
        batch, self._in_flight = self._take()
        done = []
        for it in batch.items:
            if it.request_id in self._dropped:
                continue
            entry = self._queue[it.request_id]
            entry.cached = it.cached + it.new
            if it.last:
                del self._queue[it.request_id]
                done.append(it.request_id)
        self._dropped.clear()
        return done

    def fail_batch(self) -> list[str]:
        """The batch in flight failed: its requests leave the queue; returns them (the driver
        fails them so the scheduler can retry).

        Raises:
            BatchOrderError: no batch is in flight.
        """
        batch, self._in_flight = self._take()
        failed = [it.request_id for it in batch.items if it.request_id not in self._dropped]
        for rid in failed:
            self._queue.pop(rid, None)
        self._dropped.clear()
        return failed

    def _take(self) -> tuple[PrefillBatch, None]:
        if self._in_flight is None:
            raise BatchOrderError("no batch is in flight")
        return self._in_flight, None

    # ---- state ---------------------------------------------------------------------------
    @property
    def in_flight(self) -> PrefillBatch | None:
        return self._in_flight

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._queue

    def progress(self, request_id: str) -> int:
        """Tokens of the request whose KV exists (hits plus finished chunks)."""
        return self._queue[request_id].cached

    def tokens_left(self) -> int:
        """Tokens the queued requests still need computed (their share of ``tok_e``)."""
        return sum(e.total - e.cached for e in self._queue.values())
