"""The kernel's own single-stream TCP over loopback, with ``iperf3``: the transfer benchmark's
limit for the tcp transport.

``iperf3_gbps`` runs a one-shot server (``-s -1``) bound to 127.0.0.1 on a free port and one
client stream of ``write_bytes`` writes until ``total_bytes`` have gone; the figure is the
receiver's bytes over its seconds. ``iperf3`` caps a write at 1 MiB (``IPERF3_MAX_WRITE``);
a single stream is at the kernel's limit well before that.

The receiver's report ends when the sender's does, so on a short transfer it can count a
fraction of the bytes, or none (a 1 MiB loopback run reads 0 bytes about one time in four):
such a run is repeated four times longer until the receiver counted ``MIN_RECEIVED`` of what
was sent (``MAX_GROWTH`` times the asked length at most).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time

from dualpath.bus.embedded import free_port

__all__ = ["IPERF3_HINT", "IPERF3_MAX_WRITE", "iperf3_gbps", "iperf3_status"]

IPERF3_MAX_WRITE = 1 << 20
MIN_RECEIVED = 0.9  # of the bytes sent, for the receiver's rate to stand for the stream's
MAX_GROWTH = 256  # a truncated run is repeated up to this many times longer
IPERF3_HINT = "install it: apt-get install -y iperf3 (Debian/Ubuntu)"


def iperf3_status() -> tuple[bool, str]:
    """Whether ``iperf3`` is on PATH, and its version or how to install it."""
    if shutil.which("iperf3") is None:
        return False, f"iperf3 not found on PATH; {IPERF3_HINT}"
    out = subprocess.run(["iperf3", "--version"], capture_output=True, text=True, check=False).stdout
    return True, (out.splitlines() or ["iperf3"])[0]


def iperf3_gbps(write_bytes: int, total_bytes: int, *, timeout_s: float = 60.0) -> float:
    """GB/s of one iperf3 TCP stream over loopback with ``write_bytes`` writes (capped at
    ``IPERF3_MAX_WRITE``) moving ``total_bytes`` or, where the receiver's report was truncated,
    up to ``MAX_GROWTH`` times as many.

    Raises:
        RuntimeError: iperf3 failed (its message included), its server did not come up, or
            the receiver counted no bytes even on the longest run.
        FileNotFoundError: no iperf3 on PATH.
    """
    length = min(write_bytes, IPERF3_MAX_WRITE)
    total = max(total_bytes, length)
    while True:
        received, seconds, sent = _iperf3_run(length, total, timeout_s)
        if received >= MIN_RECEIVED * sent or total >= MAX_GROWTH * total_bytes:
            break
        total *= 4
    if received <= 0 or seconds <= 0:
        raise RuntimeError(f"iperf3's receiver counted no bytes of {sent} sent in writes of {length} bytes")
    return received / seconds / 1e9


def _iperf3_run(length: int, total: int, timeout_s: float) -> tuple[float, float, float]:
    """One server and one client run: the receiver's bytes and seconds, and the bytes sent."""
    port = str(free_port())
    server = subprocess.Popen(
        ["iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", port], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        client = ["iperf3", "-c", "127.0.0.1", "-p", port, "-l", str(length), "-n", str(total), "-J"]
        deadline = time.monotonic() + 5.0
        while True:  # the server binds within milliseconds; retry the client until it has
            out = subprocess.run(client, capture_output=True, text=True, timeout=timeout_s, check=False)
            report = json.loads(out.stdout or "{}")
            refused = "unable to connect" in str(report.get("error", ""))
            if not refused or time.monotonic() > deadline or server.poll() is not None:
                break
            time.sleep(0.02)
        if out.returncode != 0 or "error" in report:
            raise RuntimeError(f"iperf3 failed: {report.get('error') or out.stderr.strip() or out.returncode}")
        got, sent = report["end"]["sum_received"], report["end"]["sum_sent"]
        return float(got["bytes"]), float(got["seconds"]), float(sent["bytes"])
    finally:
        server.kill()
        server.wait()
        if server.stdout is not None:
            server.stdout.close()
