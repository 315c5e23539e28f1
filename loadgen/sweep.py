"""Find the highest arrival rate (APS) whose turns meet the SLO.

Search: probe the start rate; multiply it by ``step`` (default 2) after a pass (or divide
after a failure) until one rate passes and one fails, then bisect geometrically between the highest pass and the
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

__all__ = ["SweepPlan", "SweepState", "next_rate", "next_rates", "record", "run_sweep"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepPlan:
    """Where the search starts and when it stops."""

    start_rate: float = 1.0
    max_probes: int = 8
    tolerance: float = 0.1
    step: float = 2.0  # factor between probes until one passes and one fails: smaller when the start is a good guess

    def __post_init__(self) -> None:
        if not self.step > 1.0:
            raise ValueError(f"step must be > 1, got {self.step}")


@dataclass(slots=True)
class SweepState:
    """Probed points so far (each a dict: rate, passed, summary figures) and the answer."""

    points: list[dict] = field(default_factory=list)
    best: float | None = None
    lowest_failure: float | None = None
    stopped: str | None = None


def next_rate(plan: SweepPlan, state: SweepState) -> float | None:
    """The next rate to probe, or None when the search is over."""
    rates = next_rates(plan, state, 1)
    return rates[0] if rates else None


def next_rates(plan: SweepPlan, state: SweepState, k: int) -> list[float]:
    """Up to ``k`` rates to probe at once (empty when the search is over): the next ``k`` steps
    out from the start, the highest pass or the lowest failure; once bracketed, ``k`` points
    splitting the bracket evenly in log(rate) (k = 1: its geometric midpoint). Parallel probes
    (a simulator on several cores) shrink the bracket (k + 1)-fold per round instead of 2-fold."""
    k = min(k, plan.max_probes - len(state.points))
    if k <= 0 or state.stopped:
        return []
    lo, hi = state.best, state.lowest_failure
    if lo is None and hi is None:
        return [plan.start_rate * plan.step**i for i in range(k)]
    if lo is None:
        assert hi is not None  # both None returned above
        return [hi / plan.step ** (i + 1) for i in range(k)]
    if hi is None:
        return [lo * plan.step ** (i + 1) for i in range(k)]
    if hi / lo - 1 <= plan.tolerance + 1e-9:  # a step of exactly 1 + tolerance brackets within it
        return []
    return [lo * (hi / lo) ** ((i + 1) / (k + 1)) for i in range(k)]


async def run_sweep(plan: SweepPlan, state: SweepState, probe: Callable[[float, int], Awaitable[dict]]) -> SweepState:
    """Run the search; ``probe(rate, index)`` runs one online load and returns a point.

    A point is a dict with at least ``passed`` (bool) and ``failed_turns`` (int). Raises
    whatever ``probe`` raises; ``state`` keeps every point probed before that.
    """
    while (rate := next_rate(plan, state)) is not None:
        point = await probe(rate, len(state.points))
        point["rate"] = rate
        record(state, point)
    return state


def record(state: SweepState, point: dict) -> None:
    """Add a probed ``point`` (``rate``, ``passed``, ``failed_turns``) to ``state``: it raises the
    highest pass, lowers the lowest failure, or (failed turns) stops the search."""
    state.points.append(point)
    rate = point["rate"]
    if point["failed_turns"]:
        state.stopped = f"probe at {rate:g} APS had {point['failed_turns']} failed turns"
    elif point["passed"]:
        state.best = max(rate, state.best or 0.0)
    else:
        state.lowest_failure = min(rate, state.lowest_failure or math.inf)
