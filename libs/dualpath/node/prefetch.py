"""``PrefetchCache``: a node's prefetched Full Blocks, in its DRAM buffer (agent-aware prefetch,
beyond the paper).

Between an agent's turns (its tool call), the scheduler may ask the traffic manager of the
node likely to serve the next turn to pre-stage the session's persisted blocks. The traffic
manager reads them at the lowest priority (``services/traffic_manager/prefetcher.py``),
through the same checksummed path as any read, and keeps the verified payloads here. A later
``load`` takes the leading blocks it finds here instead of reading them (a memory copy into
the request's slot); the rest come from storage.

**A staged copy is only a hint.** It lives in the node's DRAM beside the request buffer: the
traffic manager's one registered region is the request buffer (``--buffer-mb``, what the
scheduler plans with; requests' slots never hold more) followed by the prefetch cache
(``--prefetch-mb``), and each hint's blocks are one *run*, a slot of the same ``BufferPool``
the requests' slots come from. So prefetch never takes request room, and DualPath's small
buffer (the paper's 80 GB per node) stays what it is while otherwise idle host DRAM holds the
contexts of sessions between turns. Runs are given up before any request waits:

- a request that finds no physical room (``alloc``: runs placed where its slot must go)
  drops runs, oldest first, until it fits;
- runs never exceed ``budget_bytes`` per node (``--prefetch-mb``) nor take room a request
  holds; a hint larger than the room left stages its leading blocks only (``load`` uses
  leading blocks: a tail alone would be useless), and staging never drops another run;
- a run expires ``ttl_s`` after it was opened (``--prefetch-ttl``);
- a load that uses a run's blocks consumes the run (the request's slot holds them now; the
  session's next hint stages the grown context again).

**Retained runs** (no storage read at all): when a request's slot on the node that read its
hits is given back, its leading blocks are the session's context, verified: on the PE read
path the hits its load read (or took from runs) into the PE node's slot, on the DE read path
the decode node's slot, whose hits were loaded and whose new prompt blocks were just persisted
from it. ``retain`` keeps that slot, bytes in place, as a run of those blocks instead of
freeing it, within the same budget, dropped first and expiring as any run. The next turn's
hint then finds them here and stages only what is missing (``Prefetcher``). Staging from
storage costs the storage NIC's idle time; retaining costs none, so it lowers the storage
load itself (what raises the arrival rate the SNICs sustain), as far as the cache holds the
contexts of the sessions between turns.

A next turn that lands on another node simply reads from storage. Counters: bytes staged,
bytes retained, bytes used by loads, bytes dropped (evicted, expired or left over when a run
is consumed).

Layout: run ``r`` holds block ``i`` of its hint at ``r.offset + i * block_bytes`` of the
buffer region ``[blocks][layers, block_tokens, bytes]``, exactly as a request's slot does.
The simulator drives the same cache with no region (``region=None``): placement, budget, TTL,
eviction and the counters are the same, only no byte is copied.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from dualpath.node.buffer import BufferFullError, BufferPool, Slot

__all__ = ["MAX_PENDING_HINTS", "PREFETCH_CACHE_GB", "PREFETCH_OWNER", "PrefetchCache", "PrefetchStats", "Run"]

MAX_PENDING_HINTS: Final = 64  # hints a node's prefetch worker keeps waiting; older ones are dropped first
PREFETCH_OWNER: Final = "prefetch:"  # prefix of the buffer slots that hold runs (never a request id)
# The prefetch cache of an 8-GPU node in the testbed and the simulator, GB: the paper's Qwen
# buffer size (PAPER.md: 80 GB for DeepSeek, 320 GB for Qwen; the SGLang+Mooncake baseline
# needed 1.5 TB), a fraction of a Hopper node's 1-2 TB of host DRAM.
PREFETCH_CACHE_GB = 320.0


@dataclass(slots=True)
class PrefetchStats:
    staged_bytes: int = 0  # verified block bytes read into runs
    retained_bytes: int = 0  # verified block bytes of request slots kept as runs (no storage read)
    used_bytes: int = 0  # of which a load took instead of reading storage
    dropped_bytes: int = 0  # evicted, expired or left over in a consumed run before any load used them
    evictions: int = 0  # runs given up so that a request could have buffer room

    def to_dict(self) -> dict:
        return {
            "prefetch_staged_bytes": self.staged_bytes,
            "prefetch_retained_bytes": self.retained_bytes,
            "prefetch_used_bytes": self.used_bytes,
            "prefetch_dropped_bytes": self.dropped_bytes,
            "prefetch_evictions": self.evictions,
        }


class Run:
    """One hint's blocks in one buffer slot; ``ready[i]``: block ``i`` is staged and verified."""

    __slots__ = ("block_bytes", "digest", "expires", "hashes", "live", "nbytes", "offset", "owner", "ready")

    def __init__(self, owner: str, digest: int, hashes: list[int], block_bytes: int, offset: int, nbytes: int, expires: float) -> None:
        self.owner, self.digest, self.hashes, self.block_bytes = owner, digest, hashes, block_bytes
        self.offset, self.nbytes, self.expires = offset, nbytes, expires
        self.ready = [False] * len(hashes)
        self.live = True


