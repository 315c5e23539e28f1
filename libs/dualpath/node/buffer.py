"""``BufferPool``: slots of a node's DRAM buffer, one per request (first fit, coalescing free list).

A slot holds a request's KV as a run of Full Blocks ``[blocks][layers, block_tokens, bytes]``,
so the Layer Block of block ``b`` and layer ``l`` is the contiguous byte range
``offset + b*block_bytes + l*layer_bytes`` of length ``layer_bytes``: streaming a layer
never converts layout, and a Full Block read from storage lands where it will be used.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Final

__all__ = ["BufferFullError", "BufferPool", "Slot"]

_ALIGN: Final = 4096


class BufferFullError(Exception):
    """Raised by ``BufferPool.alloc`` when no free run is large enough (the caller retries later)."""

    def __init__(self, requested: int, free: int, largest: int) -> None:
        super().__init__(f"buffer full: need {requested} bytes, {free} free (largest run {largest})")
        self.requested = requested
        self.free = free


@dataclass(slots=True, kw_only=True, init=False)
class Slot:
    """``nbytes`` at ``offset`` of the pool, held by ``owner``. Treat it as immutable: it is not
    ``frozen`` because a frozen dataclass's generated ``__init__`` (``object.__setattr__`` per
    field) stays interpreted Python under mypyc, and the simulator makes one per reservation."""

    owner: str
    offset: int
    nbytes: int

    def __init__(self, *, owner: str, offset: int, nbytes: int) -> None:
        self.owner = owner
        self.offset = offset
        self.nbytes = nbytes


class BufferPool:
    """Allocator over ``[0, size)``; owners are request ids (one slot per owner and tag)."""

    def __init__(self, size: int) -> None:
        self.size = size
        # The free runs, sorted by offset, as two lists of ints (no tuple per run or per
        # comparison): ``_starts[i]`` and ``_lengths[i]`` are one run.
        self._starts: list[int] = [0]
        self._lengths: list[int] = [size]
        self._slots: dict[str, Slot] = {}
        self.free_bytes = size  # the free runs' total, kept as slots come and go

    @staticmethod
    def rounded(nbytes: int) -> int:
        """The bytes a slot of ``nbytes`` takes (rounded up to 4 KiB, at least 4 KiB)."""
        return max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)

    def largest_free(self) -> int:
        """Bytes of the largest free run: the largest slot ``alloc`` could place now."""
        return max(self._lengths, default=0)

    def get(self, owner: str) -> Slot | None:
        return self._slots.get(owner)

    def alloc(self, owner: str, nbytes: int) -> Slot:
        """Reserve ``nbytes`` (rounded up to 4 KiB) for ``owner``; idempotent per owner.

        Raises:
            BufferFullError: no free run fits.
            ValueError: ``owner`` already holds a slot of a different size.
        """
        existing = self._slots.get(owner)
        if existing is not None:
            if existing.nbytes < nbytes:
                raise ValueError(f"{owner} already holds {existing.nbytes} bytes, asked for {nbytes}")
            return existing
        need = self.rounded(nbytes)
        starts, lengths = self._starts, self._lengths
        for i in range(len(lengths)):
            length = lengths[i]
            if length >= need:
                off = starts[i]
                if length == need:
                    del starts[i]
                    del lengths[i]
                else:
                    starts[i] = off + need
                    lengths[i] = length - need
                slot = Slot(owner=owner, offset=off, nbytes=need)
                self._slots[owner] = slot
                self.free_bytes -= need
                return slot
        raise BufferFullError(need, self.free_bytes, self.largest_free())

    def free(self, owner: str) -> bool:
        """Release ``owner``'s slot (False when it held none); merges neighbouring free runs."""
        slot = self._slots.pop(owner, None)
        if slot is None:
            return False
        self.free_bytes += slot.nbytes
        starts, lengths = self._starts, self._lengths
        off, length = slot.offset, slot.nbytes
        i = bisect.bisect_left(starts, off)
        # merge with the right neighbour, then the left one
        if i < len(starts) and off + length == starts[i]:
            length += lengths[i]
            del starts[i]
            del lengths[i]
        if i > 0 and starts[i - 1] + lengths[i - 1] == off:
            lengths[i - 1] += length
        else:
            starts.insert(i, off)
            lengths.insert(i, length)
        return True

    def rename(self, owner: str, new_owner: str) -> Slot:
        """Hand ``owner``'s slot, bytes in place, to ``new_owner`` (a request's slot kept as a
        prefetch run: ``PrefetchCache.retain``).

        Raises:
            KeyError: ``owner`` holds no slot.
            ValueError: ``new_owner`` already holds one.
        """
        if new_owner in self._slots:
            raise ValueError(f"{new_owner} already holds a slot")
        old = self._slots.pop(owner)
        slot = self._slots[new_owner] = Slot(owner=new_owner, offset=old.offset, nbytes=old.nbytes)
        return slot

    def owners(self) -> list[str]:
        return list(self._slots)
