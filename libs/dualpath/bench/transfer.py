"""``dualpath bench transfer``: throughput and per-batch latency of every transport present.

For each block size × batch size, one initiator reads (or writes) batches of blocks from a
region served by a peer process, one batch at a time, and reports GB/s and the median batch
latency, next to a plain memcpy of the same blocks (the limit on this machine) and, when
``mooncake-transfer-engine`` is importable, Mooncake's Transfer Engine over TCP on loopback,
and the kernel's own single TCP stream over loopback (``iperf3``, at each batch's size up to
its 1 MiB write; ``versus_kernel`` sets tcp beside it and shm beside memcpy). iperf3 streams
and reads into one buffer that stays in cache; a batch is a pull that lands at its own
place. So, for batches of 1 MiB or more, tcp is also set beside the same stream read into a
region (``region_stream``) and beside a bare blocking pull of the batch's bytes (``pull``):
both with nothing of ours in them, they say whether a gap to iperf3 is where bytes land, the
request and reply a pull needs, or our code (``kernel.py``). Successive
batches of a point rotate through up to 256 windows of a ``region_bytes`` region, so large
copies come from memory rather than the CPU cache (for every column alike). The columns are
measured interleaved, point by point, in ``rounds`` rounds, so load from other processes on a
shared machine falls on all of them alike; each column keeps its best round (highest GB/s: the
least disturbed, as ``timeit`` keeps the minimum), and the latency shown is that round's
median. Each point also records the CPU time both ends spent per batch (this process and the
peer process, every thread): what a transport costs, which load on the machine moves far less
than it moves time. Each point stops after ``point_seconds`` or ``point_bytes`` (at least 3
batches), and batches larger than ``max_batch_bytes`` are skipped, which keeps a run near two
minutes. With ``data_tls`` (``--data-tls``) a ``tcp+tls`` column runs the tcp transport over
mutual TLS (throwaway certificates) beside plain tcp, and a table sets the two side by side:
what TLS costs in throughput and in CPU time of both ends. Every request names its regions'
keys, as it always does. A benchmark prints figures; the tests assert behaviour.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from dualpath.bench.kernel import IPERF3_MAX_WRITE, iperf3_gbps, iperf3_status, pull_gbps, region_stream_gbps
from dualpath.bench.mooncake import MooncakeLoopback, mooncake_status
from dualpath.transfer.factory import create_transport
from dualpath.transfer.peer import spawn_peer
from dualpath.transfer.region import MemoryRegion
from dualpath.transfer.tcp import SOCKET_BUFFER_BYTES as TCP_SOCKET_BUFFER_BYTES
from dualpath.transfer.tcp import congestion_default, set_congestion
from dualpath.transfer.tls import TlsConfig
from dualpath.transfer.types import TransferEntry

__all__ = ["DEFAULT_BATCHES", "DEFAULT_BLOCKS", "format_report", "layouts", "roundtrip_floor_us", "run_bench", "versus_kernel"]

KIB, MIB = 1 << 10, 1 << 20
DEFAULT_BLOCKS = (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB)
DEFAULT_BATCHES = (1, 4, 16, 64, 256)
MOONCAKE = "mooncake-tcp"
TCP_TLS = "tcp+tls"  # the tcp transport over mutual TLS


def run_bench(
    *,
    transports: Sequence[str] | None = None,
    block_sizes: Sequence[int] = DEFAULT_BLOCKS,
    batch_sizes: Sequence[int] = DEFAULT_BATCHES,
    op: str = "read",
    max_batch_bytes: int = 64 * MIB,
    region_bytes: int = 128 * MIB,
    point_seconds: float = 0.2,
    point_bytes: int = 256 * MIB,
    with_mooncake: bool = True,
    with_iperf3: bool = True,
    iperf3_bytes: int = 256 * MIB,
    with_tcp_references: bool = True,
    rounds: int = 5,
    data_tls: bool = False,
) -> dict[str, Any]:
    """Measure every (block, batch) point for memcpy, each transport and Mooncake, and
    iperf3's single loopback stream at each batch's size (``iperf3_bytes`` a run, once a
    round) and, with ``with_tcp_references`` for batches of 1 MiB or more, two more of the
    kernel's limits once a round: the same stream received into a region of the transfers'
    size (``region_stream``) and a bare blocking pull of each batch size (``pull``, see
    ``kernel.pull_gbps``); return a msgpack/JSON-able dict (see ``format_report``).
    ``versus_kernel`` holds, per point, tcp beside iperf3 and those two, and shm beside
    memcpy, with their ratios; with ``data_tls``
    (and tcp measured) ``tls_cost`` holds tcp beside ``tcp+tls``.

    Raises:
        ValueError: ``op`` is neither "read" nor "write".
    """
    if op not in ("read", "write"):
        raise ValueError(f"op must be 'read' or 'write', not {op!r}")
    from dualpath.transfer import available_transports

    present = available_transports()
    wanted = list(transports) if transports is not None else list(present)
    columns = ["memcpy"] + [t for t in wanted if not present.get(t, "unknown transport")]
    if data_tls and "tcp" in columns:
        columns.insert(columns.index("tcp") + 1, TCP_TLS)
    unavailable = {t: present.get(t, "unknown transport") for t in wanted if present.get(t, "?")}
    mooncake_ok, mooncake_note = mooncake_status() if with_mooncake else (False, "not requested")
    if mooncake_ok:
        columns.append(MOONCAKE)
    else:
        unavailable[MOONCAKE] = mooncake_note
    shapes = [(b, n) for b in block_sizes for n in batch_sizes if b * n <= max_batch_bytes]
    iperf3_ok, iperf3_note = iperf3_status() if with_iperf3 else (False, "not requested")
    if not iperf3_ok:
        unavailable["iperf3"] = iperf3_note
    writes = sorted({min(b * n, IPERF3_MAX_WRITE) for b, n in shapes}) if iperf3_ok else []
    kernel: dict[str, float] = {}
    size = max(region_bytes, max_batch_bytes)
    congestion = _congestion_in_use()  # the tcp transport's; the kernel's references use it too
    # Only for batches of iperf3's largest write or more: below that a Python loop's cost per
    # call, not the kernel, would set the figure.
    pulls = sorted({b * n for b, n in shapes if b * n >= IPERF3_MAX_WRITE}) if with_tcp_references and "tcp" in columns else []
    landed: dict[str, float] = {}
    pulled: dict[str, float] = {}
    started = time.perf_counter()
    floor = {
        "request_us": round(roundtrip_floor_us(0), 1),
        "reply_64k_us": round(roundtrip_floor_us(64 * KIB), 1),
        "polled_request_us": round(roundtrip_floor_us(0, polled=True), 1),
        "polled_reply_64k_us": round(roundtrip_floor_us(64 * KIB, polled=True), 1),
    }
    results: dict[str, dict[str, dict[str, float]]] = {c: {} for c in columns}
    with contextlib.ExitStack() as stack:
        tls = _throwaway_tls(stack) if TCP_TLS in columns else None
        meters = {c: stack.enter_context(_Column(c, op, size, tls if c == TCP_TLS else None)) for c in columns}
        # Interleaved: every point is measured for each column in turn, ``rounds`` times, and the
        # best round kept, so a burst of load on a shared machine hits all columns alike.
        for _ in range(rounds):
            for block, batch in shapes:
                for column, meter in meters.items():
                    got = meter.point(block, batch, point_seconds / rounds, point_bytes)
                    best = results[column].get(_key(block, batch))
                    if best is None or got["gbps"] > best["gbps"]:
                        results[column][_key(block, batch)] = got
            for length in writes:  # best round, as for every other column
                kernel[str(length)] = max(kernel.get(str(length), 0.0), iperf3_gbps(length, iperf3_bytes, congestion=congestion))
            if pulls:
                stream = region_stream_gbps(IPERF3_MAX_WRITE, iperf3_bytes, size, congestion=congestion)
                landed[str(IPERF3_MAX_WRITE)] = max(landed.get(str(IPERF3_MAX_WRITE), 0.0), stream)
            for length in pulls:  # socket buffers as the tcp transport sets them
                pull = pull_gbps(length, iperf3_bytes, size, buffer_bytes=TCP_SOCKET_BUFFER_BYTES, congestion=congestion)
                pulled[str(length)] = max(pulled.get(str(length), 0.0), pull)
    return {
        "op": op,
        "cpus": os.cpu_count(),
        "block_sizes": list(block_sizes),
        "batch_sizes": list(batch_sizes),
        "max_batch_bytes": max_batch_bytes,
        "columns": columns,
        "results": results,
        "unavailable": unavailable,
        "mooncake": {"available": mooncake_ok, "note": mooncake_note},
        "roundtrip_floor": floor,
        "tcp_congestion": congestion or "host default",
        "iperf3": {"available": iperf3_ok, "note": iperf3_note, "gbps_by_write_bytes": kernel},
        "region_stream": {"region_bytes": size, "gbps_by_write_bytes": landed},
        "pull": {"region_bytes": size, "socket_buffer_bytes": TCP_SOCKET_BUFFER_BYTES, "gbps_by_batch_bytes": pulled},
        "versus_kernel": versus_kernel(results, shapes, kernel, landed, pulled),
        "tls_cost": tls_cost(results),
        "elapsed_s": round(time.perf_counter() - started, 1),
    }


def _throwaway_tls(stack: contextlib.ExitStack) -> TlsConfig:
    """A CA and a certificate for 127.0.0.1 in a directory removed when ``stack`` closes."""
    from dualpath.transfer.tls_certs import make_pki

    folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="dualpath-bench-tls-"))
    return make_pki(folder, ["127.0.0.1"])["127.0.0.1"]


def tls_cost(results: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per point where both were measured: tcp over TLS beside plain tcp, as ratios of
    throughput (``gbps_ratio``, TLS over plain) and of CPU time of both ends per batch
    (``cpu_ratio``)."""
    plain, tls = results.get("tcp", {}), results.get(TCP_TLS, {})
    return {
        key: {
            "tcp_gbps": plain[key]["gbps"],
            "tls_gbps": tls[key]["gbps"],
            "gbps_ratio": round(tls[key]["gbps"] / plain[key]["gbps"], 3),
            "tcp_cpu_us": plain[key]["cpu_us"],
            "tls_cpu_us": tls[key]["cpu_us"],
            "cpu_ratio": round(tls[key]["cpu_us"] / plain[key]["cpu_us"], 3),
        }
        for key in plain
        if key in tls
    }


