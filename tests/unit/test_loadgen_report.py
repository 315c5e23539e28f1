"""SLO attainment, goodput and percentile definitions of the report."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen.report import AgentRecord, LogHistogram, Slo, TurnRecord, distribution, summarize
from loadgen.sweep import SweepPlan, SweepState, next_rate, next_rates, record

SLO = Slo(ttft_s=1.0, tpot_s=0.1, attainment=0.75)


def _turn(**kw) -> TurnRecord:
    base = dict(agent=0, turn=0, t_start=0.0, expected_prompt_tokens=10, expected_gen_tokens=5)
    return TurnRecord(**{**base, **kw})


@pytest.mark.parametrize(
    ("turn", "outcome"),
    [
        (_turn(ttft=0.5, tpot=0.05), True),
        (_turn(ttft=0.5, tpot=None), True),  # one token: no TPOT to break
        (_turn(ttft=1.5, tpot=0.05), False),
        (_turn(ttft=0.5, tpot=0.2), False),
        (_turn(error_kind="http", error="500"), False),
        (_turn(error_kind="cancelled", e2e=2.0), False),  # cut off after its TTFT bound passed
        (_turn(error_kind="cancelled", ttft=1.2, e2e=2.0), False),
        (_turn(error_kind="cancelled", e2e=0.3), None),  # cut off early: not counted
        (_turn(error_kind="cancelled", ttft=0.2, e2e=3.0), None),
    ],
)
def test_slo_outcome_of_a_turn(turn: TurnRecord, outcome: bool | None) -> None:
    assert turn.slo_outcome(SLO) is outcome


def test_summary_counts_attainment_goodput_and_errors() -> None:
    turns = [
        _turn(ttft=0.2, tpot=0.05, completion_tokens=5, prompt_tokens=10, cached_tokens=5),
        _turn(ttft=0.4, tpot=0.05, completion_tokens=5, prompt_tokens=10, cached_tokens=0),
        _turn(ttft=3.0, tpot=0.05, completion_tokens=4, prompt_tokens=10),
        _turn(error_kind="timeout", error="slow"),
        _turn(error_kind="cancelled", e2e=0.1),
    ]
    agents = [AgentRecord(agent=0, scheduled=0.0, started=0.0, ended=2.0, turns_done=3, turns_total=4, status="failed")]
    s = summarize(turns, agents, slo=SLO, wall_s=2.0, itl=LogHistogram(), launched_at=[0.5], offline=False)
    assert s["slo"]["turns_counted"] == 4 and s["slo"]["attainment"] == 0.5 and s["slo"]["met"] is False
    assert s["goodput"] == {"turns_per_s": 1.0, "output_tokens_per_s": 5.0}
    assert s["turns"]["errors"] == {"timeout": 1, "cancelled": 1} and s["turns"]["completed"] == 3
    assert s["turns"]["gen_length_mismatches"] == 1
    assert s["cache"]["hit_rate"] == pytest.approx(5 / 30)
    assert s["throughput"]["output_tokens_per_s"] == 7.0
    assert s["latency_s"]["ttft"]["p50"] == pytest.approx(0.4) and s["aps"]["achieved"] == 2.0
    assert s["jct_s"] is None and s["agents"]["failed"] == 1


def test_untimed_lead_in_turns_are_left_out_of_every_figure_but_errors() -> None:
    turns = [
        _turn(turn=0, ttft=9.0, tpot=0.5, completion_tokens=5, prompt_tokens=100, cached_tokens=0),  # slow lead-in
        _turn(agent=1, turn=0, error_kind="http", error="500"),  # a failed lead-in is still an error
        _turn(turn=1, ttft=0.5, tpot=0.05, completion_tokens=5, prompt_tokens=10, cached_tokens=10),
        _turn(turn=2, ttft=1.5, tpot=0.05, completion_tokens=5, prompt_tokens=10, cached_tokens=5),
    ]
    agents = [AgentRecord(agent=0, scheduled=0.0, started=0.0, ended=2.0, turns_done=3, turns_total=3, status="done")]
    kw = dict(slo=SLO, wall_s=2.0, itl=LogHistogram(), launched_at=[0.5], offline=False)
    s = summarize(turns, agents, untimed_turns=1, **kw)
    assert s["turns"]["completed"] == 2 and s["turns"]["untimed"] == 1 and s["turns"]["errors"] == {"http": 1}
    assert s["slo"]["turns_counted"] == 2 and s["slo"]["attainment"] == 0.5
    assert s["latency_s"]["ttft"]["max"] == pytest.approx(1.5) and s["cache"]["hit_rate"] == pytest.approx(15 / 20)
    assert s["throughput"]["output_tokens"] == 10
    every = summarize(turns, agents, **kw)  # without the lead-in the slow turn and the failure count
    assert every["turns"]["completed"] == 3 and every["slo"]["turns_counted"] == 4 and every["latency_s"]["ttft"]["max"] == 9.0


def test_log_histogram_percentiles_are_within_one_percent() -> None:
    values = np.random.default_rng(0).lognormal(mean=-4, sigma=1, size=20_000)
    h = LogHistogram()
    for v in values:
        h.add(float(v))
    for q in (50, 90, 99):
        assert h.percentile(q) == pytest.approx(np.percentile(values, q), rel=0.01)
    h.add(0.0)
    assert h.summary()["n"] == 20_001 and h.summary()["max"] == pytest.approx(values.max())


def test_distribution_of_nothing_is_just_a_zero_count() -> None:
    assert distribution([]) == {"n": 0}
    d = distribution([1.0, 2.0, 3.0])
    assert (d["p50"], d["mean"], d["max"], d["n"]) == (2.0, 2.0, 3.0, 3)


def test_sweep_doubles_until_a_failure_then_bisects_to_the_tolerance() -> None:
    plan = SweepPlan(start_rate=1.0, max_probes=20, tolerance=0.1)
    state = SweepState()
    capacity = 5.0
    while (rate := next_rate(plan, state)) is not None:
        state.points.append({"rate": rate})
        if rate <= capacity:
            state.best = max(rate, state.best or 0)
        else:
            state.lowest_failure = min(rate, state.lowest_failure or np.inf)
    assert [p["rate"] for p in state.points[:4]] == [1.0, 2.0, 4.0, 8.0]
    assert 4.5 <= state.best <= capacity < state.lowest_failure <= 1.1 * state.best


def test_sweep_step_takes_fewer_probes_from_a_good_start() -> None:
    def probes(step: float) -> list[float]:
        plan, state = SweepPlan(start_rate=4.6, max_probes=20, tolerance=0.05, step=step), SweepState()
        while (rate := next_rate(plan, state)) is not None:
            state.points.append({"rate": rate})
            if rate <= 5.0:
                state.best = max(rate, state.best or 0)
            else:
                state.lowest_failure = min(rate, state.lowest_failure or np.inf)
        assert 5.0 / 1.05 <= state.best <= 5.0 < state.lowest_failure <= 1.05 * state.best
        return [p["rate"] for p in state.points]

    near = probes(1.2)
    assert near[:2] == pytest.approx([4.6, 4.6 * 1.2])
    assert len(near) < len(probes(2.0))
    with pytest.raises(ValueError, match="step"):
        SweepPlan(step=1.0)


def test_sweep_halves_when_the_start_rate_fails_and_respects_the_probe_budget() -> None:
    plan = SweepPlan(start_rate=8.0, max_probes=3)
    state = SweepState()
    while (rate := next_rate(plan, state)) is not None:
        state.points.append({"rate": rate})
        state.lowest_failure = rate
    assert [p["rate"] for p in state.points] == [8.0, 4.0, 2.0] and state.best is None


def test_a_step_of_one_plus_the_tolerance_ends_the_sweep_once_a_pass_and_a_failure_are_found() -> None:
    """A start from a good prediction (the simulator's scale sweep) steps by exactly 1 + tolerance:
    one pass and the failure one step above bracket the answer, with no bisection after them."""
    plan = SweepPlan(start_rate=3.3, max_probes=10, tolerance=0.05, step=1.05)
    state = SweepState()
    while rates := next_rates(plan, state, 2):
        for rate in rates:
            record(state, {"rate": rate, "passed": rate < 3.4, "failed_turns": 0})
    assert [p["rate"] for p in state.points] == pytest.approx([3.3, 3.3 * 1.05])
    assert state.best == pytest.approx(3.3) and state.lowest_failure == pytest.approx(3.465)
