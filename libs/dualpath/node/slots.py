"""``NodeBuffer``: a node's DRAM buffer as the slots of request attempts, with no I/O and no
clock of its own (every event that depends on time is given ``now``).

The traffic manager drives it from its handlers; what it decides:

- **placement**: a slot per request attempt (``slot_key``), first fit in the region
  (``BufferPool``), within the request buffer's share of the region; staged prefetch runs
  beside it (``PrefetchCache``) are given up first when a request needs the room they hold;
- **use**: a slot is not given back while a storage read or write still uses it: a free that
  comes meanwhile (a retried request, a lost engine) takes effect when the last one ends, so no
  late bytes land in a slot already handed to another request;
- **quarantine**: the slots of attempts a retry gave up are kept out of reuse for
  ``quarantine_s`` (a cancelled prefill batch may still be writing into one);
- **reservations and reclaim**: a slot the scheduler reserved (``alloc`` naming its instance)
  is *claimed* when the decode engine takes the hand-off or persists from it. When the active
  scheduler's heartbeat names another instance, the old one's unclaimed reservations are given
  back ``reclaim_after_s`` after the change (long enough for a hand-off in flight to be claimed);
- **retained runs**: a slot whose leading blocks a load verified (``loaded``), or whose prompt
  blocks were just persisted from it (``keep_prompt``), stays as a prefetch run once freed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from dualpath.node.buffer import BufferFullError, BufferPool, Slot
from dualpath.node.prefetch import PrefetchCache

__all__ = ["QUARANTINE_S", "RECLAIM_AFTER_S", "NodeBuffer", "Reclaimed", "slot_key"]

QUARANTINE_S = 5.0  # a given-up attempt's slot is not reused this long (its prefill's last batch may still write)
RECLAIM_AFTER_S = 30.0  # an inactive scheduler's unclaimed reservations go back this long after the change


def slot_key(request_id: str, attempt: int) -> str:
    """The buffer pool's owner name of a request attempt's slot (ids are subject-safe: no ``#``)."""
    return f"{request_id}#{attempt}"


@dataclass(frozen=True, slots=True)
class Reclaimed:
    """A reservation given back because its scheduler instance is no longer the active one."""

    key: str
    instance: str
    outcome: str  # ``release``'s answer: freed, deferred (a transfer still uses it), no slot


Run = tuple[int, list[int], int]  # (model digest, block hashes, block bytes) of a slot's verified leading blocks


class NodeBuffer:
    """The slots of request attempts in one registered region (see the module docstring)."""

    def __init__(
        self,
        pool: BufferPool,
        buffer_bytes: int,
        cache: PrefetchCache | None = None,
        *,
        quarantine_s: float = QUARANTINE_S,
        reclaim_after_s: float = RECLAIM_AFTER_S,
    ) -> None:
        if buffer_bytes <= 0:
            raise ValueError(f"a request buffer of {buffer_bytes} bytes")
        self.pool, self.cache, self.buffer_bytes = pool, cache, buffer_bytes
        self.quarantine_s, self.reclaim_after_s = quarantine_s, reclaim_after_s
        self._busy: dict[str, int] = {}  # slot key -> storage transfers using its slot
        self._free_later: set[str] = set()
        self._attempts: dict[str, set[int]] = {}  # request id -> attempts holding a slot here
        self._reserved: dict[str, tuple[str, float]] = {}  # unclaimed reservations: key -> (scheduler instance, when)
        self._scheduler = ""  # the active scheduler's instance, as its heartbeat names it
        self._scheduler_since = 0.0
        self._quarantine: dict[str, float] = {}  # slot key -> when a given-up attempt's slot may be reused
        self._loaded: dict[str, Run] = {}  # verified leading blocks a load put in the slot
        self._keep: dict[str, Run] = {}  # runs the slot's free keeps as a prefetch run
        self.reclaimed = 0  # reservations given back after a scheduler change

    # ---- views -------------------------------------------------------------------------------
    def slot(self, request_id: str, attempt: int) -> Slot | None:
        return self.pool.get(slot_key(request_id, attempt))

    @property
    def prefetch_bytes(self) -> int:
        """Bytes of the region held by staged or retained prefetch runs."""
        return self.cache.bytes if self.cache is not None else 0

    def request_bytes(self) -> int:
        """Bytes of the region held by requests' slots (not by staged prefetch runs)."""
        return self.pool.size - self.pool.free_bytes - self.prefetch_bytes

    def free_request_bytes(self) -> int:
        """The request buffer's room (staged runs are not the requests' room)."""
        return self.buffer_bytes - self.request_bytes()

    def room(self) -> int:
        """The largest slot a request could be given now, what the node reports as its free
        buffer: the request buffer's room, and no more than the largest free run of the
        region where no prefetch cache is beside it (with one, a request gives up runs for
        room). Reporting the total free bytes would send the scheduler reservations that
        first-fit fragmentation refuses."""
        free = self.free_request_bytes()
        return free if self.cache is not None else min(free, self.pool.largest_free())

    @property
    def scheduler(self) -> str:
        """The active scheduler's instance, as its heartbeat last named it."""
        return self._scheduler

    # ---- placement ---------------------------------------------------------------------------
    def alloc(self, request_id: str, attempt: int, nbytes: int, *, instance: str = "", now: float = 0.0) -> Slot:
        """A request attempt's slot (the same one again if it has one), within the request buffer;
        staged prefetch runs are dropped, oldest first, when they hold the physical room it needs.
        ``instance``: the scheduler reserving it (claimed later by the decode engine).

        Raises:
            BufferFullError: the request buffer has no room, or no room even without any staged run.
        """
        key = slot_key(request_id, attempt)
        if self.pool.get(key) is None:
            need, used = BufferPool.rounded(nbytes), self.request_bytes()
            if used + need > self.buffer_bytes:
                raise BufferFullError(need, self.buffer_bytes - used, self.buffer_bytes - used)
        slot = self.pool.alloc(key, nbytes) if self.cache is None else self.cache.alloc(key, nbytes)
        self._attempts.setdefault(request_id, set()).add(attempt)
        self._free_later.discard(key)  # allocated again: a pending free of an earlier use no longer applies
        self._keep.pop(key, None)
        if instance:
            self._reserved[key] = (instance, now)
        return slot

    def claim(self, request_id: str, attempt: int) -> None:
        """The decode engine took the slot's hand-off (or persists from it): no longer reclaimable."""
        self._reserved.pop(slot_key(request_id, attempt), None)

    # ---- use and release ---------------------------------------------------------------------
    @contextlib.contextmanager
    def using(self, key: str) -> Iterator[None]:
        """A storage transfer uses the slot ``key`` for the block's duration."""
        self._busy[key] = self._busy.get(key, 0) + 1
        try:
            yield
        finally:
            left = self._busy.pop(key) - 1
            if left:
                self._busy[key] = left
            elif key in self._free_later:
                self._free_later.discard(key)
                self._pool_free(key)

    def release(self, key: str) -> str:
        """Free the slot ``key`` now (``freed``), once the transfers using it end (``deferred``),
        or say it has none (``no slot``)."""
        self._reserved.pop(key, None)
        if key in self._busy:
            self._free_later.add(key)
            return "deferred"
        return "freed" if self._pool_free(key) else "no slot"

    def free(self, request_id: str, attempt: int) -> str:
        """The attempt is done with its slot: a PE read path's slot keeps its hits as a prefetch run."""
        key = slot_key(request_id, attempt)
        loaded = self._loaded.get(key)
        if loaded is not None:
            self._keep.setdefault(key, loaded)  # a run ``keep_prompt`` marked (hits and new prompt blocks) is kept whole
        return self.release(key)

    def give_up_below(self, request_id: str, before: int, now: float) -> int:
        """A retry gave up the attempts below ``before``: their slots are quarantined; how many."""
        older = sorted(a for a in self._attempts.get(request_id, ()) if a < before)
        for a in older:
            key = slot_key(request_id, a)
            self._reserved.pop(key, None)
            self._quarantine.setdefault(key, now + self.quarantine_s)
        return len(older)

    def _pool_free(self, key: str) -> bool:
        rid, _, attempt = key.rpartition("#")
        held = self._attempts.get(rid)
        if held is not None:
            held.discard(int(attempt))
            if not held:
                del self._attempts[rid]
        self._loaded.pop(key, None)
        keep = self._keep.pop(key, None)
        if keep is not None and self.cache is not None and self.cache.retain(key, *keep):
            return True  # the slot is a prefetch run now (a hint, given up first)
        return self.pool.free(key)

    # ---- retained runs -----------------------------------------------------------------------
    def loaded(self, key: str, model_digest: int, hashes: list[int], block_bytes: int) -> None:
        """A load verified the slot's leading ``hashes``: the slot may be retained when freed."""
        if self.cache is not None:
            self._loaded[key] = (model_digest, list(hashes), block_bytes)

    def keep_prompt(self, key: str, model_digest: int, parent_chain: list[int], hashes: list[int], offset: int, block_bytes: int) -> None:
        """The DE read path's slot, its new prompt blocks just persisted from ``offset``: when a
        load read its hits here, the slot holds the whole prompt's blocks (hits, then the new
        ones) and stays as a prefetch run once freed."""
        slot, loaded = self.pool.get(key), self._loaded.get(key)
        if slot is None or loaded is None or slot.offset + len(parent_chain) * block_bytes != offset:
            return
        self._keep[key] = (model_digest, [*parent_chain, *hashes], block_bytes)

    # ---- time --------------------------------------------------------------------------------
    def on_scheduler(self, instance: str, now: float) -> None:
        """The active scheduler's heartbeat named ``instance``."""
        if instance and instance != self._scheduler:
            self._scheduler, self._scheduler_since = instance, now

    def reclaim(self, now: float) -> list[Reclaimed]:
        """Give back the reservations of inactive scheduler instances that nothing claimed within
        ``reclaim_after_s`` of the change (or of their reservation, if later)."""
        if not self._scheduler or now - self._scheduler_since < self.reclaim_after_s:
            return []
        gone = [(k, inst) for k, (inst, t) in self._reserved.items() if inst != self._scheduler and now - t >= self.reclaim_after_s]
        out = [Reclaimed(key, instance, self.release(key)) for key, instance in gone]
        self.reclaimed += len(out)
        return out

    def sweep(self, now: float) -> list[Reclaimed]:
        """Periodic upkeep: quarantined slots whose time is up go back, then ``reclaim``."""
        for key in [k for k, t in self._quarantine.items() if now >= t]:
            del self._quarantine[key]
            self.release(key)
        return self.reclaim(now)
