"""The launcher's supervisor: a dead child is restarted with a doubling back-off, the others keep
running, every death and restart is an event (kept and logged); bad ``dualpath up`` input exits 2."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from dualpath.cli.launcher.supervisor import Supervisor


def _wait(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_killed_child_is_restarted_and_the_others_keep_running(tmp_path):
    sup = Supervisor(logs=tmp_path, min_backoff=0.05, poll=0.02)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    sup.add("a", sleeper, dict(os.environ))
    sup.add("b", sleeper, dict(os.environ))
    sup.watch()
    try:
        a0, b0 = sup.children["a"].proc.pid, sup.children["b"].proc.pid
        os.kill(a0, signal.SIGKILL)
        _wait(lambda: sup.children["a"].restarts == 1)
        assert sup.children["a"].proc.pid != a0 and sup.children["a"].proc.poll() is None
        assert sup.children["b"].proc.pid == b0 and sup.children["b"].proc.poll() is None  # untouched
        kinds = [(e.kind, e.name, e.code) for e in sup.events]
        assert kinds == [("exited", "a", -signal.SIGKILL), ("restarted", "a", None)]
        logged = [json.loads(line) for line in (tmp_path / "supervisor.log").read_text().splitlines()]
        assert [d["event"] for d in logged] == ["child_exited", "child_restarted"]
    finally:
        sup.unwatch()
        sup.stop(list(sup.children), 5.0)


def test_a_child_that_keeps_dying_is_restarted_with_a_doubling_back_off(tmp_path):
    sup = Supervisor(logs=tmp_path, min_backoff=0.05, max_backoff=0.4, poll=0.01)
    sup.add("crashy", [sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ))
    sup.watch()
    try:
        _wait(lambda: sup.children["crashy"].restarts >= 4, 30)
    finally:
        sup.unwatch()
        sup.stop(list(sup.children), 5.0)
    backoffs = [e.backoff_s for e in sup.events if e.kind == "exited"][:5]
    assert backoffs[:4] == [0.05, 0.1, 0.2, 0.4]
    assert all(e.code == 3 for e in sup.events if e.kind == "exited")


def test_a_held_child_stays_down_until_restarted_by_hand(tmp_path):
    """``y``, killed after ``x`` died, is restarted (same back-off): by then the supervisor has
    tended ``x`` as often since its death as a restart would have needed, so it was held."""
    sup = Supervisor(logs=tmp_path, min_backoff=0.01, poll=0.01)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    sup.add("x", sleeper, dict(os.environ))
    sup.add("y", sleeper, dict(os.environ))
    sup.watch()
    try:
        sup.hold("x")
        os.kill(sup.children["x"].proc.pid, signal.SIGKILL)
        _wait(lambda: sup.children["x"].proc.poll() is not None)
        os.kill(sup.children["y"].proc.pid, signal.SIGKILL)
        _wait(lambda: sup.children["y"].restarts >= 1)
        assert sup.children["x"].proc.poll() is not None and sup.children["x"].restarts == 0
        sup.restart_now("x")
        assert sup.children["x"].proc.poll() is None
    finally:
        sup.unwatch()
        sup.stop(list(sup.children), 5.0)


def test_dualpath_up_refuses_bad_replica_and_cluster_counts_with_exit_2(capsys):
    from dualpath.cli.launcher.up import main

    assert main(["--replicas", "0"]) == 2
    assert "--replicas" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # argparse: a usage line and the error, exit 2
        main(["--nats-cluster", "2"])
    assert exc.value.code == 2


def test_dualpath_experiment_soak_refuses_unknown_kinds_and_bad_times_with_exit_2(capsys):
    from dualpath.cli.experiment import main

    assert main(["soak", "--kinds", "engine,gpu"]) == 2
    assert "unknown kinds gpu" in capsys.readouterr().err
    assert main(["soak", "--minutes", "0"]) == 2


def test_a_nats_cluster_is_one_or_at_least_three_servers_with_jetstream_and_routes(tmp_path):
    from dualpath.ha.natscluster import nats_servers

    with pytest.raises(ValueError, match="1 or at least 3"):
        nats_servers(2, tmp_path)
    specs = nats_servers(3, tmp_path)
    assert len({s.url for s in specs}) == 3
    for s in specs:
        conf = (tmp_path / "nats" / f"{s.name}.conf").read_text()
        assert "jetstream" in conf and conf.count("nats-route://") == 2 and f"server_name: {s.name}" in conf
    single = nats_servers(1, tmp_path / "one")[0]
    assert "cluster {" not in (tmp_path / "one" / "nats" / "nats-0.conf").read_text() and single.cmd[-2] == "-c"
