"""A service started by the supervisor stops by itself when the supervising process dies: a
``dualpath up`` or a test run killed with SIGKILL (no clean-up ran) leaves no stack behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PARENT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from dualpath.cli.launcher.supervisor import Supervisor

    sup = Supervisor(logs=Path(sys.argv[1]))
    cmd = [sys.executable, "-m", "services.kv_persistence", "--nats-url", sys.argv[2], "--namespace", "orphans"]
    sup.add("kv-persistence", cmd, dict(os.environ))
    print(sup.children["kv-persistence"].proc.pid, flush=True)
    time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _wait(pred, timeout: float) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.05)
    return time.monotonic() - t0


@contextlib.contextmanager
def _parent(script: str, *args: str) -> Iterator[tuple[subprocess.Popen, int]]:
    """Run ``script`` (which prints the pid of the child it starts) and yield ``(parent, child
    pid)``; whatever is still running afterwards is killed."""
    parent = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        yield parent, child
    finally:
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()


def test_a_supervised_service_stops_when_its_supervisor_is_killed(tmp_path, nats_server):
    with _parent(PARENT, str(tmp_path), nats_server.url) as (parent, child):
        log = tmp_path / "kv-persistence.log"
        _wait(lambda: log.exists() and "service_started" in log.read_text(), 30)
        parent.kill()  # SIGKILL: the supervisor's clean-up never runs
        parent.wait()
        took = _wait(lambda: not _alive(child), 10)
        assert "parent_gone" in log.read_text()
        print(f"orphaned service stopped {took:.2f}s after its supervisor was killed")


NATS_PARENT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from dualpath.bus.embedded import EmbeddedNats, nats_server_binary
    from dualpath.cli.launcher.supervisor import Supervisor

    if sys.argv[1] == "embedded":
        server = EmbeddedNats().start()
        print(server._proc.pid, flush=True)
    else:  # the stack's way: a supervised child that cannot read PARENT_ENV
        sup = Supervisor(logs=Path(sys.argv[2]))
        sup.add("nats-0", [nats_server_binary(), "-a", "127.0.0.1", "-p", "0"], dict(os.environ), watches_parent=False)
        print(sup.children["nats-0"].proc.pid, flush=True)
    time.sleep(120)
    """
)


@pytest.mark.parametrize("how", ["embedded", "supervised"])
def test_a_nats_server_stops_when_the_process_that_started_it_is_killed(tmp_path, how):
    with _parent(NATS_PARENT, how, str(tmp_path)) as (parent, server):
        assert _alive(server)
        parent.kill()  # SIGKILL: no clean-up runs (EmbeddedNats.__del__, Supervisor.stop)
        parent.wait()
        took = _wait(lambda: not _alive(server), 10)
        print(f"{how} nats-server stopped {took:.2f}s after its parent was killed")
