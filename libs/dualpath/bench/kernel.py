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

iperf3's receiver reads every write into one buffer that stays in cache; a transfer must land
each byte at its own place in a region. ``region_stream_gbps`` is the same single loopback
stream with the receiver's blocking ``recv_into`` walking a region of the transfer's size
instead (no event loop, no protocol): the kernel's limit for the bytes a transfer moves.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

from dualpath.bus.embedded import free_port

__all__ = ["IPERF3_HINT", "IPERF3_MAX_WRITE", "iperf3_gbps", "iperf3_status", "pull_gbps", "region_stream_gbps"]

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


def iperf3_gbps(write_bytes: int, total_bytes: int, *, timeout_s: float = 60.0, congestion: str = "") -> float:
    """GB/s of one iperf3 TCP stream over loopback with ``write_bytes`` writes (capped at
    ``IPERF3_MAX_WRITE``) moving ``total_bytes`` or, where the receiver's report was truncated,
    up to ``MAX_GROWTH`` times as many; ``congestion`` names the TCP congestion control
    (iperf3's ``-C``; "" the host's default).

    Raises:
        RuntimeError: iperf3 failed (its message included), its server did not come up, or
            the receiver counted no bytes even on the longest run.
        FileNotFoundError: no iperf3 on PATH.
    """
    length = min(write_bytes, IPERF3_MAX_WRITE)
    total = max(total_bytes, length)
    while True:
        received, seconds, sent = _iperf3_run(length, total, timeout_s, congestion)
        if received >= MIN_RECEIVED * sent or total >= MAX_GROWTH * total_bytes:
            break
        total *= 4
    if received <= 0 or seconds <= 0:
        raise RuntimeError(f"iperf3's receiver counted no bytes of {sent} sent in writes of {length} bytes")
    return received / seconds / 1e9


