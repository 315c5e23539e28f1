"""A link whose flows cross only it, all in one class: processor sharing in virtual time.

A node's storage NIC directions carry only storage reads (or only block writes), each a
flow over that one link, so max-min fairness there is plain equal sharing. That has an exact
form with one event per link instead of one per flow: a *virtual clock* ``v`` advances at
``capacity / n`` bytes per second while ``n`` flows are active, and a flow of ``b`` bytes
started at virtual time ``v0`` ends when ``v`` reaches ``v0 + b`` (classic processor-sharing
bookkeeping). A start or an end moves only the link's next-completion event; the others'
finish *order* is fixed by their virtual finish times, so nothing else is rescheduled.
Results equal ``FluidNetwork``'s for such flows (a test checks it); the work does not grow
with the number of flows sharing the link.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from dualpath.sim.clock import Deadline, EventLoop
from dualpath.sim.minheap import Entry, MinHeap
from dualpath.sim.series import Series

__all__ = ["SharedLink"]


class _Transfer(Entry):
    """A flow on the link: it ends when the virtual clock reaches ``end``; ``on_done(arg)``."""

    __slots__ = ("arg", "on_done")

    def __init__(self, end: float, seq: int, on_done: Callable[[Any], None], arg: Any) -> None:
        self.end = end
        self.seq = seq
        self.on_done = on_done
        self.arg = arg


class SharedLink:
    """Equal sharing of ``capacity`` bytes/s among the flows started on it (module docstring)."""

    __slots__ = ("_heap", "_n", "_next", "_seq", "_t", "_v", "capacity", "flows_done", "loop", "moved", "name", "series")

    def __init__(self, loop: EventLoop, name: str, capacity: float, series: Series | None = None) -> None:
        if not capacity > 0:
            raise ValueError(f"link {name}: capacity must be positive, got {capacity}")
        self.loop, self.name, self.capacity, self.series = loop, name, capacity, series
        self.moved = 0.0
        self.flows_done = 0
        self._heap = MinHeap()  # the flows (_Transfer) by (virtual finish, start order)
        self._n = 0
        self._v = 0.0  # bytes each active flow has received so far (virtual clock)
        self._t = 0.0  # real time of ``_v``
        self._seq = 0
        self._next = Deadline(loop, self._fire)  # the next completion (a start makes it later: no stale event)

    @property
    def active(self) -> int:
        """Flows in progress."""
        return self._n

    def _advance(self) -> None:
        now = self.loop.now
        dt = now - self._t
        if dt > 0 and self._n:
            self._v += self.capacity / self._n * dt
            moved = self.capacity * dt
            self.moved += moved
            if self.series is not None:
                self.series.add(self._t, now, moved)
        self._t = now

    def start(self, nbytes: float, on_done: Callable[[Any], None], arg: Any = None) -> None:
        """Move ``nbytes``; ``on_done(arg)`` when the last byte arrives (an empty flow ends at
        once, in a later event of the same instant)."""
        if nbytes <= 0:
            self.loop.at(self.loop.now, on_done, arg)
            return
        self._advance()
        self._seq += 1
        self._heap.push(_Transfer(self._v + nbytes, self._seq, on_done, arg))
        self._n += 1
        self._arm()

    def _arm(self) -> None:
        heap = self._heap.items
        if not heap:
            self._next.clear()
            return
        left = heap[0].end - self._v
        if left < 0.0:  # max(left, 0.0) without the call
            left = 0.0
        self._next.set(self.loop.now + left * self._n / self.capacity)

    def _fire(self) -> None:
        self._advance()
        heap, done = self._heap.items, []
        limit = self._v + 1e-6 * max(1.0, self._v * 1e-9)  # float slack: a millionth of a byte per GB served
        if heap and heap[0].end > limit:
            limit = heap[0].end  # this event was armed for the head: it is done
        while heap and heap[0].end <= limit:
            done.append(cast("_Transfer", self._heap.pop()))
        self._n -= len(done)
        self.flows_done += len(done)
        self._arm()
        for t in done:
            t.on_done(t.arg)
