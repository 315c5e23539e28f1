"""The emulated testbed end to end: the offline experiment's three modes on the real services,
and the load generator online against a real stack."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import start_stack

pytestmark = pytest.mark.slow


def _long_context_agents(path, agents: int, turns: int) -> None:
    """Agents met deep into long trajectories (24K-token contexts) with short answers: a turn
    is mostly loading its cached KV, so the run is bound by the storage NICs (the paper's
    regime) while staying short."""
    with path.open("w") as f:
        for i in range(agents):
            f.write(
                json.dumps(
                    {
                        "id": f"agent-{i}",
                        "system_tokens": 24000 + 64 * i,
                        "append_tokens": [400] * (turns + 1),
                        "gen_tokens": [8] * (turns + 1),
                    }
                )
                + "\n"
            )


def _offline(data, out) -> dict:
    """The offline experiment's three modes on ``data`` (12 agents x 3 turns), its JSON result."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dualpath.cli",
            "experiment",
            "offline",
            "--agents",
            "12",
            "--turns",
            "3",
            "--dataset",
            str(data),
            "--start-at",
            "0",
            "--modes",
            "basic,dualpath,oracle",
            "--slowdown",
            "4",
            "--out",
            str(out),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_on_a_storage_bound_run_dualpath_beats_basic_by_reading_on_the_decode_node_and_oracle_is_fastest(tmp_path):
    """The headline claim on the real services: pooling both nodes' storage NICs shortens the
    job (I/O bound here: 2x), the decode node's SNIC really reads, skipping I/O is faster still.

    The timing bounds are checked on a second run when the first misses them: one closed-loop
    run on a shared 2-core host can stall for most of a second; a real regression misses both.
    The run is in 4x slow motion so the host's CPU (the services' Python, the TCP copies of the
    decode-side path) stays a small share of the modeled time: at 2x a slow host's own cost
    inflates Oracle and erases most of DualPath's lead over Basic."""
    data = tmp_path / "agents.jsonl"
    _long_context_agents(data, agents=12, turns=3)
    for run in range(2):
        result = _offline(data, tmp_path / f"offline-{run}")
        rows = result["modes"]
        for mode, row in rows.items():
            assert row["turns_completed"] == 36 and not row["errors"], (mode, row)
            assert row["cache_hit_rate"] > 0.9  # the warm-up's KV is in storage: every timed turn is mostly hits
            host = row["decode_host_per_step"]  # the decode engine's host time per step, measured (the simulator's input)
            assert host["steps"] > 36 and host["mean_batch"] >= 1 and host["mean_s"] > 0, host
        assert rows["basic"]["snic_bytes_read"]["d0"] == 0  # basic loads through the prefill node only
        read = rows["dualpath"]["snic_bytes_read"]
        assert read["d0"] >= 0.25 * (read["d0"] + read["p0"]), read  # dualpath reads on the decode node too
        assert rows["oracle"]["snic_bytes_read"] == {"p0": 0, "d0": 0}
        basic, dualpath, oracle = (rows[m]["jct_s"] for m in ("basic", "dualpath", "oracle"))
        efficiency = result["ratios"]["efficiency"]
        print(f"run {run}: basic {basic:.2f} s, dualpath {dualpath:.2f} s, oracle {oracle:.2f} s, efficiency {efficiency:.2f}")
        # the I/O bound is 2.0x (1.7-1.9x measured); most of min((P+D)/P, basic/oracle) is captured
        if basic / dualpath >= 1.3 and oracle < dualpath and efficiency >= 0.65:
            break
    else:
        raise AssertionError(f"two runs missed the bounds; the last: basic {basic}, dualpath {dualpath}, oracle {oracle}, eff {efficiency}")


def test_loadgen_online_against_a_real_stack_reuses_kv_and_meets_a_loose_slo(tiny_model, tmp_path):
    s = start_stack(tiny_model, tmp_path / "storage", tmp_path / "run")
    try:
        out = tmp_path / "lg"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "dualpath.cli",
                "loadgen",
                "--url",
                s.url,
                "--dataset",
                "32k",
                "--scale",
                "0.01",
                "--agents",
                "20",
                "--turns",
                "3",
                "--rate",
                "2",
                "--duration",
                "4",
                "--tokenizer",
                str(tiny_model),
                "--slo-ttft",
                "10",
                "--slo-tpot",
                "5",  # loose: one host stall of a second in a 1-2 token answer must not miss it
                "--out",
                str(out),
                "--progress",
                "never",
                "--api",
                "chat",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
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
