"""``dualpath experiment soak`` end to end, shortened: the testbed's redundant stack (modeled
compute) serves online agents while processes are killed; nothing may be lost."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.faults]

RESTART_BOUND_S = 5.0  # the supervisor's first back-off is 0.5 s; a restart takes about as long again


def test_a_short_modeled_soak_kills_processes_that_the_supervisor_restarts_and_loses_no_request(tmp_path) -> None:
    # 7 s of agents, a kill every 3 s (two kills); short trajectories and no warm-up keep the
    # test near 30-45 s; the replay runs on the soak's own stack once the kills are over.
    cmd = [sys.executable, "-m", "dualpath.cli", "experiment", "soak", "--minutes", "0.12", "--kill-every", "3", "--rate", "2"]
    cmd += ["--lengths", "0.02", "--no-warmup", "--replay-on", "same", "--out", str(tmp_path), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, check=False)
    assert proc.stdout, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert report["compute"] == "modeled" and report["replicas"] == 2

    # Every kill hit a real process, which the supervisor brought back within the bound.
    assert len(report["kills"]) >= 1
    for kill in report["kills"]:
        assert kill["restarted_after_s"] is not None and kill["restarted_after_s"] < RESTART_BOUND_S, report["kills"]
    assert report["restarts"] >= len(report["kills"]) and report["kills_not_restarted"] == 0

    # The report's counts are those of the requests it saved, and every request was answered.
    rows = [json.loads(line) for line in Path(report["requests_file"]).read_text().splitlines()]
    statuses = Counter(r["status"] for r in rows)
    assert (report["started"], report["completed"], report["failed"], report["lost"]) == (
        len(rows),
        statuses["completed"],
        statuses["failed"],
        statuses["lost"],
    )
    assert report["agents_arrived"] == len({r["agent"] for r in rows}) >= 2
    assert report["lost"] == 0, report["lost_examples"]
    assert report["failed"] == 0, report["errors"]
    assert all(r["text"] > 0 for r in rows), "a completed request came back without an answer"

    # Each agent's turns ran in order, one after the other, and kept reading their history's KV
    # from storage across the kills (a lost index or storage would make later turns misses).
    later = []
    for agent in {r["agent"] for r in rows}:
        turns = sorted((r for r in rows if r["agent"] == agent), key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == list(range(len(turns)))
        assert all(b["started"] >= a["ended"] for a, b in zip(turns, turns[1:]))
        later += turns[1:]
    assert later, "no agent got past its first turn"
    assert sum(r["cached_tokens"] for r in later) >= 0.5 * sum(r["prompt_tokens"] for r in later), later

    # The replay asked every completed turn again and got the same tokens.
    assert report["mismatched"] == 0 and report["recheck_unanswered"] == 0, report["mismatch_examples"]
