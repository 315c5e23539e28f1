"""Synthetic agent sets reproduce the paper's trace statistics (PAPER.md "Traces")."""

from __future__ import annotations

import pytest

from loadgen.synthetic import PAPER_STATS, SPECS, TraceStats, calibrate, generate, trace_stats

_FIELDS = ("avg_turns", "avg_append", "avg_gen", "avg_total", "avg_context")


@pytest.mark.parametrize("name", ["32k", "48k", "64k"])
@pytest.mark.parametrize("seed", [0, 1])
def test_generated_set_matches_every_column_of_the_paper_table_within_5_percent(name: str, seed: int) -> None:
    target = PAPER_STATS[name]
    got = trace_stats(generate(SPECS[name], 500, seed=seed))
    for field in _FIELDS:
        assert getattr(got, field) == pytest.approx(getattr(target, field), rel=0.05), field
    assert 0.95 * target.max_len <= got.max_len <= target.max_len


@pytest.mark.parametrize("name", ["32k", "64k"])
def test_no_agent_exceeds_the_maximum_length_and_every_turn_is_well_formed(name: str) -> None:
    spec = SPECS[name]
    for t in generate(spec, 300, seed=3):
        assert t.total_tokens <= spec.max_len
        assert t.turns >= 1 and len(t.append_tokens) == len(t.gen_tokens) == t.turns
        assert min(t.append_tokens) >= 1 and min(t.gen_tokens) >= 1


def test_generation_is_deterministic_in_the_seed_and_differs_across_seeds() -> None:
    a, b, c = (generate(SPECS["32k"], 50, seed=s) for s in (7, 7, 8))
    assert a == b
    assert a != c


def test_statistics_are_averaged_per_agent_before_across_agents() -> None:
    from loadgen.trajectory import Trajectory

    short = Trajectory(id="a", system_tokens=10, append_tokens=(100,), gen_tokens=(20,))
    long = Trajectory(id="b", system_tokens=0, append_tokens=(1, 1, 1), gen_tokens=(2, 2, 2))
    s = trace_stats([short, long])
    assert s.avg_turns == 2
    assert s.avg_append == pytest.approx((100 + 1) / 2)  # not (100 + 3) / 4
    assert s.avg_total == pytest.approx((130 + 9) / 2)
    assert s.avg_context == pytest.approx((110 + (1 + 4 + 7) / 3) / 2)  # mean prompt per agent
    assert s.max_len == 130


def test_calibrate_fits_a_target_outside_the_paper_table() -> None:
    """A 16K set with the 32K shape: the fit, not the stored constants, has to get there."""
    base = PAPER_STATS["32k"]
    target = TraceStats(agents=500, max_len=16384, avg_turns=40, avg_append=400, avg_gen=120, avg_total=14000, avg_context=8500)
    spec = calibrate("16k", target, agents=600, iterations=8)
    got = trace_stats(generate(spec, 500, seed=2))
    for field in _FIELDS:
        assert getattr(got, field) == pytest.approx(getattr(target, field), rel=0.05), field
    assert spec.max_len == 16384 != base.max_len


def test_calibrate_refuses_a_total_at_or_above_the_maximum_length() -> None:
    bad = TraceStats(agents=1, max_len=1000, avg_turns=5, avg_append=10, avg_gen=10, avg_total=1000, avg_context=500)
    with pytest.raises(ValueError):
        calibrate("bad", bad)


def test_generate_refuses_zero_agents() -> None:
    with pytest.raises(ValueError):
        generate(SPECS["32k"], 0)
