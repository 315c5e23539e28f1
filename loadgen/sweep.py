"""Find the highest arrival rate (APS) whose turns meet the SLO.

Search: probe the start rate; double after a pass (or halve after a failure) until one
rate passes and one fails, then bisect geometrically between the highest pass and the
lowest failure until they are within ``tolerance`` of each other or ``max_probes`` probes
have run. Each probe is an online run of ``duration_s`` seconds (plus its drain) with a
fresh seed for arrivals and prompt text, so a probe never hits the KV cache of an
earlier one. A probe passes when its SLO attainment reaches the target and no turn
failed; a probe with failed turns stops the sweep (the server is in trouble).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

__all__ = ["SweepPlan", "SweepState", "run_sweep", "next_rate"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepPlan:
    """Where the search starts and when it stops."""

    start_rate: float = 1.0
    max_probes: int = 8
    tolerance: float = 0.1


@dataclass(slots=True)
class SweepState:
    """Probed points so far (each a dict: rate, passed, summary figures) and the answer."""

    points: list[dict] = field(default_factory=list)
    best: float | None = None
    lowest_failure: float | None = None
    stopped: str | None = None


def next_rate(plan: SweepPlan, state: SweepState) -> float | None:
    """The next rate to probe, or None when the search is over."""
    if len(state.points) >= plan.max_probes or state.stopped:
        return None
    lo, hi = state.best, state.lowest_failure
    if lo is None and hi is None:
        return plan.start_rate
    if lo is None:
        assert hi is not None  # both None returned above
        return hi / 2
    if hi is None:
        return lo * 2
    if hi / lo - 1 <= plan.tolerance:
        return None
    return math.sqrt(lo * hi)


async def run_sweep(plan: SweepPlan, state: SweepState, probe: Callable[[float, int], Awaitable[dict]]) -> SweepState:
    """Run the search; ``probe(rate, index)`` runs one online load and returns a point.

    A point is a dict with at least ``passed`` (bool) and ``failed_turns`` (int). Raises
    whatever ``probe`` raises; ``state`` keeps every point probed before that.
    """
    while (rate := next_rate(plan, state)) is not None:
        point = await probe(rate, len(state.points))
        point["rate"] = rate
        state.points.append(point)
        if point["failed_turns"]:
            state.stopped = f"probe at {rate:g} APS had {point['failed_turns']} failed turns"
        elif point["passed"]:
            state.best = max(rate, state.best or 0.0)
        else:
            state.lowest_failure = min(rate, state.lowest_failure or math.inf)
    return state