def _congestion_in_use() -> str:
    """The congestion control the tcp transport's sockets get here ("" for the host's)."""
    with socket.socket() as probe:
        return set_congestion(probe, congestion_default())


def versus_kernel(
    results: dict[str, dict[str, dict[str, float]]],
    shapes: Sequence[tuple[int, int]],
    iperf3: dict[str, float],
    region_stream: dict[str, float] | None = None,
    pull: dict[str, float] | None = None,
) -> dict[str, dict]:
    """Per point: tcp beside iperf3's stream at the batch's size (``tcp_vs_iperf3``), beside
    the stream received into a region (``tcp_vs_region_stream``) and beside a bare pull of
    the batch's bytes (``tcp_vs_pull``), those two from batches of 1 MiB; and shm beside
    memcpy (``shm_vs_memcpy``); each where both columns were measured."""
    out: dict[str, dict[str, float]] = {}
    for block, batch in shapes:
        key, row = _key(block, batch), dict[str, float]()
        tcp, shm, memcpy = (results.get(c, {}).get(key) for c in ("tcp", "shm", "memcpy"))
        stream = iperf3.get(str(min(block * batch, IPERF3_MAX_WRITE)))
        if tcp is not None and stream:
            row.update(tcp_gbps=tcp["gbps"], iperf3_gbps=stream, tcp_vs_iperf3=round(tcp["gbps"] / stream, 3))
        big = block * batch >= IPERF3_MAX_WRITE
        landed = (region_stream or {}).get(str(IPERF3_MAX_WRITE)) if big else None
        if tcp is not None and landed:
            row.update(tcp_gbps=tcp["gbps"], region_stream_gbps=landed, tcp_vs_region_stream=round(tcp["gbps"] / landed, 3))
        pulled = (pull or {}).get(str(block * batch)) if big else None
        if tcp is not None and pulled:
            row.update(tcp_gbps=tcp["gbps"], pull_gbps=pulled, tcp_vs_pull=round(tcp["gbps"] / pulled, 3))
        if shm is not None and memcpy is not None:
            row.update(shm_gbps=shm["gbps"], memcpy_gbps=memcpy["gbps"], shm_vs_memcpy=round(shm["gbps"] / memcpy["gbps"], 3))
        if row:
            out[key] = row
    return out


