"""A min-heap of entries ordered by two native fields, ``(end, seq)``.

``heapq`` over tuples compares two tuples per step, which is several rich comparisons;
compiled, this heap compares the two fields directly (the decode batches' and the storage
links' heaps are popped millions of times a run). ``(end, seq)`` must be unique (``seq``
breaks ties): then entries leave in the same order from any heap, ``heapq``'s included.
The event loop keeps its own heap (``clock``): its events also track their positions.
"""

from __future__ import annotations

__all__ = ["Entry", "MinHeap"]


class Entry:
    """Something in a ``MinHeap``: ``end`` first, ``seq`` among equal ends."""

    __slots__ = ("end", "seq")

    def __init__(self, end: float, seq: int) -> None:
        self.end = end
        self.seq = seq


class MinHeap:
    """``push`` and ``pop`` in ``(end, seq)`` order; ``items[0]`` is the first."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[Entry] = []

    def __len__(self) -> int:
        return len(self.items)

    def push(self, e: Entry) -> None:
        self.items.append(e)
        self._up(e, len(self.items) - 1)

    def _up(self, e: Entry, pos: int) -> None:
        """Put ``e`` at ``pos`` (a hole) or above, moving later parents down."""
        heap = self.items
        end, seq = e.end, e.seq
        while pos > 0:
            parent = (pos - 1) >> 1
            p = heap[parent]
            if end < p.end or (end == p.end and seq < p.seq):
                heap[pos] = p
                pos = parent
            else:
                break
        heap[pos] = e

    def pop(self) -> Entry:
        """The first entry, taken out: the hole at the root sinks along the smaller children
        to a leaf and the last entry fills it from there (as ``heapq`` pops). Raises
        ``IndexError`` when empty."""
        heap = self.items
        last = heap.pop()
        if not heap:
            return last
        top = heap[0]
        n = len(heap)
        pos, child = 0, 1
        while child < n:
            c = heap[child]
            right = child + 1
            if right < n:
                r = heap[right]
                if r.end < c.end or (r.end == c.end and r.seq < c.seq):
                    child, c = right, r
            heap[pos] = c
            pos = child
            child = 2 * pos + 1
        self._up(last, pos)
        return top
