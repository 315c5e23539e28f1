"""The kernel's own single-stream TCP over loopback, with ``iperf3``: the transfer benchmark's
limit for the tcp transport.

``iperf3_gbps`` runs a one-shot server (``-s -1``) bound to 127.0.0.1 on a free port and one
client stream of ``write_bytes`` writes until ``total_bytes`` have gone; the figure is the
receiver's bytes over its seconds. ``iperf3`` caps a write at 1 MiB (``IPERF3_MAX_WRITE``);
a single stream is at the kernel's limit well before that.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time

__all__ = ["IPERF3_HINT", "IPERF3_MAX_WRITE", "iperf3_gbps", "iperf3_status"]

IPERF3_MAX_WRITE = 1 << 20
IPERF3_HINT = "install it: apt-get install -y iperf3 (Debian/Ubuntu)"


def iperf3_status() -> tuple[bool, str]:
    """Whether ``iperf3`` is on PATH, and its version or how to install it."""
    if shutil.which("iperf3") is None:
        return False, f"iperf3 not found on PATH; {IPERF3_HINT}"
    out = subprocess.run(["iperf3", "--version"], capture_output=True, text=True, check=False).stdout
    return True, (out.splitlines() or ["iperf3"])[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def iperf3_gbps(write_bytes: int, total_bytes: int, *, timeout_s: float = 60.0) -> float:
    """GB/s of one iperf3 TCP stream over loopback with ``write_bytes`` writes (capped at
    ``IPERF3_MAX_WRITE``) moving ``total_bytes``.

    Raises:
        RuntimeError: iperf3 failed (its message included) or its server did not come up.
        FileNotFoundError: no iperf3 on PATH.
    """
    port = str(_free_port())
    server = subprocess.Popen(
        ["iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", port], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        length = str(min(write_bytes, IPERF3_MAX_WRITE))
        client = ["iperf3", "-c", "127.0.0.1", "-p", port, "-l", length, "-n", str(total_bytes), "-J"]
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
        got = report["end"]["sum_received"]
        return float(got["bytes"]) / float(got["seconds"]) / 1e9
    finally:
        server.kill()
        server.wait()
        if server.stdout is not None:
            server.stdout.close()