class PrefetchCache:
    """Runs of prefetched blocks in ``pool`` (the node's region), read and written through
    ``region`` (its bytes; None: bookkeeping only, as in the simulator), within
    ``budget_bytes`` for ``ttl_s`` each.

    Raises:
        ValueError: a negative budget or a TTL that is not positive.
    """

    def __init__(
        self, pool: BufferPool, region: memoryview | None, budget_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if budget_bytes < 0 or not ttl_s > 0:
            raise ValueError(f"prefetch budget {budget_bytes} bytes / ttl {ttl_s} s: budget must be >= 0, ttl > 0")
        self.pool, self.region = pool, region
        self.budget, self.ttl, self.clock = budget_bytes, ttl_s, clock
        self._runs: OrderedDict[str, Run] = OrderedDict()  # oldest first
        self._index: dict[tuple[int, int], tuple[Run, int]] = {}  # (digest, hash) -> run, block index (staged blocks)
        self._names = itertools.count()
        self.bytes = 0  # buffer bytes held by runs
        self.peak_bytes = 0  # the most ever held at once
        self.stats = PrefetchStats()

    def __len__(self) -> int:
        return len(self._index)

    def ready_bytes(self) -> int:
        """Block bytes of the runs staged or retained and not yet used, dropped or expired."""
        return sum(r.block_bytes * sum(r.ready) for r in self._runs.values())

    def __contains__(self, key: tuple[int, int]) -> bool:
        entry = self._index.get(key)
        return entry is not None and entry[0].expires > self.clock()

    # ---- staging (the prefetcher) -------------------------------------------------------------
    def open_run(self, digest: int, hashes: list[int], block_bytes: int) -> Run | None:
        """A slot for the leading blocks of ``hashes`` that fit both the budget left and the
        buffer's free room (expired runs are dropped first). Staging never drops another run:
        that would spend the storage NIC to trade one hint for another of the same worth.
        None when not even one block fits."""
        self._expire()
        n = min(len(hashes), (self.budget - self.bytes) // block_bytes) if block_bytes > 0 else 0
        owner = f"{PREFETCH_OWNER}{next(self._names)}"
        while n > 0:
            try:
                slot = self.pool.alloc(owner, n * block_bytes)
                break
            except BufferFullError:
                n //= 2  # the largest free run is smaller: fewer leading blocks
        else:
            return None
        run = Run(owner, digest, list(hashes[:n]), block_bytes, slot.offset, slot.nbytes, self.clock() + self.ttl)
        self._runs[owner] = run
        self.bytes += slot.nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return run

    def retain(self, owner: str, digest: int, hashes: list[int], block_bytes: int) -> bool:
        """Keep the slot of request ``owner``, whose leading blocks hold ``hashes`` (verified),
        as a run instead of freeing it; False (the caller frees it) when it has no slot, the
        blocks do not fit it, or the run would pass the budget. Never drops another run."""
        self._expire()
        slot = self.pool.get(owner)
        n = len(hashes)
        if slot is None or n == 0 or block_bytes <= 0 or n * block_bytes > slot.nbytes or self.bytes + slot.nbytes > self.budget:
            return False
        name = f"{PREFETCH_OWNER}{next(self._names)}"
        self.pool.rename(owner, name)
        run = Run(name, digest, list(hashes), block_bytes, slot.offset, slot.nbytes, self.clock() + self.ttl)
        run.ready = [True] * n
        for i, h in enumerate(run.hashes):
            self._index[(digest, h)] = (run, i)
        self._runs[name] = run
        self.bytes += slot.nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.stats.retained_bytes += n * block_bytes
        return True

    def fill(self, run: Run, i: int, data: memoryview | None) -> bool:
        """Keep verified block ``i`` of ``run`` (False: the run was dropped meanwhile);
        ``data`` is copied into the region (None without one)."""
        if not run.live:
            return False
        bb = run.block_bytes
        if self.region is not None and data is not None:
            start = run.offset + i * bb
            self.region[start : start + bb] = data
        run.ready[i] = True
        self._index[(run.digest, run.hashes[i])] = (run, i)
        self.stats.staged_bytes += bb
        return True

    # ---- use (a load) ---------------------------------------------------------------------------
    def take_prefix(self, digest: int, hashes: list[int], block_bytes: int, dest: memoryview | None) -> int:
        """Copy the leading blocks of ``hashes`` found here into ``dest`` (block i at
        ``i*block_bytes``; None: count them only) and consume the runs they came from; returns
        how many. Stops at the first one absent."""
        self._expire()
        n, used = 0, set()
        for i, h in enumerate(hashes):
            entry = self._index.get((digest, h))
            if entry is None or entry[0].block_bytes != block_bytes:
                break
            run, k = entry
            if dest is not None and self.region is not None:
                src = run.offset + k * block_bytes
                dest[i * block_bytes : (i + 1) * block_bytes] = self.region[src : src + block_bytes]
            used.add(run.owner)
            n += 1
        self.stats.used_bytes += n * block_bytes
        self.stats.dropped_bytes -= n * block_bytes  # _drop counts every staged block of a run; these were used
        for owner in used:
            self._drop(self._runs[owner])
        return n

    # ---- pressure -----------------------------------------------------------------------------
    def alloc(self, owner: str, nbytes: int) -> Slot:
        """A request's slot in the pool, dropping runs (oldest first) until it fits.

        Raises:
            BufferFullError: no room even with every run given up.
        """
        while True:
            try:
                return self.pool.alloc(owner, nbytes)
            except BufferFullError:
                if not self.make_room():
                    raise

    def make_room(self) -> bool:
        """A request found the buffer full: give up the oldest run (False: none left)."""
        if not self._runs:
            return False
        self.stats.evictions += 1
        self._drop(next(iter(self._runs.values())))
        return True

    def _expire(self) -> None:
        now = self.clock()
        for run in [r for r in self._runs.values() if r.expires <= now]:
            self._drop(run)

    def _drop(self, run: Run) -> None:
        run.live = False
        del self._runs[run.owner]
        for i, h in enumerate(run.hashes):
            if run.ready[i]:
                self.stats.dropped_bytes += run.block_bytes
                if self._index.get((run.digest, h), (None,))[0] is run:
                    del self._index[(run.digest, h)]
        self.pool.free(run.owner)
        self.bytes -= run.nbytes
