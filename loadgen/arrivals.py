"""Agent arrival schedules: offline (all at once), Poisson, or Gamma with burstiness.

Gamma inter-arrival times follow vLLM's ``benchmark_serving`` convention: shape =
``burstiness``, scale = ``1 / (rate * burstiness)``. The mean gap is always ``1 / rate``;
the coefficient of variation is ``1 / sqrt(burstiness)``. ``burstiness = 1`` is a Poisson
process; below 1 arrivals come in bursts, above 1 they are more even than Poisson.
"""

from __future__ import annotations

import numpy as np

__all__ = ["arrival_times", "interarrival_stats"]


def arrival_times(agents: int, *, rate: float | None, burstiness: float = 1.0, seed: int = 0, stagger: float = 0.0) -> np.ndarray:
    """Arrival offsets in seconds from the start, ascending, one per agent.

    ``rate`` None means offline: every agent at 0, or agent ``i`` at ``i * stagger`` (a burst
    spaced just enough that a server sees it in the agents' order). The first agent arrives
    one inter-arrival gap after the start, so ``agents / times[-1]`` estimates the rate
    without bias from a free first arrival.

    Raises ValueError for agents < 0, rate <= 0, burstiness <= 0, stagger < 0, or a stagger
    with a rate.
    """
    if agents < 0:
        raise ValueError(f"agents must be >= 0, got {agents}")
    if not stagger >= 0 or (stagger and rate is not None):
        raise ValueError(f"stagger must be >= 0 and spaces offline starts only, got stagger={stagger} rate={rate}")
    if rate is None:
        return stagger * np.arange(agents, dtype=np.float64)
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0, got rate={rate} burstiness={burstiness}")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=agents)  # [agents]
    return np.cumsum(gaps)


def interarrival_stats(times: np.ndarray) -> tuple[float, float]:
    """Mean and coefficient of variation of the gaps of an arrival schedule.

    The first gap is measured from 0. Raises ValueError with fewer than two arrivals.
    """
    if len(times) < 2:
        raise ValueError("need at least two arrivals")
    gaps = np.diff(np.concatenate(([0.0], np.asarray(times, dtype=np.float64))))
    mean = float(gaps.mean())
    return mean, float(gaps.std() / mean) if mean > 0 else 0.0
