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


def test_the_reduced_paper_table_has_one_row_per_figure(capsys):
    code, out, _ = run(capsys, "paper", "--quick", "--offline-only", "--json")
    assert code == 0
    rows = json.loads(out)["rows"]
    names = [r["name"] for r in rows]
    assert len(names) == len(set(names)) >= 18
    assert {
        "ds660b_2p4d_dualpath_over_basic",
        "ds27b_1p1d_dualpath_over_basic",
        "snic_max_over_avg_round_robin",
        "ablation_scheduler_jct_reduction_pct",
        "scale_offline_jct_ratio",
        "pd_speedup_max",
    } <= set(names)
    for r in rows:
        assert set(r) >= {"name", "paper", "sim", "ratio"}
        assert r["sim"] is not None and r["ratio"] == pytest.approx(r["sim"] / r["paper"])


def test_validate_against_recorded_testbed_runs_gives_both_jcts_within_10pct(capsys):
    """The CI form of validate: the simulator against the testbed JCTs last recorded."""
    code, out, _ = run(capsys, "validate", "--recorded", "--json")
    assert code == 0
    rows = json.loads(out)["rows"]
    assert [(r["topology"], r["mode"]) for r in rows] == [(t, m) for t in ("1P1D", "2P1D", "1P2D") for m in ("basic", "dualpath")]
    for r in rows:
        assert r["testbed_jct"] > 0 and r["sim_jct"] > 0 and r["ratio"] == pytest.approx(r["sim_jct"] / r["testbed_jct"])
        assert r["within_10pct"], r
        # the testbed's measured decode host time per step is the simulator's input: it only adds time
        assert r["decode_host_per_step"]["fixed_s"] + r["decode_host_per_step"]["per_request_s"] > 0
        assert r["sim_jct"] > r["sim_jct_gpu_only"] and r["ratio_gpu_only"] == pytest.approx(r["sim_jct_gpu_only"] / r["testbed_jct"])


def test_plan_ranks_the_splits_of_a_budget_and_checks_the_paper_range(capsys):
    code, out, _ = run(capsys, "plan", "--target", "ds27b", "--gpus", "24", "--agents", "16", "--turns", "2", "--json")
    assert code == 0
    result = json.loads(out)
    assert {(r["prefill_nodes"], r["decode_nodes"]) for r in result["frontier"]} == {(1, 2), (2, 1)}
    assert result["best"]["jct_s"] == min(r["jct_s"] for r in result["frontier"])
    assert result["no_bottleneck_range"] == pytest.approx([1 / 7, 3.5])
