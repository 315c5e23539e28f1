"""Faults on the plain form (one nats-server, 1P1D): NATS restarted, storage full, storage read-only.

The storage root is a 4 MiB tmpfs (root only: skipped elsewhere), so "full" is a real ENOSPC
and "read-only" a real EROFS from the kernel, not a simulation.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import start_stack
from faultkit import chat_cached, complete, record, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.faults]

PROMPT = "the agent reads the test report and the log of the failing job " * 6


def _mount_tmpfs(path: Path, size: str = "4m") -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    return subprocess.run(cmd, capture_output=True, check=False).returncode == 0


def _fill(path: Path) -> Path:
    """Fill the file system of ``path`` to the last byte; returns the filler file."""
    filler = path / "filler.bin"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    chunk = b"\0" * 65536
    try:
        while True:
            try:
                os.write(fd, chunk)
            except OSError:
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)
    return filler


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    storage = root / "storage"
    if not _mount_tmpfs(storage):
        pytest.skip("needs root to mount a tmpfs of a few MiB as storage")
    s = None
    try:
        # the index log lives off the block storage (as with a shared block store), so only block files see the faults
        s = start_stack(
            tiny_model,
            storage,
            root / "run",
            extra_env={"DUALPATH_REQUEST_TIMEOUT": "45", "DUALPATH_INDEX_PATH": str(root / "index" / "index.log")},
        )
        yield s
    finally:
        if s is not None:
            s.stop()
        subprocess.run(["umount", "-l", str(storage)], capture_output=True, check=False)


@pytest.fixture(scope="module")
def reference(stack):
    return complete(stack, PROMPT, max_tokens=32)


def test_the_single_nats_server_restarted_services_reconnect(stack, reference):
    """Bound: after kill -9 of the only nats-server (restarted by the supervisor on the same
    port), a request is answered again within 15 s."""
    t0 = time.monotonic()
    os.kill(stack.pid("nats-0"), signal.SIGKILL)
    took = wait_until(lambda: complete(stack, PROMPT, max_tokens=32, timeout=10).text == reference.text, 40, step=0.2)
    record("single NATS server killed and restarted (requests served)", took, 15.0)
    assert any(e.name == "nats-0" and e.kind == "restarted" for e in stack.events)
    assert time.monotonic() - t0 < 60


def test_storage_full_skips_persistence_and_serving_continues(stack, reference):
    """ENOSPC on the storage root: every request is still answered exactly; once space is back
    the next turns persist again (their blocks become hits) within 10 s."""
    storage = Path(stack.cfg.storage)
    filler = _fill(storage)
    try:
        messages = [{"role": "user", "content": "disk full: " + "the job wrote a very long log file " * 10}]
        for _ in range(3):
            a = complete(stack, PROMPT + " again", max_tokens=32)
            assert a.error is None and a.tokens == 32, a
            assert chat_cached(stack, messages) == 0  # nothing could be persisted
    finally:
        filler.unlink()
    t0 = time.monotonic()
    took = wait_until(lambda: chat_cached(stack, messages) > 0, 20, step=0.3)  # persisted again, then a hit
    record("storage full (persistence back after space freed)", time.monotonic() - t0, 10.0)
    assert took < 20
    assert complete(stack, PROMPT, max_tokens=32).text == reference.text


def test_storage_read_only_is_served_from_recompute(stack, reference):
    """EROFS: requests are answered exactly (reads of existing blocks still work, writes are skipped);
    after a remount read-write the stack persists again within 10 s."""
    storage = Path(stack.cfg.storage)
    subprocess.run(["mount", "-o", "remount,ro", str(storage)], check=True)
    try:
        for i in range(3):
            a = complete(stack, f"read-only {i}: " + PROMPT, max_tokens=32)
            assert a.error is None and a.tokens == 32, a
        assert complete(stack, PROMPT, max_tokens=32).text == reference.text
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(storage)], check=True)
    messages = [{"role": "user", "content": "writable again: " + "the job wrote a very long log file " * 10}]
    t0 = time.monotonic()
    wait_until(lambda: chat_cached(stack, messages) > 0, 20, step=0.3)
    record("storage read-only (persistence back after remount)", time.monotonic() - t0, 10.0)


def test_prefill_nodes_traffic_manager_killed_during_a_kv_load_the_request_is_answered_once_it_is_back(stack, reference):
    """Bound: kill -9 of the PE node's traffic manager while it holds a request's KV load (it is
    SIGSTOPped first, so the load is surely in flight there): the load fails within seconds, the
    node leaves scheduling until the supervisor has restarted its traffic manager, and the request
    is answered exactly within 20 s (not after the 120 s load timeout, and without a retry that
    uses up every attempt on the restarting node)."""
    assert complete(stack, PROMPT, max_tokens=32, read_path="pe").text == reference.text  # PROMPT's blocks are hits
    pid = stack.pid("traffic-manager-p0")
    os.kill(pid, signal.SIGSTOP)
    with cf.ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        pending = pool.submit(complete, stack, PROMPT, max_tokens=32, read_path="pe", timeout=60)
        time.sleep(1.5)  # placed, dispatched, its load sent to the stopped traffic manager (node timeout: 3 s)
        os.kill(pid, signal.SIGKILL)
        answer = pending.result(timeout=70)
    took = time.monotonic() - t0
    print("answer with the PE node's traffic manager killed:", answer.error or "ok", f"in {took:.1f}s")
    assert answer.text == reference.text, answer.error
    assert any(e.name == "traffic-manager-p0" and e.kind == "restarted" for e in stack.events)
    record("PE node's traffic manager killed during a KV load (request answered)", took, 20.0)
