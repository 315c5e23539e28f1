"""``dualpath sim``: the reports it writes, the reduced paper and validate forms, bad input."""

from __future__ import annotations

import json

import pytest

from dualpath.cli import main as dualpath


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = dualpath(["sim", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_offline_reports_the_testbed_experiment_fields(capsys):
    code, out, _ = run(
        capsys,
        "offline",
        "--target",
        "ds27b",
        "--topology",
        "1P1D",
        "--engines-per-node",
        "2",
        "--agents",
        "12",
        "--turns",
        "2",
        "--start-at",
        "0.5",
        "--modes",
        "basic,dualpath",
        "--json",
    )
    assert code == 0
    result = json.loads(out)
    row = result["modes"]["dualpath"]
    for key in (
        "jct_s",
        "cache_hit_rate",
        "snic_read_utilisation",
        "snic_bytes_max_over_avg",
        "attention_max_over_avg_early",
        "snic_series",
        "ttft_share",
        "wall_s",
        "cpu_s",
        "peak_memory_mb",
    ):
        assert key in row
    for key in ("ttft", "ttft_queue", "ttft_exec", "ttst", "tpot"):
        assert {"p50", "p90", "p99"} <= row["latency_s"][key].keys()
    assert row["ttft_share"]["queueing"] + row["ttft_share"]["execution"] == pytest.approx(1.0)
    assert result["modes"]["basic"]["snic_bytes_read"]["d0"] == 0  # Basic never reads on the decode side
    assert result["ratios"]["basic/dualpath"] > 0


@pytest.mark.slow
def test_offline_writes_result_json_and_pngs(capsys, tmp_path):
    code, out, _ = run(
        capsys,
        "offline",
        "--target",
        "ds27b",
        "--topology",
        "1P1D",
        "--engines-per-node",
        "1",
        "--agents",
        "4",
        "--turns",
        "1",
        "--modes",
        "dualpath",
        "--json",
        "--out",
        str(tmp_path),
    )
    assert code == 0
    assert json.loads((tmp_path / "result.json").read_text()) == json.loads(out)
    assert (tmp_path / "jct.png").stat().st_size > 0 and (tmp_path / "snic_utilisation.png").stat().st_size > 0


@pytest.mark.parametrize(
    "argv",
    [
        ["offline", "--topology", "0P1D"],
        ["offline", "--modes", "basic,warp"],
        ["offline", "--target", "gpt5"],
        ["offline", "--agents", "0"],
        ["offline", "--decode-ep", "lots"],
        ["offline", "--topology", "1P1D", "--agents", "4"],  # DS 660B's weights do not fit one node's decode EP group
        ["online", "--rate", "-1"],
        ["teleport"],
        ["validate", "--topologies", "1X1Y", "--recorded"],
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(capsys, argv):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_quick_paper_table_has_one_row_per_figure_and_the_calibration(capsys):
    code, out, _ = run(capsys, "paper", "--size", "quick", "--offline-only", "--jobs", "1", "--json")
    assert code == 0
    result = json.loads(out)
    rows = result["rows"]
    names = [r["name"] for r in rows]
    assert len(names) == len(set(names)) >= 25
    assert {
        "ds660b_2p4d_dualpath_over_basic",
        "ds27b_1p1d_dualpath_over_basic",
        "snic_max_over_avg_round_robin",
        "ablation_scheduler_jct_reduction_pct",
        "scale_offline_jct_ratio",
        "pd_speedup_max",
    } <= set(names)
    for r in rows:
        assert set(r) >= {"name", "paper", "sim", "ratio", "within", "note"}
        assert r["sim"] is not None and r["ratio"] == pytest.approx(r["sim"] / r["paper"])
        if not r["within"]:
            assert ">15%" in r["note"], r  # an outside row says why
    assert result["within"] == sum(r["within"] for r in rows)
    ranged = {r["name"]: r for r in rows if "range" in r}
    lo, hi = ranged["ds27b_1p1d_dualpath_over_oracle"]["range"]
    assert (lo, hi) == (1.09, 1.85) and ranged["ds27b_1p1d_dualpath_over_oracle"]["paper"] == pytest.approx((lo + hi) / 2)
    keys = {c["key"] for c in result["calibration"]}
    assert {"gpu_fp8_flops", "gemm_fraction", "attention_fraction", "hbm_fraction", "snic_gbps", "decode_all_to_all_us"} <= keys
    assert result["absolute"]["offline_scale"]["paper"]["jct_s"] == 3201.0


def _storage_bound_lower_bound(result_modes: dict, nodes: int, snic_bytes_per_s: float) -> dict[str, float]:
    """Per mode: the seconds the cluster's storage NICs need for the bytes the run read."""
    return {m: sum(r["snic_bytes_read"].values()) / (nodes * snic_bytes_per_s) for m, r in result_modes.items()}


def test_validate_with_recorded_testbed_figures_reports_both_jcts_and_host_time_only_adds(capsys):
    """The recorded form's table: every pair present, the ratio is sim/testbed, and the testbed's
    decode host time per step, the simulator's one input from it, lengthens each simulated job."""
    code, out, _ = run(capsys, "validate", "--recorded", "--json")
    assert code == 0
    rows = json.loads(out)["rows"]
    assert [(r["topology"], r["mode"]) for r in rows] == [(t, m) for t in ("1P1D", "2P1D", "1P2D") for m in ("basic", "dualpath")]
    for r in rows:
        assert r["testbed_jct"] > 0 and r["sim_jct"] > 0 and r["ratio"] == pytest.approx(r["sim_jct"] / r["testbed_jct"])
        assert r["within_10pct"] == (abs(r["ratio"] - 1) <= 0.10)
        assert r["sim_jct"] > r["sim_jct_gpu_only"] and r["ratio_gpu_only"] == pytest.approx(r["sim_jct_gpu_only"] / r["testbed_jct"])


def test_the_testbed_configuration_obeys_storage_and_read_path_laws():
    """What a broken simulator violates, on validate's own configuration (one engine per node, FIFO
    storage reads): no job ends before its storage NICs could read what it read; Basic reads only on
    prefill nodes; DualPath, pooling every node's SNIC, finishes a storage-bound job faster, and a
    slower decode host (more time per step) makes every job longer."""
    from dualpath.sim.experiments import run_offline
    from dualpath.sim.validate import testbed_config
    from dualpath.sim.workload import Workload

    w = Workload(dataset="64k", agents=16, turns=2, start_at=0.5, stagger_s=0.002)
    for topology, nodes in (("1P1D", 2), ("1P2D", 3)):
        cfg = testbed_config(topology)
        modes = run_offline(cfg, w, ["basic", "dualpath"], progress=False)["modes"]
        floor = _storage_bound_lower_bound(modes, nodes, cfg.snic_bytes_per_s())
        assert modes["dualpath"]["jct_s"] >= floor["dualpath"]
        assert modes["basic"]["jct_s"] >= floor["basic"] * nodes  # Basic reads through the one prefill node's SNIC only
        assert all(b == 0 for n, b in modes["basic"]["snic_bytes_read"].items() if n.startswith("d"))
        assert modes["dualpath"]["jct_s"] < modes["basic"]["jct_s"]
        slow = run_offline(testbed_config(topology, host={"fixed_s": 2e-3, "per_request_s": 1e-4}), w, ["dualpath"], progress=False)
        assert slow["modes"]["dualpath"]["jct_s"] > modes["dualpath"]["jct_s"]


def test_plan_ranks_the_splits_of_a_budget_and_checks_the_paper_range(capsys):
    code, out, _ = run(capsys, "plan", "--target", "ds27b", "--gpus", "24", "--agents", "16", "--turns", "2", "--json")
    assert code == 0
    result = json.loads(out)
    assert {(r["prefill_nodes"], r["decode_nodes"]) for r in result["frontier"]} == {(1, 2), (2, 1)}
    assert result["best"]["jct_s"] == min(r["jct_s"] for r in result["frontier"])
    assert result["no_bottleneck_range"] == pytest.approx([1 / 7, 3.5])


def _echo(**kw) -> dict:
    return {"kw": kw, "cpu_s": 0.0}


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_table_run_that_waits_on_another_starts_after_it_with_arguments_from_its_result(jobs):
    """The online scale sweep starts from 2P4D's answer: ``_execute`` holds a run with ``after``
    until the run it names has ended, sets its arguments from that result, and runs every run."""
    from dualpath.sim.paper import Run, _execute, _scaled_start

    runs = [
        Run("big", _echo, {"start_rate": 1.0}, 50.0, ("small", lambda kw, small: {**kw, "from": small["kw"]["rate"]})),
        Run("heavy", _echo, {}, 40.0),
        Run("small", _echo, {"rate": 1.5}, 20.0),
        Run("light", _echo, {}, 1.0),
    ]
    lines: list[str] = []
    out = _execute(runs, jobs, lines.append)
    assert set(out) == {"big", "heavy", "small", "light"}
    assert out["big"]["kw"] == {"start_rate": 1.0, "from": 1.5}
    ended = [line.split(": ")[-1].split(" (")[0] for line in lines if "s CPU" in line]
    assert ended.index("small") < ended.index("big")
    if jobs == 1:  # one at a time: the longest chain (small, then big) first
        assert ended == ["small", "big", "heavy", "light"]
    update = _scaled_start(22.0)
    assert update({"start_rate": 0.1}, {"max_aps": 1.5}) == {"start_rate": pytest.approx(33.0), "step": 1.05}
    assert update({"start_rate": 0.1}, {"max_aps": None}) == {"start_rate": 0.1}  # nothing passed: keep the start