_FLOOR_SERVER = r"""
import asyncio, socket, sys
reply = memoryview(bytearray(32 + int(sys.argv[1])))
def polled():
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    print(ls.getsockname()[1], flush=True)
    conn, _ = ls.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setblocking(False)
    buf = bytearray(64)
    while True:
        try:
            n = conn.recv_into(buf)
        except BlockingIOError:
            continue
        if not n:
            return
        conn.setblocking(True)
        conn.sendall(reply)
        conn.setblocking(False)
async def main():
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    print(ls.getsockname()[1], flush=True)
    loop = asyncio.get_running_loop()
    conn, _ = await loop.sock_accept(ls)
    conn.setblocking(False)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    done, buf = loop.create_future(), bytearray(64)
    def on_read():
        try:
            n = conn.recv_into(buf)
        except BlockingIOError:
            return
        if not n:
            if not done.done():
                done.set_result(None)
            return
        conn.sendall(reply)
    loop.add_reader(conn.fileno(), on_read)
    await done
polled() if sys.argv[2] == "polled" else asyncio.run(main())
"""


def roundtrip_floor_us(reply_bytes: int = 0, rounds: int = 2000, *, polled: bool = False) -> float:
    """Median round trip of the leanest exchange between two processes on this host: a
    32-byte request answered with ``32 + reply_bytes`` bytes (no framing, no lookups).

    Event loop (default): each side a reader callback registered once, sleeping in epoll
    between messages: what a Python transport that waits in its event loop pays per batch at
    least (on a virtual machine mostly the wake-ups of a sleeping process). ``polled``: both
    sides poll their socket without sleeping, the floor of a busy-polling transport (the
    tcp transport's ``busy_poll``, Mooncake's worker threads)."""
    import subprocess
    import sys

    mode = "polled" if polled else "loop"
    proc = subprocess.Popen([sys.executable, "-c", _FLOOR_SERVER, str(reply_bytes), mode], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        if polled:
            return _polled_client(port, 32 + reply_bytes, rounds)
        return asyncio.run(_floor_client(port, 32 + reply_bytes, rounds))
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


async def _floor_client(port: int, expect: int, rounds: int) -> float:
    import socket

    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(expect))
    got = 0
    fut: asyncio.Future[None] | None = None

    def on_read() -> None:
        nonlocal got
        while True:
            try:
                n = sock.recv_into(buf[got:])
            except BlockingIOError:
                return
            got += n
            if not n or got == expect:
                got = 0
                if fut is not None and not fut.done():
                    fut.set_result(None)
                return

    loop.add_reader(sock.fileno(), on_read)
    laps = []
    try:
        for i in range(rounds + 200):
            fut = loop.create_future()
            t0 = time.perf_counter()
            sock.send(b"x" * 32)
            await fut
            if i >= 200:
                laps.append(time.perf_counter() - t0)
    finally:
        loop.remove_reader(sock.fileno())
        sock.close()
    return statistics.median(laps) * 1e6


