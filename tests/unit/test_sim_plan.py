"""The planner's split search: it finds what simulating every split finds, with fewer runs."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from dualpath.sim.config import SimConfig
from dualpath.sim.plan import AGENTS_PER_NODE, POLICIES, evaluate, no_bottleneck_range, search_splits
from dualpath.sim.slices import slice_of, slice_split
from dualpath.sim.workload import Workload


def _search(nodes: int, f, infeasible=lambda p: False, policies=("dualpath",)):
    asked: list[tuple[str, int]] = []

    def score(keys):
        asked.extend(keys)
        return {k: f(k[1]) for k in keys if not infeasible(k[1])}

    return search_splits(nodes, policies, score), asked


@pytest.mark.parametrize("nodes", [20, 64, 144])
@pytest.mark.parametrize("where", [0.02, 0.2, 1 / 3, 0.5, 0.77, 0.98])
def test_the_search_finds_the_best_split_of_a_unimodal_metric_with_few_runs(nodes, where):
    best_p = max(1, min(nodes - 1, round(where * nodes)))
    f = lambda p: -abs(math.log(p / (nodes - p)) - math.log(best_p / (nodes - best_p))) - 1e-3 * abs(p - best_p)
    scores, asked = _search(nodes, f)
    found = max(scores, key=scores.__getitem__)
    assert found == ("dualpath", best_p)
    assert len(asked) == len(set(asked))  # no split simulated twice
    assert {("dualpath", p) for p in (best_p - 1, best_p + 1) if 0 < p < nodes} <= set(scores)  # neighbours compared
    if nodes == 144:
        assert len(asked) <= 30  # of 143


def test_each_policy_is_searched_on_its_own_and_infeasible_splits_are_left_out():
    nodes = 144
    peaks = {"dualpath": 48, "basic": 100}
    asked: list[tuple[str, int]] = []

    def score(keys):
        asked.extend(keys)
        return {(pol, p): -abs(p - peaks[pol]) for pol, p in keys if p <= 120}  # past 120 P the weights do not fit D

    scores = search_splits(nodes, POLICIES, score)
    for pol, peak in peaks.items():
        assert max((k for k in scores if k[0] == pol), key=scores.__getitem__) == (pol, peak)
    assert all(p <= 120 for _, p in scores)


def test_a_plateau_or_a_monotone_metric_ends_at_an_edge_or_a_local_best():
    scores, _ = _search(100, lambda p: p)  # more prefill is always better: the last split
    assert max(scores, key=scores.__getitem__) == ("dualpath", 99)
    scores, _ = _search(100, lambda p: -p)
    assert max(scores, key=scores.__getitem__) == ("dualpath", 1)


NODES = 20  # a budget of 19 splits per policy: searched (more than EXHAUSTIVE_SPLITS), small enough to simulate every split


@pytest.fixture(scope="module")
def every_split_whole():
    """Every split of ``NODES`` nodes simulated whole, both policies, as the planner runs them
    (its load per node, 4 turns met mid-trajectory, decode EP auto): JCT by (policy, P)."""
    base = SimConfig(target="ds660b", prefill_nodes=1, decode_nodes=1, decode_ep=0)
    workload = Workload(dataset="64k", agents=round(AGENTS_PER_NODE * NODES), turns=4, start_at=0.5)
    found = evaluate(base, workload, NODES, online=False, slo=(0.0, 0.0), probes=0, say=lambda _: None, exhaustive=True, jobs=2)
    jct = {(r["policy"], r["prefill_nodes"]): r["jct_s"] for r in found.rows if "infeasible" not in r}
    assert found.runs == len(jct) == 2 * (NODES - 2)  # every split whole, a run each; 19P1D: the weights do not fit 1 decode node
    return base, workload, jct


@pytest.mark.timeout(600)  # the fixture simulates 36 runs of 20 nodes (~2 min of CPU)
def test_on_the_simulator_the_search_picks_the_split_that_every_split_picks(every_split_whole):
    """A smaller budget simulated exhaustively, then searched over those same runs: the same best
    split per policy (or one within 0.5% of its JCT: splits that close are a tie to the simulator's
    resolution)."""
    _, _, jct = every_split_whole
    asked: list[tuple[str, int]] = []

    def score(keys):
        asked.extend(keys)
        return {k: -jct[k] for k in keys if k in jct}

    scores = search_splits(NODES, POLICIES, score)
    for policy in POLICIES:
        curve = {k[1]: round(v, 1) for k, v in jct.items() if k[0] == policy}
        exhaustive_best = min((k for k in jct if k[0] == policy), key=jct.__getitem__)
        searched_best = max((k for k in scores if k[0] == policy), key=scores.__getitem__)
        assert jct[searched_best] <= 1.005 * jct[exhaustive_best], (policy, searched_best, exhaustive_best, curve)
        assert curve[1] > 1.1 * jct[exhaustive_best] and curve[NODES - 2] > 1.1 * jct[exhaustive_best], curve  # a real optimum inside
    assert len(asked) < len(jct)


@pytest.mark.timeout(600)  # the fixture simulates 36 runs of 20 nodes (~2 min of CPU)
def test_a_search_on_slices_picks_the_split_that_simulating_every_split_whole_picks(every_split_whole):
    """The planner's evaluator at a scale a test affords: each split of 20 nodes run on a slice of
    8-12 nodes (a ratio in lowest terms beyond 12 nodes is the nearest one within), searched. Its
    best split per policy, valued by the whole runs, is the exhaustive best or within 0.5% of its
    JCT; inside the paper's no-bottleneck range every slice's JCT is within 6% of its split's
    whole JCT."""
    base, workload, whole = every_split_whole
    found = evaluate(base, workload, NODES, online=False, slo=(0.0, 0.0), probes=0, say=lambda _: None, jobs=2, slicing=(8, 12))
    rows = [r for r in found.rows if "infeasible" not in r]
    assert found.runs <= len(rows) < len(whole)  # the search skips most splits (and splits sharing a slice run it once)
    assert all(8 <= r["slice"]["prefill_nodes"] + r["slice"]["decode_nodes"] <= 12 for r in rows)
    assert any(r["slice"]["p_over_d"] != r["p_over_d"] for r in rows)  # some ratios inexact
    for policy in POLICIES:
        sliced_best = min((r for r in rows if r["policy"] == policy), key=lambda r: r["jct_s"])["prefill_nodes"]
        exhaustive_best = min((p for pol, p in whole if pol == policy), key=lambda p: whole[(policy, p)])
        assert whole[(policy, sliced_best)] <= 1.005 * whole[(policy, exhaustive_best)], (policy, sliced_best, exhaustive_best)
    lo, hi = no_bottleneck_range(8, 1.0)
    errors = {(r["policy"], r["prefill_nodes"]): r["jct_s"] / whole[(r["policy"], r["prefill_nodes"])] - 1 for r in rows}
    assert all(abs(e) < 0.06 for (_, p), e in errors.items() if lo <= p / (NODES - p) <= hi), errors


def test_the_cli_searches_a_large_budget_and_reports_how(capsys):
    from dualpath.cli import main as dualpath

    args = ["sim", "plan", "--target", "ds27b", "--gpus", "144", "--agents", "72", "--turns", "1", "--jobs", "1", "--json"]
    assert dualpath(args) == 0
    searched = json.loads(capsys.readouterr().out)
    assert searched["nodes"] == 18 and searched["splits"] == 17 and searched["search"] == "search" and searched["jobs"] == 1
    assert searched["simulated"] == len(searched["frontier"]) < 2 * 17
    assert searched["best"] in searched["frontier"]
    assert searched["slicing"] == {"min_nodes": 12, "max_nodes": 24} and all("slice" in r for r in searched["frontier"])
    check = searched["full_size_check"]  # the best's slice is smaller than the whole, so it was simulated whole too
    assert check["split"] == f"{searched['best']['prefill_nodes']}P{searched['best']['decode_nodes']}D"
    assert check["sliced"] == searched["best"]["jct_s"] and check["slice_error"] == pytest.approx(check["sliced"] / check["jct_s"] - 1)
    for policy, nb in searched["near_best"].items():
        assert nb["p_over_d_min"] <= nb["best"]["p_over_d"] <= nb["p_over_d_max"] and nb["best"]["policy"] == policy
    assert dualpath([*args, "--exhaustive"]) == 0
    every = json.loads(capsys.readouterr().out)
    assert every["search"] == "exhaustive" and every["simulated"] == 2 * 17
    assert every["best"]["jct_s"] <= searched["best"]["jct_s"]  # the same runs, deterministic: the search can only miss


@pytest.mark.parametrize(
    "flag", [["--jobs", "-1"], ["--tolerance", "1.5"], ["--gpus", "8"], ["--slice-nodes", "1"], ["--slice-min-nodes", "1"]]
)
def test_bad_planner_arguments_are_refused_with_a_message(flag, capsys):
    from dualpath.cli import main as dualpath

    argv = ["sim", "plan", "--target", "ds27b", "--gpus", "24", *flag]
    assert dualpath(argv) == 2
    assert "dualpath sim plan:" in capsys.readouterr().err


def test_phases_compare_each_phase_best_split_with_the_static_one_on_a_searched_budget(capsys):
    from dualpath.cli import main as dualpath

    argv = ["sim", "plan", "--target", "ds27b", "--gpus", "144", "--agents", "72", "--turns", "2", "--jobs", "1", "--phases", "--json"]
    assert dualpath(argv) == 0
    result = json.loads(capsys.readouterr().out)
    best = result["best"]
    assert [ph["phase"].split()[0] for ph in result["phases"]] == ["early", "late"]
    for ph in result["phases"]:
        assert ph["static"] == f"{best['prefill_nodes']}P{best['decode_nodes']}D"
        assert ph["best_jct_s"] <= ph["static_jct_s"] and ph["gain"] == pytest.approx(1 - ph["best_jct_s"] / ph["static_jct_s"])


def test_online_plans_rank_by_the_highest_aps_within_the_slo_and_say_which_sweeps_found_the_knee(capsys):
    from dualpath.cli import main as dualpath

    argv = ["sim", "plan", "--target", "ds660b", "--gpus", "48", "--online", "--turns", "2", "--duration", "20", "--jobs", "1", "--json"]
    assert dualpath(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["metric"] == "max_aps"
    feasible = [r for r in result["frontier"] if "infeasible" not in r]
    assert result["best"]["max_aps"] == max(r["max_aps"] for r in feasible)
    assert all(r["max_aps"] > 0 and r["probes"] >= 2 for r in feasible)
    assert result["unbracketed"] == [f"{r['prefill_nodes']}P{r['decode_nodes']}D {r['policy']}" for r in feasible if not r["bracketed"]]
    by = {(r["policy"], r["prefill_nodes"]): r["max_aps"] for r in feasible}
    assert by[("dualpath", 2)] > by[("basic", 2)]  # 2P4D: both SNICs' reads beat the prefill side's alone


@pytest.mark.parametrize(
    ("split", "bounds", "expected"),
    [
        ((48, 96), (12, 24), (4, 8)),  # 1:2 in lowest terms, scaled up to the floor
        ((36, 108), (12, 24), (3, 9)),
        ((72, 72), (4, 12), (2, 2)),
        ((37, 107), (12, 24), (6, 17)),  # 37:107 needs 144 nodes: the nearest ratio within 24
        ((1, 143), (12, 24), (1, 23)),  # an extreme: the nearest is far (reported, not hidden)
        ((5, 7), (12, 24), (5, 7)),  # a whole below the floor is its own slice
        ((47, 97), (1, 0), (47, 97)),  # max 0: no slicing
    ],
)
def test_a_split_is_sliced_to_the_closest_ratio_of_the_fewest_nodes_within_the_bounds(split, bounds, expected):
    assert slice_of(*split, min_nodes=bounds[0], max_nodes=bounds[1]) == expected


def test_a_slice_keeps_the_wholes_load_per_node_and_decode_ep_group():
    """Offline agents scale with the slice's nodes; the decode EP group is the whole's (auto: every
    decode GPU of the whole, at most one routed expert each), not the slice's own."""
    whole = SimConfig(target="ds660b", prefill_nodes=48, decode_nodes=96, decode_ep=0)
    cfg, w, s = slice_split(whole, Workload(agents=49152), min_nodes=12, max_nodes=24, online=False)
    assert (cfg.prefill_nodes, cfg.decode_nodes, s.scale) == (4, 8, 12.0)
    assert cfg.decode_ep == s.decode_ep == 256 and replace(cfg, decode_ep=0).decode_ep_size(16, 256) == 64
    assert w.agents == 49152 // 12
    _, online, _ = slice_split(whole, Workload(agents=1 << 20), min_nodes=12, max_nodes=24, online=True)
    assert online.agents == 1 << 20  # online the sweep's rate sets the arrivals


def test_bad_slice_bounds_are_refused():
    with pytest.raises(ValueError):
        slice_of(3, 5, min_nodes=12, max_nodes=8)
    with pytest.raises(ValueError):
        slice_of(0, 5, min_nodes=1, max_nodes=8)
