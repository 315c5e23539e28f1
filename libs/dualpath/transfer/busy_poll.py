"""Adaptive busy polling for the tcp transport: spin briefly instead of sleeping in epoll.

A process that sleeps in ``epoll_wait`` pays a wake-up when its peer's bytes arrive; on a
virtual machine whose other core is idle that wake-up (an inter-processor interrupt to a
halted vCPU) costs ~40 us each way, more than all the Python work of a small batch. Mooncake
avoids it with busy-polling threads; Linux offers ``SO_BUSY_POLL`` (but not on loopback);
KVM's halt polling spins a vCPU briefly before it halts. ``BusyPoll`` is the last idea for
one socket: after a side has nothing more to do on a connection it polls the socket without
blocking for up to ``window_s`` before going back to the event loop, and it learns the
window from what happened, as KVM's ``halt_poll_ns`` does:

- a spin that caught the peer's bytes keeps the window;
- bytes that arrived through the event loop within ``max_s`` of the moment the side began
  to wait (a longer spin would have caught them) double the window, from ``start_s``;
- bytes that came later than ``max_s`` (an idle connection, a slow batch) halve it, down to
  zero below ``start_s``: a quiet connection costs no CPU.

A poll that found nothing yields the CPU (``yield_cpu``: ``sched_yield``) before the next:
alone on its core that returns at once, but where the host has fewer free cores than
runnable processes (a small VM shared with other work) the peer that has to answer may be
waiting for this very core, and a spin that kept it would hold the answer back by up to the
whole window; yielding lets the peer run first.

So back-to-back batches (a layer-by-layer KV fetch, a benchmark) run without sleeping on
either side, and a connection used every few milliseconds spins at most a few times before
its window falls to zero. While a side spins its event loop runs nothing else, which bounds
``max_s`` to tens of microseconds' worth of other work; ``max_s = 0`` turns polling off.
"""

from __future__ import annotations

import os

__all__ = ["BusyPoll", "DEFAULT_BUSY_POLL_US", "busy_poll_default", "yield_cpu"]

DEFAULT_BUSY_POLL_US = 250.0  # the longest spin: above a small batch's loopback round trip
ENV = "DUALPATH_TCP_BUSY_POLL_US"


yield_cpu = getattr(os, "sched_yield", lambda: None)  # between a spin's empty polls (see above)


def busy_poll_default() -> float:
    """The longest spin, in us: ``$DUALPATH_TCP_BUSY_POLL_US`` when set, else 250.

    Raises:
        ValueError: the variable is not a number >= 0.
    """
    raw = os.environ.get(ENV)
    if raw is None or raw == "":
        return DEFAULT_BUSY_POLL_US
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be a number of microseconds, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{ENV} must be >= 0, got {value}")
    return value


class BusyPoll:
    """The adaptive spin window of one side of one connection (see the module docstring)."""

    __slots__ = ("max_s", "start_s", "window_s", "waiting_since")

    def __init__(self, max_us: float = DEFAULT_BUSY_POLL_US, start_us: float = 10.0) -> None:
        if max_us < 0 or start_us <= 0:
            raise ValueError(f"busy poll window must be >= 0 (max) and > 0 (start), got {max_us}, {start_us}")
        self.max_s = max_us / 1e6
        self.start_s = min(start_us / 1e6, self.max_s)
        self.window_s = self.max_s  # start eager: a new connection is usually about to be used
        self.waiting_since = 0.0  # when this side began to wait without a spin (0: not waiting)

    @property
    def enabled(self) -> bool:
        """Whether the next wait spins at all."""
        return self.window_s > 0.0

    def caught(self) -> None:
        """A spin caught the peer's bytes: the window stays."""
        self.waiting_since = 0.0

    def missed(self, began: float) -> None:
        """The wait that began at ``began`` (``perf_counter``; a spin's start, or now when
        there was no spin) found no bytes: the side now waits in the event loop."""
        self.waiting_since = began

    def woke(self, now: float) -> None:
        """Bytes arrived through the event loop: learn from how long the side waited."""
        since = self.waiting_since
        if since == 0.0:
            return
        self.waiting_since = 0.0
        if self.max_s == 0.0:
            return
        if now - since <= self.max_s:
            self.window_s = min(self.max_s, max(self.start_s, self.window_s * 2))
        else:
            half = self.window_s / 2
            self.window_s = half if half >= self.start_s else 0.0