def _polled_client(port: int, expect: int, rounds: int) -> float:
    import socket

    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    buf = memoryview(bytearray(expect))
    laps = []
    try:
        for i in range(rounds + 200):
            t0 = time.perf_counter()
            sock.send(b"x" * 32)
            got = 0
            while got < expect:
                try:
                    got += sock.recv_into(buf[got:])
                except BlockingIOError:
                    continue
            if i >= 200:
                laps.append(time.perf_counter() - t0)
    finally:
        sock.close()
    return statistics.median(laps) * 1e6


def _key(block: int, batch: int) -> str:
    return f"{block}x{batch}"


def layouts(block: int, batch: int, size: int) -> list[list[tuple[int, int, int]]]:
    """Per window, the (local offset, remote offset, length) of each block of a batch.

    Windows are spread over the region so consecutive batches touch different memory; the
    remote blocks of a batch are scattered (a request's layer blocks are not contiguous).
    """
    span = block * batch
    count = max(1, min(size // span, 256, 65536 // batch))
    out = []
    for w in range(count):
        base = w * (size // count) // block * block
        out.append([(base + i * block, base + ((i * 7919) % batch) * block, block) for i in range(batch)])
    return out


def _time_point(run: Callable[[int], object], nbytes: int, seconds: float, max_bytes: int, cpu: Callable[[], float]) -> dict[str, float]:
    run(0)  # warm-up: connections, page faults
    laps: list[float] = []
    total = 0.0
    cpu0 = cpu()
    while len(laps) < 3 or (total < seconds and nbytes * len(laps) < max_bytes):
        t0 = time.perf_counter()
        run(len(laps) + 1)
        laps.append(time.perf_counter() - t0)
        total += laps[-1]
    return _figures(nbytes, laps, total, cpu() - cpu0)


def _figures(nbytes: int, laps: list[float], total: float, cpu_s: float) -> dict[str, float]:
    return {
        "gbps": nbytes * len(laps) / total / 1e9,
        "latency_us": statistics.median(laps) * 1e6,
        "cpu_us": cpu_s / len(laps) * 1e6,  # both ends, per batch
    }


def _cpu_seconds(pid: int | None) -> float:
    """CPU time of this process (every thread) plus that of process ``pid``'s live threads
    (Linux ``/proc/PID/task/*/schedstat``, in ns; elsewhere only this process)."""
    here = time.process_time()
    if pid is None:
        return here
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return here
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return here + total / 1e9


class _Column:
    """One column of the table, open for the whole run: ``point`` measures one shape."""

    def __init__(self, name: str, op: str, size: int, tls: TlsConfig | None = None) -> None:
        self.name, self.op, self.size, self.tls = name, op, size, tls
        self._stack = contextlib.ExitStack()
        self._peer_pid: int | None = None

    def __enter__(self) -> _Column:
        if self.name == "memcpy":
            tag = uuid.uuid4().hex[:10]
            a = self._stack.enter_context(MemoryRegion(f"bench-memcpy-a-{tag}", self.size))
            b = self._stack.enter_context(MemoryRegion(f"bench-memcpy-b-{tag}", self.size))
            a.as_array()[:] = 1  # fault every page in now, not inside the timed copies
            b.as_array()[:] = 2
            self._src, self._dst = (b.buf, a.buf) if self.op == "read" else (a.buf, b.buf)
        elif self.name == MOONCAKE:
            self._mc = self._stack.enter_context(MooncakeLoopback(self.size))
            self._peer_pid = self._mc.target_pid
        else:
            self._loop = asyncio.new_event_loop()
            self._stack.callback(self._loop.close)
            self._loop.run_until_complete(self._open_transport())
        return self

    async def _open_transport(self) -> None:
        kind = "tcp" if self.name == TCP_TLS else self.name
        rid = self._rid = f"bench-{kind}-{uuid.uuid4().hex[:10]}"
        transport = create_transport(kind, node_id="bench", data_tls=self.tls)
        await transport.start()
        self._stack.callback(lambda: self._loop.run_until_complete(transport.close()))
        local = MemoryRegion(f"{rid}-local", self.size)
        self._stack.callback(local.unlink)
        self._stack.callback(local.close)
        local.as_array()[:] = 1  # fault every page in now, not inside the timed transfers
        peer = spawn_peer(kind, {rid: self.size}, node_id="bench-peer", tls=self.tls)
        self._stack.callback(peer.stop)
        self._peer_pid = peer.proc.pid
        await transport.connect(peer.descriptors[rid])
        self._move = transport.read if self.op == "read" else transport.write
        self._local = local

    def point(self, block: int, batch: int, seconds: float, max_bytes: int) -> dict[str, float]:
        windows = layouts(block, batch, self.size)
        nbytes = block * batch
        cpu = functools.partial(_cpu_seconds, self._peer_pid)
        if self.name == "memcpy":
            src, dst = self._src, self._dst

            def copy(i: int) -> None:
                for lo, ro, n in windows[i % len(windows)]:
                    dst[lo : lo + n] = src[ro : ro + n]

            return _time_point(copy, nbytes, seconds, max_bytes, cpu)
        if self.name == MOONCAKE:
            return _time_point(lambda i: self._mc.batch(self.op, windows[i % len(windows)]), nbytes, seconds, max_bytes, cpu)
        entries = [[TransferEntry(lo, self._rid, ro, n) for lo, ro, n in w] for w in windows]
        return self._loop.run_until_complete(
            _time_point_async(lambda i: self._move(self._local, entries[i % len(entries)]), nbytes, seconds, max_bytes, cpu)
        )

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


async def _time_point_async(run: Callable, nbytes: int, seconds: float, max_bytes: int, cpu: Callable[[], float]) -> dict[str, float]:
    await run(0)
    laps: list[float] = []
    total = 0.0
    cpu0 = cpu()
    while len(laps) < 3 or (total < seconds and nbytes * len(laps) < max_bytes):
        t0 = time.perf_counter()
        await run(len(laps) + 1)
        laps.append(time.perf_counter() - t0)
        total += laps[-1]
    return _figures(nbytes, laps, total, cpu() - cpu0)


def _size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def format_report(d: dict[str, Any]) -> str:
    """The human-readable table of a ``run_bench`` result."""
    columns = d["columns"]
    lines = [
        (
            f"dualpath bench transfer: {d['op']} of batches of blocks, one batch at a time "
            f"({d['cpus']} CPUs, batches up to {_size(d['max_batch_bytes'])}, {d['elapsed_s']} s)"
        ),
        "cells: GB/s  median batch latency (us); tcp/memcpy = tcp GB/s over memcpy GB/s",
        "",
    ]
    versus = "tcp" in columns and MOONCAKE in columns
    if versus:
        lines.insert(
            2,
            "tcp/mc: tcp GB/s over Mooncake TCP GB/s, and by median latency (Mooncake's over tcp's: load on the machine moves the "
            "mean far more than the median); cpu us: CPU time of both ends per batch (every thread), tcp | mooncake",
        )
    head = f"{'block':>7} {'batch':>5} " + "".join(f"{c:>22}" for c in columns)
    if "tcp" in columns:
        head += f"{'tcp/memcpy':>12}"
    if versus:
        head += f"{'tcp/mc':>9}{'(p50)':>7}{'cpu us tcp | mc':>20}"
    lines += [head, "-" * len(head)]
    first = d["results"][columns[0]]
    for block in d["block_sizes"]:
        for batch in d["batch_sizes"]:
            key = _key(block, batch)
            if key not in first:
                continue
            row = f"{_size(block):>7} {batch:>5} "
            for c in columns:
                r = d["results"][c][key]
                row += f"{r['gbps']:>9.3f} {r['latency_us']:>10.0f} us"
            if "tcp" in columns:
                row += f"{d['results']['tcp'][key]['gbps'] / first[key]['gbps']:>11.0%}"
            if versus:
                t, m = d["results"]["tcp"][key], d["results"][MOONCAKE][key]
                row += f"{t['gbps'] / m['gbps']:>8.2f}x{m['latency_us'] / t['latency_us']:>6.2f}x{t['cpu_us']:>9.0f} |{m['cpu_us']:>9.0f}"
            lines.append(row)
    lines.append("")
    floor = d.get("roundtrip_floor")
    if floor:
        lines.append(
            f"cross-process loopback round-trip floor (event loop, reader callbacks): {floor['request_us']:.0f} us "
            f"(32 B reply), {floor['reply_64k_us']:.0f} us (64 KiB reply)"
        )
        if "polled_request_us" in floor:
            lines.append(
                f"cross-process loopback round-trip floor (both ends polling, no event loop): {floor['polled_request_us']:.0f} us "
                f"(32 B reply), {floor['polled_reply_64k_us']:.0f} us (64 KiB reply)"
            )
        if "tcp" in d["results"] and _key(64 * KIB, 1) in d["results"]["tcp"]:
            one = _key(64 * KIB, 1)
            mc = f"; Mooncake TCP {d['results'][MOONCAKE][one]['latency_us']:.0f} us" if MOONCAKE in d["results"] else ""
            polled = f", polled {floor['polled_reply_64k_us']:.0f} us" if "polled_reply_64k_us" in floor else ""
            lines.append(
                f"one 64 KiB block per batch (median): tcp {d['results']['tcp'][one]['latency_us']:.0f} us{mc}; "
                f"round-trip floor: event loop {floor['reply_64k_us']:.0f} us{polled}"
            )
    for name, reason in d["unavailable"].items():
        lines.append(f"{name}: not measured ({reason})")
    lines += _kernel_table(d)
    lines += _tls_table(d)
    lines += _verdicts(d)
    return "\n".join(lines)


def _tls_table(d: dict[str, Any]) -> list[str]:
    """tcp over TLS beside plain tcp, point by point, and the medians."""
    cost = d.get("tls_cost") or {}
    if not cost:
        return []
    lines = ["", "what TLS costs: tcp+tls beside tcp (GB/s, and CPU us of both ends per batch)"]
    head = f"{'block':>7} {'batch':>5} {'tcp':>8} {'tcp+tls':>8} {'ratio':>6}   {'cpu tcp':>9} {'cpu tls':>9} {'ratio':>6}"
    lines += [head, "-" * len(head)]
    for key, row in cost.items():
        block, batch = (int(x) for x in key.split("x"))
        lines.append(
            f"{_size(block):>7} {batch:>5} {row['tcp_gbps']:>8.3f} {row['tls_gbps']:>8.3f} {row['gbps_ratio']:>6.2f}   "
            f"{row['tcp_cpu_us']:>9.0f} {row['tls_cpu_us']:>9.0f} {row['cpu_ratio']:>6.2f}"
        )
    gbps = statistics.median(r["gbps_ratio"] for r in cost.values())
    cpu = statistics.median(r["cpu_ratio"] for r in cost.values())
    big = [r for k, r in cost.items() if _batch_bytes(k) >= MIB]
    line = f"TLS over plain tcp, median of {len(cost)} points: {gbps:.2f}x the throughput, {cpu:.2f}x the CPU per batch"
    if big:
        big_gbps, big_cpu = statistics.median(r["gbps_ratio"] for r in big), statistics.median(r["cpu_ratio"] for r in big)
        line += f"; batches >= 1 MiB: {big_gbps:.2f}x, {big_cpu:.2f}x"
    return [*lines, line]


def _kernel_table(d: dict[str, Any]) -> list[str]:
    """tcp beside iperf3 and the region stream, and shm beside memcpy, point by point."""
    vs = d.get("versus_kernel") or {}
    if not vs:
        return []
    lines = [
        "",
        "against the kernel: tcp vs iperf3 (one loopback stream, writes of the batch's size up to 1 MiB, read into one buffer)",
        "vs the same stream read into a region of the transfers' size, and vs a bare blocking pull of the batch",
        "(both for batches >= 1 MiB); shm vs memcpy",
        f"TCP congestion control of tcp, iperf3 and both references: {d.get('tcp_congestion', '?')} (Mooncake keeps the host's)",
    ]
    head = (
        f"{'block':>7} {'batch':>5} {'tcp':>8} {'iperf3':>8} {'ratio':>6} {'region':>8} {'ratio':>6} {'pull':>8} {'ratio':>6}"
        f"   {'shm':>8} {'memcpy':>8} {'ratio':>6}"
    )
    lines += [head, "-" * len(head)]
    for key, row in vs.items():
        block, batch = (int(x) for x in key.split("x"))
        tcp = f"{row['tcp_gbps']:>8.3f} {row['iperf3_gbps']:>8.3f} {row['tcp_vs_iperf3']:>6.2f}" if "tcp_vs_iperf3" in row else " " * 24
        region = f" {row['region_stream_gbps']:>8.3f} {row['tcp_vs_region_stream']:>6.2f}" if "tcp_vs_region_stream" in row else " " * 16
        pull = f" {row['pull_gbps']:>8.3f} {row['tcp_vs_pull']:>6.2f}" if "tcp_vs_pull" in row else " " * 16
        shm = f"{row['shm_gbps']:>8.3f} {row['memcpy_gbps']:>8.3f} {row['shm_vs_memcpy']:>6.2f}" if "shm_vs_memcpy" in row else ""
        lines.append(f"{_size(block):>7} {batch:>5} {tcp}{region}{pull}   {shm}")
    big = {k: r for k, r in vs.items() if _batch_bytes(k) >= MIB}
    aims = (
        ("tcp_vs_iperf3", "tcp vs iperf3"),
        ("tcp_vs_region_stream", "tcp vs the region stream"),
        ("tcp_vs_pull", "tcp vs a bare pull"),
        ("shm_vs_memcpy", "shm vs memcpy"),
    )
    for what, aim in aims:
        have = {k: r[what] for k, r in big.items() if what in r}
        if have:
            worst = min(have, key=lambda k: have[k])
            lines.append(f"{aim}, batches >= 1 MiB: worst {have[worst]:.2f} (at {worst}); aim >= 0.9")
    return lines


def _batch_bytes(key: str) -> int:
    block, batch = (int(x) for x in key.split("x"))
    return block * batch


def _verdicts(d: dict[str, Any]) -> list[str]:
    out: list[str]
    res, out = d["results"], []
    if "tcp" not in res:
        return out
    big = [k for k in res["tcp"] if int(k.split("x")[0]) >= 256 * KIB]
    if big:
        worst = min(big, key=lambda k: res["tcp"][k]["gbps"] / res["memcpy"][k]["gbps"])
        ratio = res["tcp"][worst]["gbps"] / res["memcpy"][worst]["gbps"]
        out.append(f"tcp vs memcpy, blocks >= 256 KiB: worst {ratio:.0%} (at {worst}); aim >= 50%")
    if MOONCAKE in res:
        worst = min(res["tcp"], key=lambda k: res["tcp"][k]["gbps"] / res[MOONCAKE][k]["gbps"])
        ratio = res["tcp"][worst]["gbps"] / res[MOONCAKE][worst]["gbps"]
        behind = [k for k in res["tcp"] if res["tcp"][k]["gbps"] < res[MOONCAKE][k]["gbps"]]
        note = f"; behind at {', '.join(behind)}" if behind else ""
        out.append(f"tcp vs Mooncake TCP, every point: worst {ratio:.2f}x (at {worst}); aim >= 1x{note}")
        slower = [k for k in res["tcp"] if res["tcp"][k]["latency_us"] > res[MOONCAKE][k]["latency_us"]]
        out.append(
            f"by median batch latency: tcp slower at {len(slower)} of {len(res['tcp'])} points"
            + (f" ({', '.join(slower)})" if slower else "")
        )
        cheaper = sum(res["tcp"][k]["cpu_us"] < res[MOONCAKE][k]["cpu_us"] for k in res["tcp"])
        cpu = statistics.median(res["tcp"][k]["cpu_us"] / res[MOONCAKE][k]["cpu_us"] for k in res["tcp"])
        out.append(f"CPU per batch, both ends: tcp below Mooncake TCP at {cheaper} of {len(res['tcp'])} points (median tcp/mc {cpu:.2f})")
    return out
