"""Virtual time: a heap of timestamped events, run in order.

The simulator's only clock. ``at(t, fn, arg)`` schedules ``fn(arg)`` at virtual time ``t``;
``run`` pops events in ``(time, insertion order)`` order, so two events at the same instant
run in the order they were scheduled and a run is deterministic.

Owners whose next event keeps moving (a flow whose rate changes, a decode batch whose
membership changes, a storage link's next completion) are themselves an ``Event`` and are in
the heap at most once: moved earlier, the event sifts up in place (no stale copy is left
behind); moved later, it stays where it is and, when it fires early, goes back in at its
real time in the place it ``reserve``d when the time changed. Same-instant events run in the
order they would have had the owner rescheduled at every move, with no event per move.

The heap is written out here rather than ``heapq`` over tuples: it orders by two native
fields (``t``, ``seq``) and keeps each event's position, which is what moving one in place
needs, and compiled it compares without a rich comparison per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

__all__ = ["Deadline", "Event", "EventLoop"]

_INF: Final = float("inf")


class Event:
    """Something that happens at a virtual time: ``fire()`` runs it. ``t`` and ``seq`` are
    its place in the loop's order while it is scheduled (``pos`` >= 0, its index in the heap;
    -1: not scheduled)."""

    __slots__ = ("pos", "seq", "t")

    def __init__(self) -> None:
        self.t = _INF
        self.seq = 0
        self.pos = -1

    def fire(self) -> None:
        raise NotImplementedError


class _Call(Event):
    """``fn(arg)`` at a time (``EventLoop.at``)."""

    __slots__ = ("arg", "fn")

    def __init__(self, t: float, seq: int, fn: Callable[[Any], None], arg: Any) -> None:
        self.t = t
        self.seq = seq
        self.pos = -1
        self.fn = fn
        self.arg = arg

    def fire(self) -> None:
        self.fn(self.arg)


class EventLoop:
    """A discrete-event loop in virtual seconds, starting at 0."""

    __slots__ = ("_heap", "_seq", "events", "now")

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0  # events run so far (the event volume)
        self._heap: list[Event] = []
        self._seq = 0

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` at virtual time ``t`` (``t`` earlier than now runs now)."""
        self._seq += 1
        now = self.now
        self._up(_Call(t if t > now else now, self._seq, fn, arg), len(self._heap))  # max(now, t) without the call

    def after(self, delay: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` ``delay`` seconds from now."""
        self.at(self.now + delay, fn, arg)

    def reserve(self) -> int:
        """A place in the order of same-instant events, taken now for an event that may be
        scheduled later with ``schedule`` (it then runs where an ``at`` made now would have)."""
        self._seq += 1
        return self._seq

    def schedule(self, ev: Event, t: float, seq: int) -> None:
        """Run ``ev`` at ``t`` (not earlier than now) in the place ``seq`` (from ``reserve``);
        scheduled already, it moves there in place."""
        pos = ev.pos
        if pos >= 0 and (t > ev.t or (t == ev.t and seq > ev.seq)):  # later: out, and back in below
            self._remove(pos)
            pos = -1
        ev.t = t
        ev.seq = seq
        self._up(ev, len(self._heap) if pos < 0 else pos)

    def _up(self, ev: Event, pos: int) -> None:
        """Put ``ev`` at ``pos`` (the end: a new slot; else a hole, or its own slot with an
        earlier place) and sift it towards the root."""
        heap = self._heap
        if pos == len(heap):
            heap.append(ev)
        t, seq = ev.t, ev.seq
        while pos > 0:
            parent = (pos - 1) >> 1
            p = heap[parent]
            pt = p.t
            if t < pt or (t == pt and seq < p.seq):
                heap[pos] = p
                p.pos = pos
                pos = parent
            else:
                break
        heap[pos] = ev
        ev.pos = pos

    def _sink(self, pos: int) -> int:
        """Move the hole at ``pos`` down the smaller children to a leaf; return the leaf."""
        heap = self._heap
        n = len(heap)
        child = 2 * pos + 1
        while child < n:
            c = heap[child]
            right = child + 1
            if right < n:
                r = heap[right]
                if r.t < c.t or (r.t == c.t and r.seq < c.seq):
                    child = right
                    c = r
            heap[pos] = c
            c.pos = pos
            pos = child
            child = 2 * pos + 1
        return pos

    def _remove(self, pos: int) -> Event:
        """Take the event at ``pos`` off the heap: the hole sinks to a leaf and the last event
        fills it from there (as ``heapq`` pops: fewer comparisons than sifting it down)."""
        heap = self._heap
        ev = heap[pos]
        ev.pos = -1
        last = heap.pop()
        if pos < len(heap):
            self._up(last, self._sink(pos))
        return ev

    @property
    def pending(self) -> int:
        """Events scheduled and not yet run."""
        return len(self._heap)

    def run(self, until: float = float("inf"), *, tick: Callable[[float], None] | None = None, tick_every: int = 20_000) -> None:
        """Run events until the heap is empty or the next one is later than ``until``.

        ``tick(now)`` is called every ``tick_every`` events (a progress bar's hook).
        """
        heap = self._heap
        count = 0
        next_tick = tick_every if tick is not None else -1
        try:
            while heap:
                t = heap[0].t
                if t > until:  # left in place, for a later run
                    self.now = until
                    return
                ev = self._remove(0)
                self.now = t
                ev.fire()
                count += 1
                if count == next_tick and tick is not None:  # next_tick is -1 without a tick
                    tick(t)
                    next_tick += tick_every
        finally:
            self.events += count


class Deadline(Event):
    """The next event of an owner whose time keeps moving (a decode batch's next leave, a
    storage link's next completion, a flow's end): ``due()`` runs once it is due, which calls
    ``fn()`` (a subclass, such as ``network.Flow``, overrides ``due`` instead).

    ``set(t)`` moves it to ``t``: earlier, the event moves up in the loop's heap; later, it
    keeps its place and, when it fires early, goes back in at ``t`` in the place ``set``
    reserved (``EventLoop.reserve``): same-instant events run in the order they would have had
    the owner rescheduled at every move, with one event per move fewer."""

    __slots__ = ("_fn", "_loop", "_seq", "at")

    def __init__(self, loop: EventLoop, fn: Callable[[], None] | None = None) -> None:
        self.t = _INF
        self.seq = 0
        self.pos = -1
        self._loop, self._fn = loop, fn
        self.at = _INF  # when the owner's next event is due (infinite: none)
        self._seq = 0  # its place among same-instant events

    def set(self, t: float) -> None:
        """The owner's next event is due at ``t`` (earlier than now: now)."""
        loop = self._loop
        if t < loop.now:
            t = loop.now
        self.at, self._seq = t, loop.reserve()
        if self.pos < 0 or t < self.t:
            loop.schedule(self, t, self._seq)

    def clear(self) -> None:
        """No next event (a scheduled one fires and is dropped)."""
        self.at = _INF

    def fire(self) -> None:
        at = self.at
        if self._loop.now < at:  # moved later since it was scheduled (or cleared)
            if at < _INF:
                self._loop.schedule(self, at, self._seq)
            return
        self.due()

    def due(self) -> None:
        """The owner's event is due now."""
        if self._fn is not None:
            self._fn()
