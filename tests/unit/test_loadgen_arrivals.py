"""Arrival schedules: Poisson and Gamma inter-arrival statistics, offline starts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadgen.arrivals import arrival_times, interarrival_stats


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_poisson_gaps_have_the_configured_mean_and_unit_coefficient_of_variation(seed: int) -> None:
    times = arrival_times(20_000, rate=4.0, seed=seed)
    mean, cv = interarrival_stats(times)
    assert mean == pytest.approx(0.25, rel=0.05)
    assert cv == pytest.approx(1.0, abs=0.1)


def test_poisson_counts_per_window_are_dispersed_like_a_poisson_variable() -> None:
    """Index of dispersion (variance / mean of counts in unit windows) is 1 for Poisson."""
    times = arrival_times(50_000, rate=10.0, seed=5)
    counts = np.bincount(times.astype(int))[:-1]  # drop the last, partial window
    assert counts.mean() == pytest.approx(10.0, rel=0.05)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.1)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 4.0])
def test_gamma_gaps_keep_the_rate_and_have_cv_one_over_sqrt_burstiness(burstiness: float) -> None:
    times = arrival_times(40_000, rate=2.0, burstiness=burstiness, seed=3)
    mean, cv = interarrival_stats(times)
    assert mean == pytest.approx(0.5, rel=0.05)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_offline_schedule_starts_every_agent_at_zero() -> None:
    assert arrival_times(5, rate=None).tolist() == [0.0] * 5


def test_schedules_are_sorted_and_reproducible_from_the_seed() -> None:
    a, b = arrival_times(100, rate=3.0, seed=9), arrival_times(100, rate=3.0, seed=9)
    assert np.array_equal(a, b)
    assert np.all(np.diff(a) >= 0) and a[0] > 0
    assert not np.array_equal(a, arrival_times(100, rate=3.0, seed=10))


@pytest.mark.parametrize("kwargs", [dict(rate=0.0), dict(rate=-1.0), dict(rate=1.0, burstiness=0.0)])
def test_non_positive_rate_or_burstiness_is_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        arrival_times(10, **kwargs)


def test_an_offline_stagger_spaces_the_starts_in_agent_order_and_needs_no_rate() -> None:
    assert arrival_times(4, rate=None).tolist() == [0.0, 0.0, 0.0, 0.0]
    assert arrival_times(4, rate=None, stagger=0.5).tolist() == [0.0, 0.5, 1.0, 1.5]
    for bad in ({"rate": None, "stagger": -0.1}, {"rate": 2.0, "stagger": 0.1}):
        with pytest.raises(ValueError, match="stagger"):
            arrival_times(3, **bad)
