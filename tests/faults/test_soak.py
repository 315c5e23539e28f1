"""``dualpath experiment soak`` end to end, shortened: the testbed's redundant stack (modeled
compute) serves online agents while processes are killed; nothing may be lost."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.faults]


def test_a_short_modeled_soak_kills_processes_that_the_supervisor_restarts_and_loses_no_request(tmp_path) -> None:
    # 7 s of agents, a kill every 3 s (two kills); short trajectories and no warm-up keep the
    # test near 30-45 s; the replay runs on the soak's own stack once the kills are over.
    cmd = [sys.executable, "-m", "dualpath.cli", "experiment", "soak", "--minutes", "0.12", "--kill-every", "3", "--rate", "2"]
    cmd += ["--lengths", "0.02", "--no-warmup", "--replay-on", "same", "--out", str(tmp_path), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, check=False)
    assert proc.stdout, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    for key in ("kills", "started", "completed", "failed", "lost", "mismatched", "slo"):
        assert key in report
    assert report["compute"] == "modeled" and report["replicas"] == 2
    assert len(report["kills"]) >= 1
    assert all(kill["restarted_after_s"] is not None for kill in report["kills"]), report["kills"]
    assert report["started"] > 0 and report["started"] == report["completed"] + report["failed"] + report["lost"]
    assert report["lost"] == 0, report["lost_examples"]
    assert report["mismatched"] == 0 and report["recheck_unanswered"] == 0, report["mismatch_examples"]
    assert proc.returncode == 0, proc.stderr[-2000:]
