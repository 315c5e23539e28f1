"""``PrefetchCache``: a node's prefetched Full Blocks (agent-aware prefetch, beyond the paper).

Between an agent's turns (its tool call), the scheduler may ask the traffic manager of the
node likely to serve the next turn to pre-stage the session's persisted blocks. The traffic
manager reads them from storage only while its storage read queue is empty, one block at a
time (a real read waits at most one block behind a prefetch), through the same checksummed
path as any read, and keeps the verified payloads here. A later ``load`` takes the leading
blocks it finds here instead of reading them (a memory copy); the rest come from storage.

A prefetched copy is only a hint: the cache has its own byte budget per node (it never takes
buffer room from a request: the request slots' pool is separate), entries expire after a TTL,
the least recently staged go first when the budget is reached, and a next turn that lands on
another node simply reads from storage. Counters: bytes staged, bytes used by loads, bytes
dropped (expired or evicted unused).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["PrefetchCache", "PrefetchStats"]


@dataclass(slots=True)
class PrefetchStats:
    staged_bytes: int = 0  # verified block bytes read into the cache
    used_bytes: int = 0  # of which a load took instead of reading storage
    dropped_bytes: int = 0  # expired or evicted before any load used them

    def to_dict(self) -> dict:
        return {
            "prefetch_staged_bytes": self.staged_bytes,
            "prefetch_used_bytes": self.used_bytes,
            "prefetch_dropped_bytes": self.dropped_bytes,
        }


class PrefetchCache:
    """Block payloads by ``(model digest, block hash)``, within ``budget_bytes``, for ``ttl_s``.

    Raises:
        ValueError: a negative budget or a TTL that is not positive.
    """

    def __init__(self, budget_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if budget_bytes < 0 or not ttl_s > 0:
            raise ValueError(f"prefetch budget {budget_bytes} bytes / ttl {ttl_s} s: budget must be >= 0, ttl > 0")
        self.budget, self.ttl, self.clock = budget_bytes, ttl_s, clock
        self._blocks: OrderedDict[tuple[int, int], tuple[bytes, float]] = OrderedDict()  # oldest first
        self.bytes = 0
        self.stats = PrefetchStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: tuple[int, int]) -> bool:
        entry = self._blocks.get(key)
        return entry is not None and entry[1] > self.clock()

    def put(self, digest: int, block_hash: int, data: bytes) -> bool:
        """Keep a verified block; evicts the oldest to fit. False if it cannot fit at all."""
        n = len(data)
        if n > self.budget:
            return False
        key = (digest, block_hash)
        old = self._blocks.pop(key, None)
        if old is not None:
            self.bytes -= len(old[0])
        self._expire()
        while self.bytes + n > self.budget and self._blocks:
            _, (dropped, _) = self._blocks.popitem(last=False)
            self.bytes -= len(dropped)
            self.stats.dropped_bytes += len(dropped)
        self._blocks[key] = (data, self.clock() + self.ttl)
        self.bytes += n
        self.stats.staged_bytes += n
        return True

    def take_prefix(self, digest: int, hashes: list[int], block_bytes: int, dest: memoryview) -> int:
        """Copy the leading blocks of ``hashes`` found here into ``dest`` (block i at
        ``i*block_bytes``) and forget them; returns how many. Stops at the first one absent."""
        self._expire()
        n = 0
        for i, h in enumerate(hashes):
            entry = self._blocks.get((digest, h))
            if entry is None or len(entry[0]) != block_bytes:
                break
            dest[i * block_bytes : (i + 1) * block_bytes] = entry[0]
            n += 1
        for h in hashes[:n]:  # used once: the request's slot holds it now, the next turn re-stages
            data, _ = self._blocks.pop((digest, h))
            self.bytes -= len(data)
            self.stats.used_bytes += len(data)
        return n

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, (_, exp) in self._blocks.items() if exp <= now]:
            data, _ = self._blocks.pop(key)
            self.bytes -= len(data)
            self.stats.dropped_bytes += len(data)