def _iperf3_run(length: int, total: int, timeout_s: float, congestion: str = "") -> tuple[float, float, float]:
    """One server and one client run: the receiver's bytes and seconds, and the bytes sent."""
    port = str(free_port())
    server = subprocess.Popen(
        ["iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", port], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        client = ["iperf3", "-c", "127.0.0.1", "-p", port, "-l", str(length), "-n", str(total), "-J"]
        if congestion:
            client += ["-C", congestion]
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


_STREAM_SENDER = r"""
import socket, sys
port, length, total = (int(a) for a in sys.argv[1:4])
data = memoryview(bytearray(b"\x5a" * length))
with socket.socket() as s:
    if sys.argv[4]:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, sys.argv[4].encode())
    s.connect(("127.0.0.1", port))
    left = total
    while left > 0:
        n = s.send(data[: min(length, left)])
        left -= n
"""

# Answers each 8-byte request (a batch's length) with that many bytes from consecutive places
# in its own region, in sends of at most ``io`` bytes, until the client closes.
_PULL_SERVER = r"""
import mmap, socket, sys
port, io, size, buffers = (int(a) for a in sys.argv[1:5])
congestion = sys.argv[5]
region = mmap.mmap(-1, size)
src = memoryview(region)
src[:] = b"\x5a" * size
s = socket.socket()
for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF) if buffers else ():
    s.setsockopt(socket.SOL_SOCKET, opt, buffers)
if congestion:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
s.connect(("127.0.0.1", port))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
ask, at = bytearray(8), 0
while s.recv_into(ask, 8) == 8:
    n = int.from_bytes(ask, "little")
    if at + n > size:
        at = 0
    for lo in range(at, at + n, io):
        s.sendall(src[lo : min(lo + io, at + n)])
    at += n
"""


@contextlib.contextmanager
def _faulted_region(region_bytes: int) -> Iterator[memoryview]:
    """An anonymous region with every page faulted in, so the timed reads take no faults."""
    region = mmap.mmap(-1, region_bytes)
    view = memoryview(region)
    try:
        view[:] = b"\x01" * region_bytes
        yield view
    finally:
        view.release()
        region.close()


@contextlib.contextmanager
def _peer(script: str, args: list[str], timeout_s: float, buffer_bytes: int | None = None, congestion: str = "") -> Iterator[socket.socket]:
    """Run ``script`` in another Python process that connects back to a listener here (its
    port its first argument, ``congestion`` its last); yield the connection, with congestion
    control ``congestion`` ("" the host's). On the way out the connection is closed and the
    peer must exit cleanly within ``timeout_s``.

    Raises:
        RuntimeError: the peer did not connect in time, or failed (its stderr's tail).
    """
    with socket.socket() as listener:
        if buffer_bytes:  # accepted sockets inherit the listener's buffer sizes
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                listener.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
        if congestion:  # accepted sockets inherit it too
            listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(timeout_s)
        cmd = [sys.executable, "-c", script, str(listener.getsockname()[1]), *args, congestion]
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
        try:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                raise RuntimeError(f"the kernel reference's peer did not connect within {timeout_s:.0f} s") from None
            with conn:
                conn.settimeout(timeout_s)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                yield conn
            _, err = proc.communicate(timeout=timeout_s)
            if proc.returncode != 0:
                why = err.decode(errors="replace").strip()[-500:] if err else ""
                raise RuntimeError(f"the kernel reference's peer failed (exit status {proc.returncode}): {why}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()


def region_stream_gbps(write_bytes: int, total_bytes: int, region_bytes: int, *, timeout_s: float = 60.0, congestion: str = "") -> float:
    """GB/s of one TCP stream over loopback, ``total_bytes`` sent in writes of ``write_bytes``
    (capped at ``IPERF3_MAX_WRITE``, as for iperf3) by another process, received with blocking
    ``recv_into`` at consecutive places in a region of ``region_bytes`` (faulted in first),
    from its start again at its end; ``congestion`` as for ``iperf3_gbps``.

    Raises:
        ValueError: a size is not positive, or the region is smaller than one write.
        RuntimeError: the sender did not connect within ``timeout_s`` or failed, or the stream
            ended short.
    """
    length = min(write_bytes, IPERF3_MAX_WRITE)
    if length <= 0 or total_bytes <= 0 or region_bytes < length:
        raise ValueError(f"need 0 < write ({length}) <= region ({region_bytes}) and total ({total_bytes}) > 0")
    got = 0
    with (
        _faulted_region(region_bytes) as view,
        _peer(_STREAM_SENDER, [str(length), str(total_bytes)], timeout_s, congestion=congestion) as conn,
    ):
        at = 0
        started = time.perf_counter()
        while got < total_bytes:
            if at + length > region_bytes:
                at = 0
            n = conn.recv_into(view[at : at + length])
            if n == 0:
                break
            got += n
            at += n
        seconds = time.perf_counter() - started
    if got < total_bytes:
        raise RuntimeError(f"the stream ended after {got} of {total_bytes} bytes")
    return got / seconds / 1e9


def pull_gbps(
    batch_bytes: int,
    total_bytes: int,
    region_bytes: int,
    *,
    buffer_bytes: int | None = None,
    timeout_s: float = 60.0,
    congestion: str = "",
) -> float:
    """GB/s of a bare pull over loopback, one batch at a time: an 8-byte request, then the
    batch's ``batch_bytes`` from another process's region, sent and received in calls of at
    most ``IPERF3_MAX_WRITE`` with blocking sockets (``TCP_NODELAY``; ``buffer_bytes`` for
    both socket buffers when given), landing at consecutive places in a region of
    ``region_bytes``; batches until ``total_bytes`` (at least 3, after one not timed), their
    bytes over their seconds; ``congestion`` as for ``iperf3_gbps``. What the kernel gives a
    transfer's shape with nothing of ours.

    Raises:
        ValueError: a size is not positive, or the region is smaller than one batch.
        RuntimeError: the peer did not connect or failed, or a reply ended short.
    """
    if batch_bytes <= 0 or total_bytes <= 0 or region_bytes < batch_bytes:
        raise ValueError(f"need 0 < batch ({batch_bytes}) <= region ({region_bytes}) and total ({total_bytes}) > 0")
    io = IPERF3_MAX_WRITE
    args = [str(io), str(region_bytes), str(buffer_bytes or 0)]
    ask = batch_bytes.to_bytes(8, "little")
    laps: list[float] = []
    with _faulted_region(region_bytes) as view, _peer(_PULL_SERVER, args, timeout_s, buffer_bytes, congestion) as conn:
        at = 0
        while len(laps) < 4 or (len(laps) - 1) * batch_bytes < total_bytes:
            if at + batch_bytes > region_bytes:
                at = 0
            began = time.perf_counter()
            conn.sendall(ask)
            got = 0
            while got < batch_bytes:
                n = conn.recv_into(view[at + got : at + min(batch_bytes, got + io)])
                if n == 0:
                    raise RuntimeError(f"a pull's reply ended after {got} of {batch_bytes} bytes")
                got += n
            laps.append(time.perf_counter() - began)
            at += batch_bytes
    timed = laps[1:]  # the first pays for connection warm-up
    return batch_bytes * len(timed) / sum(timed) / 1e9
