"""The garbage collector's settings for a process that drives a ``SchedulerCore`` at scale."""

from __future__ import annotations

import gc

__all__ = ["GC_THRESHOLDS", "tune_gc"]

# The cyclic garbage collector's thresholds for a process that drives a core at scale. With
# Python's defaults (700, 10, 10) a collection runs every 700 net allocations and keeps
# walking the young objects of ~100,000 live requests; at 10,000 GPUs that cost a third of
# the core's time (dualpath bench scheduler). The core's own objects form no cycles while
# the core lives, so collecting rarely loses nothing.
GC_THRESHOLDS = (100_000, 50, 100)


def tune_gc() -> tuple[int, int, int]:
    """Set ``GC_THRESHOLDS`` for this process (drivers call it: the service, the benchmark);
    returns the previous thresholds. The core itself never touches interpreter settings."""
    previous = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    return previous
