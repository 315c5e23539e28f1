"""The emulated testbed end to end: the offline experiment's three modes on the real services,
and the load generator online against a real stack."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import start_stack

pytestmark = pytest.mark.slow


def test_a_small_offline_experiment_runs_the_ablation_and_oracle_and_reports_every_figure(tmp_path):
    out = tmp_path / "offline"
    proc = subprocess.run([sys.executable, "-m", "dualpath.cli", "experiment", "offline", "--agents", "3", "--turns", "2",
                           "--dataset", "32k", "--engines-per-node", "1", "--ablation", "--modes", "basic,dualpath,oracle",
                           "--slowdown", "1.5", "--out", str(out), "--json"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result == json.loads((out / "result.json").read_text())
    assert list(result["modes"]) == ["basic-nolw", "basic", "dualpath-rr", "dualpath", "oracle"]  # ablation order, then the rest
    for mode, row in result["modes"].items():
        assert row["jct_s"] > 0 and row["turns_completed"] == 6 and not row["errors"], (mode, row)
        assert row["host_s"] == pytest.approx(1.5 * row["jct_s"])  # slow motion: modeled seconds reported
        assert row["overhead_share"]["mean"] is not None
        assert set(row["snic_read_utilisation"]) == {"p0", "d0"}
    for mode in ("basic-nolw", "basic"):
        assert result["modes"][mode]["snic_bytes_read"]["d0"] == 0  # basic reads on the PE side only
        assert result["modes"][mode]["cache_hit_rate"] > 0.5  # warmed-up agents hit their earlier turns' KV
    assert result["modes"]["oracle"]["snic_bytes_read"] == {"p0": 0, "d0": 0}  # oracle reads nothing
    steps = result["ablation"]
    assert [s["mode"] for s in steps] == ["basic-nolw", "basic", "dualpath-rr", "dualpath"] and steps[0]["reduction"] == 0
    for s in steps:
        assert s["reduction"] == pytest.approx(1 - s["jct_s"] / steps[0]["jct_s"])
    assert result["ratios"]["basic/dualpath"] > 0 and result["io_bound"] == 2.0 and result["start_at"] == 0.5
    assert (out / "jct.png").stat().st_size > 0 and (out / "snic_utilisation.png").stat().st_size > 0


def test_loadgen_online_against_a_real_stack_reuses_kv_and_meets_a_loose_slo(tiny_model, tmp_path):
    s = start_stack(tiny_model, tmp_path / "storage", tmp_path / "run")
    try:
        out = tmp_path / "lg"
        proc = subprocess.run([sys.executable, "-m", "dualpath.cli", "loadgen", "--url", s.url, "--dataset", "32k", "--scale", "0.01",
                               "--agents", "20", "--turns", "3", "--rate", "2", "--duration", "4", "--tokenizer", str(tiny_model),
                               "--slo-ttft", "10", "--slo-tpot", "1", "--out", str(out), "--progress", "never", "--api", "chat"],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        report = json.loads((out / "report.json").read_text())
        run = report["run"]
        assert run["turns"]["completed"] >= 6 and not run["turns"]["errors"]
        assert run["turns"]["gen_length_mismatches"] == 0  # replay generates exactly the recorded lengths
        assert run["cache"]["cached_tokens"] > 0
        assert run["slo"]["attainment"] == 1.0
        lat = run["latency_s"]  # the server's TTFT split reaches the report
        assert lat["ttft_queue"]["n"] == lat["ttft"]["n"] and lat["ttft_exec"]["n"] == lat["ttft"]["n"]
        assert lat["ttft_queue"]["p50"] + lat["ttft_exec"]["p50"] <= lat["ttft"]["p99"] + 0.05
    finally:
        s.stop()
