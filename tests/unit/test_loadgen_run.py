"""End-to-end runs of the load generator against the instant server (real processes, real HTTP)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from dualpath.bench.loadgen import run_overhead_bench
from loadgen.cli import main
from loadgen.instant_server import start_instant_server


@pytest.fixture(scope="module")
def instant():
    with start_instant_server() as server:
        yield server.url


@pytest.fixture()
def two_turn_file(tmp_path: Path) -> Path:
    path = tmp_path / "agents.jsonl"
    path.write_text(json.dumps({"id": "a", "system_tokens": 16, "append_tokens": [8, 8], "gen_tokens": [8, 8]}) + "\n")
    return path


def _run(argv: list[str], out: Path, capsys) -> tuple[int, dict, str]:
    code = main([*argv, "--out", str(out), "--progress", "never", "--no-plots"])
    err = capsys.readouterr().err
    return code, json.loads((out / "report.json").read_text()), err


def _turns(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "turns.jsonl").read_text().splitlines()]


def _receive_leg_ms(turn: dict, t0: float) -> float:
    """From the server handing the first token to the kernel until the client stamped it.

    Both stamps are CLOCK_MONOTONIC on this host; this leg holds the client's own delays
    (in a burst of 1000 agents the send leg also holds the server's queue).
    """
    sent_ns = int(turn["server_timing"].split('sent;desc="')[1].split('"')[0])
    return (t0 + turn["t_start"] + turn["ttft"]) * 1000 - sent_ns / 1e6


@pytest.mark.slow  # 1,000 agents against a server that holds each first token 1 s: a benchmark-sized run (5-13 s)
def test_a_thousand_agents_run_offline_without_errors_and_the_client_adds_little_ttft(two_turn_file: Path, tmp_path: Path, capsys) -> None:
    # The server holds each first token for 1 s (a prefill), so all 1000 sessions are
    # active at once, as against a real server, instead of finishing while others start.
    with start_instant_server(ttft_s=1.0) as server:
        code, report, _ = _run(["--url", server.url, "--dataset", str(two_turn_file), "--agents", "1000"], tmp_path, capsys)
    run = report["run"]
    assert code == 0 and report["status"] == "ok"
    assert run["agents"] == {"launched": 1000, "done": 1000, "failed": 0, "cancelled": 0}
    assert run["turns"]["completed"] == 2000 and run["turns"]["errors"] == {}
    assert run["turns"]["gen_length_mismatches"] == 0 and run["loadgen"]["max_active_agents"] == 1000
    assert run["cache"]["cached_tokens"] > 0  # the second turn extends the first turn's prompt
    t0 = run["t0_monotonic"]
    receive = [_receive_leg_ms(t, t0) for t in _turns(tmp_path)]
    # A generous bound: the 1000 first answers come back as a wave (the server answers each
    # exactly 1 s after it arrived), the client works through it on a shared 2-core VM, and
    # later answers wait. dualpath.bench.loadgen measures the steady-state figure.
    assert np.median(receive) < 100


def test_an_unreachable_server_exits_3_quickly_with_a_message_and_a_saved_report(tmp_path: Path, capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        start = time.monotonic()
        code, report, err = _run(["--url", f"http://127.0.0.1:{port}", "--agents", "3", "--turns", "1"], tmp_path, capsys)
    assert code == 3 and time.monotonic() - start < 10
    assert report["status"] == "unreachable" and "unreachable" in err and "Traceback" not in err


def test_a_server_answering_500_gives_exit_3_and_records_the_failed_turns(tmp_path: Path, capsys) -> None:
    with start_instant_server(fail_status=500) as server:
        code, report, err = _run(
            ["--url", server.url, "--agents", "30", "--turns", "2", "--scale", "0.001", "--max-errors", "10"], tmp_path, capsys
        )
    assert code == 3 and report["status"] == "server_errors"
    assert "HTTP 500" in err and "Traceback" not in err
    assert report["run"]["turns"]["errors"].get("http", 0) >= 10


def test_a_malformed_trajectory_file_exits_2_naming_the_line(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"append_tokens": [1], "gen_tokens": [1]}\n{"append_tokens": [1], "gen_tokens": [0]}\n')
    code = main(["--url", "http://127.0.0.1:9", "--dataset", str(bad), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "line 2" in err and "gen_tokens[0]" in err and "Traceback" not in err


def test_bad_options_exit_2(tmp_path: Path, capsys) -> None:
    assert main(["--url", "http://x", "--offline", "--sweep"]) == 2
    assert main(["--url", "http://x", "--rate", "1", "--offline"]) == 2  # argparse: mutually exclusive
    assert main(["--url", "localhost:8000", "--agents", "1", "--out", str(tmp_path)]) == 2  # no scheme
    err = capsys.readouterr().err
    assert "loadgen: error" in err and "http://host:port" in err and "Traceback" not in err


def test_a_request_timeout_fails_the_turn_instead_of_hanging(tmp_path: Path, capsys) -> None:
    with start_instant_server(ttft_s=30.0) as server:
        start = time.monotonic()
        code, report, err = _run(
            ["--url", server.url, "--agents", "2", "--turns", "1", "--scale", "0.001", "--request-timeout", "0.5"], tmp_path, capsys
        )
    assert code == 3 and time.monotonic() - start < 10
    assert report["run"]["turns"]["errors"] == {"timeout": 2} and "no complete response" in err


def test_an_online_run_stops_at_its_duration_and_records_the_cut_off_turns(tmp_path: Path, capsys) -> None:
    with start_instant_server(ttft_s=0.05, tpot_s=0.05) as server:
        code, report, _ = _run(
            ["--url", server.url, "--agents", "200", "--turns", "50", "--scale", "0.002", "--rate", "40", "--duration", "1.0"],
            tmp_path,
            capsys,
        )
    run = report["run"]
    assert code == 0 and 0.9 < run["wall_s"] < 5  # without the cut-off, 50 turns take far longer
    agents = run["agents"]
    assert 20 <= agents["launched"] <= 60 and agents["cancelled"] >= 10
    assert agents["cancelled"] + agents["done"] == agents["launched"]
    assert run["turns"]["errors"] == {"cancelled": agents["cancelled"]}
    assert run["aps"]["achieved"] == pytest.approx(40, rel=0.5)


def test_untimed_lead_in_turns_run_but_are_not_counted(instant: str, tmp_path: Path, capsys) -> None:
    argv = ["--url", instant, "--agents", "4", "--turns", "3", "--scale", "0.002", "--untimed-turns", "1"]
    code, report, _ = _run(argv, tmp_path, capsys)
    turns = report["run"]["turns"]
    assert code == 0 and turns["completed"] == 8 and turns["untimed"] == 4 and report["run"]["slo"]["turns_counted"] == 8
    assert len(_turns(tmp_path)) == 12  # turns.jsonl keeps every turn, lead-in included
    assert main(["--url", instant, "--agents", "1", "--turns", "2", "--untimed-turns", "2", "--out", str(tmp_path / "bad")]) == 2
    assert "leaves no timed turn" in capsys.readouterr().err


def test_a_staggered_offline_run_starts_the_agents_in_order_that_far_apart(instant: str, tmp_path: Path, capsys) -> None:
    argv = ["--url", instant, "--agents", "6", "--turns", "1", "--scale", "0.002", "--stagger", "0.05"]
    code, _, _ = _run(argv, tmp_path, capsys)
    assert code == 0
    starts = sorted((t["t_start"], t["agent"]) for t in _turns(tmp_path))
    assert [a for _, a in starts] == list(range(6))
    assert all(t >= 0.05 * i - 0.005 for i, (t, _) in enumerate(starts)), starts  # never before its time
    assert starts[-1][0] < 2.0, starts  # and not much after it (a loaded host wakes late)
    for bad in (["--stagger", "-1"], ["--stagger", "0.1", "--rate", "2"]):
        assert main(["--url", instant, "--agents", "1", *bad, "--out", str(tmp_path / "bad")]) == 2
    assert "--stagger" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--api", "chat"], ["--transport", "httpx"]])
def test_chat_api_and_httpx_transport_complete_a_small_run(instant: str, tmp_path: Path, capsys, argv) -> None:
    code, report, _ = _run(["--url", instant, "--agents", "5", "--turns", "3", "--scale", "0.002", *argv], tmp_path, capsys)
    assert code == 0 and report["run"]["turns"]["completed"] == 15
    assert report["run"]["turns"]["gen_length_mismatches"] == 0


def test_a_sweep_reports_every_probe_and_the_highest_passing_rate(instant: str, tmp_path: Path, capsys) -> None:
    code = main(
        [
            "--url",
            instant,
            "--agents",
            "50",
            "--turns",
            "2",
            "--scale",
            "0.001",
            "--sweep",
            "--rate",
            "20",
            "--duration",
            "0.5",
            "--sweep-probes",
            "3",
            "--out",
            str(tmp_path),
            "--progress",
            "never",
        ]
    )
    out = capsys.readouterr().out
    sweep = json.loads((tmp_path / "report.json").read_text())["sweep"]
    assert code == 0 and [p["rate"] for p in sweep["points"]] == [20.0, 40.0, 80.0] and sweep["max_aps"] == 80.0
    assert all(p["passed"] for p in sweep["points"]) and "highest APS meeting the SLO: 80" in out
    assert (tmp_path / "sweep_latency.png").stat().st_size > 0 and (tmp_path / "sweep_attainment.png").exists()
    assert (tmp_path / "probe-2" / "turns.jsonl").exists()


@pytest.mark.slow  # runs the overhead benchmark (server, probe process and load)
def test_the_overhead_benchmark_reports_both_legs_for_loadgen_and_probe() -> None:
    r = run_overhead_bench(60, turns=5, gen_tokens=4, ttft_s=0.05, tpot_s=0.01, idle_turns=50)
    assert r["load"]["errors"] == 0 and r["load"]["active_sessions"]["max"] == 60
    for phase in (r["idle"]["fast"], r["idle"]["httpx"], r["load"]["legs"]):
        for leg in ("added", "send", "receive"):
            assert phase[leg]["loadgen_ms"]["n"] > 0
    assert r["load"]["legs"]["added"]["probe_ms"]["n"] > 0  # the probe ran beside the load
    assert r["load"]["legs"]["added"]["loadgen_ms"]["p50"] > 0 and isinstance(r["meets_target"], bool)
    assert r["meets_aim"] == (
        r["added_p50_ms"] < 1.0 and r["added_p99_ms"] < 5.0 and r["agents_per_core"] >= 5000 and r["load"]["errors"] == 0
    )


def test_agents_spread_over_processes_are_merged_into_one_report_with_every_turn() -> None:
    r = run_overhead_bench(90, turns=3, gen_tokens=4, ttft_s=0.05, tpot_s=0.01, idle_turns=20, compare_httpx=False, processes=3)
    load = r["load"]
    assert (r["agents"], r["processes"]) == (90, 3)
    assert load["errors"] == 0 and load["turns"] == 90 * 3  # every worker's turns are in the merged run
    assert load["active_sessions"]["max"] == 90  # the workers' agents overlap in time
    assert load["legs"]["added"]["loadgen_ms"]["n"] > 0 and r["added_p50_ms"] == load["legs"]["added"]["loadgen_ms"]["p50"]
    assert r["added_p99_ms"] >= r["added_p50_ms"] > 0
    assert r["client_cores"] > 0 and r["agents_per_core"] == pytest.approx(90 / r["client_cores"])
    with pytest.raises(ValueError, match="processes"):
        run_overhead_bench(2, processes=3)
