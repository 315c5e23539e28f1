"""Virtual time: a heap of timestamped callbacks, run in order.

The simulator's only clock. ``at(t, fn, arg)`` schedules ``fn(arg)`` at virtual time ``t``;
``run`` pops events in ``(time, insertion order)`` order, so two events at the same instant
run in the order they were scheduled and a run is deterministic. There is no cancellation:
owners that reschedule (a flow whose rate changed, a decode batch whose membership changed)
tag each event with a version and ignore stale ones, which is cheaper than deleting from a
heap. An owner whose event may only move later (a flow that slowed down) can leave it in
place and, when it fires early, schedule the real one then with ``at_seq`` in the place it
``reserve``d when the time changed: the order of same-instant events is what it would
have been had it rescheduled at once.
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heappop, heappush
from typing import Any

__all__ = ["Deadline", "EventLoop"]

_INF = float("inf")


class EventLoop:
    """A discrete-event loop in virtual seconds, starting at 0."""

    __slots__ = ("_heap", "_seq", "events", "now")

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0  # callbacks run so far (the event volume)
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = 0

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` at virtual time ``t`` (``t`` earlier than now runs now)."""
        self._seq += 1
        now = self.now
        heappush(self._heap, (t if t > now else now, self._seq, fn, arg))  # max(now, t) without the call

    def reserve(self) -> int:
        """A place in the order of same-instant events, taken now for an event that may be
        scheduled later with ``at_seq`` (it then runs where an ``at`` made now would have)."""
        self._seq += 1
        return self._seq

    def at_seq(self, t: float, seq: int, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` at ``t`` (not earlier than now) in the place ``seq`` (from ``reserve``)."""
        heappush(self._heap, (t, seq, fn, arg))

    def after(self, delay: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` ``delay`` seconds from now."""
        self.at(self.now + delay, fn, arg)

    @property
    def pending(self) -> int:
        """Events scheduled and not yet run (stale ones included)."""
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
                t, seq, fn, arg = heappop(heap)
                if t > until:  # once per run: put it back, for a later run
                    heappush(heap, (t, seq, fn, arg))
                    self.now = until
                    return
                self.now = t
                fn(arg)
                count += 1
                if count == next_tick and tick is not None:  # next_tick is -1 without a tick
                    tick(t)
                    next_tick += tick_every
        finally:
            self.events += count


class Deadline:
    """The next event of an owner whose time keeps moving (a decode batch's next leave, a
    storage link's next completion).

    ``set(t)`` moves it to ``t``. An earlier time arms a new event (the armed one goes stale);
    a later one keeps the armed event, and when that fires early it re-arms at ``t`` in the
    place ``set`` reserved (``EventLoop.reserve``): same-instant events run in the order they
    would have had the owner rescheduled at every move, with one event per move fewer. The
    owner's callback gets a ticket and acts only when ``fire(ticket)`` says the time is now.
    """

    __slots__ = ("_armed", "_fn", "_loop", "_seq", "_ticket", "at")

    def __init__(self, loop: EventLoop, fn: Callable[[int], None]) -> None:
        self._loop, self._fn = loop, fn
        self.at = _INF  # when the owner's next event is due (infinite: none)
        self._armed = _INF  # the time of the live event
        self._seq = 0
        self._ticket = 0

    def set(self, t: float) -> None:
        """The owner's next event is due at ``t`` (earlier than now: now)."""
        loop = self._loop
        if t < loop.now:
            t = loop.now
        self.at, self._seq = t, loop.reserve()
        if t < self._armed:
            self._armed = t
            self._ticket += 1
            loop.at_seq(t, self._seq, self._fn, self._ticket)

    def clear(self) -> None:
        """No next event (the armed one, if any, fires and is dropped)."""
        self.at = _INF

    def fire(self, ticket: int) -> bool:
        """The callback ran with ``ticket``: True when the owner's event is due now; False when
        the ticket is stale (an earlier one is armed) or the event re-armed at a later time."""
        if ticket != self._ticket:
            return False
        at = self.at
        if self._loop.now < at:
            self._armed = at
            if at < _INF:
                self._loop.at_seq(at, self._seq, self._fn, ticket)
            return False
        self._armed = _INF
        return True
