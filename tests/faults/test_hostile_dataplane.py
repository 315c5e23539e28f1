"""Hostile peers on the tcp data plane, over real sockets.

A rogue client that knows a region's id (ids show in logs and control messages) but not its
key reads nothing and writes nothing, and the server logs it with the rogue's address; one
that keeps guessing is disconnected. Hypothesis then throws malformed request frames at a
server (wrong lengths, huge counts, offsets past the region, truncated payloads, bad magic):
the server never crashes, never touches the guard bytes on either side of the region it
serves, and drops only the hostile connection, while a well-behaved client on another one
keeps getting exact bytes during and after.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import socket
import struct
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dualpath.transfer import MemoryRegion, TransferEntry, create_transport
from dualpath.transfer import tcp_server as tcp_server_module
from dualpath.transfer.peer import PeerProcess, pattern, spawn_peer
from dualpath.transfer.tcp import TcpTransport
from dualpath.transfer.tcp_wire import ENTRY, MAX_ENTRIES, REPLY, REPLY_MAGIC, REQUEST, REQUEST_MAGIC, Op, Status, encode_request

pytestmark = pytest.mark.faults

KIB = 1 << 10
SIZE = 64 * KIB  # the region under attack
GUARD = 4 * KIB  # guard bytes before and after it
GUARD_BYTE = 0xA5


def _rid(tag: str) -> str:
    return f"test-hostile-{tag}-{uuid.uuid4().hex[:12]}"


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionResetError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def _reply(sock: socket.socket) -> tuple[int, int, dict[str, Any] | None, bytes]:
    """(status, batch id, error body, payload) of the next reply on ``sock``."""
    magic, status, _op, _, error_len, batch_id, payload_len = REPLY.unpack(_recv_exactly(sock, REPLY.size))
    assert magic == REPLY_MAGIC
    error = msgpack.unpackb(_recv_exactly(sock, error_len)) if error_len else None
    return status, batch_id, error, _recv_exactly(sock, payload_len)


def _read_to_eof(sock: socket.socket, timeout_s: float = 10.0) -> bytes:
    sock.settimeout(timeout_s)
    out = bytearray()
    while chunk := sock.recv(1 << 16):
        out += chunk
    return bytes(out)


# ---- a rogue client against a peer process ------------------------------------------------


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[tuple[PeerProcess, str, Path]]:
    """A peer process serving one region (its log in a file we read)."""
    rid = _rid("victim")
    log = tmp_path / "peer.log"
    with log.open("wb") as sink:
        peer = spawn_peer("tcp", {rid: SIZE}, seed=9, stderr=sink)
    try:
        yield peer, rid, log
    finally:
        peer.stop()


def _victim_bytes(peer: PeerProcess, rid: str) -> np.ndarray:
    """The victim region's bytes, read by a client that holds the descriptor (and its key)."""

    async def read() -> np.ndarray:
        client = create_transport("tcp", node_id="owner-side", timeout_s=10.0)
        local = MemoryRegion(_rid("check"), SIZE)
        await client.start()
        try:
            await client.connect(peer.descriptors[rid])
            await client.read(local, [TransferEntry(0, rid, 0, SIZE)])
            return local.as_array().copy()
        finally:
            await client.close()
            local.close()
            local.unlink()

    return asyncio.run(read())


def _refusals(log: Path, peer_address: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The victim's tcp_key_refused lines naming ``peer_address`` (the log is written as they come)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if "tcp_key_refused" in ln and peer_address in ln]
        if lines or time.monotonic() > deadline:
            return [json.loads(ln) for ln in lines]
        time.sleep(0.05)


def test_a_rogue_with_a_valid_region_id_but_no_key_or_a_wrong_key_reads_nothing_writes_nothing_and_is_logged(victim) -> None:
    peer, rid, log = victim
    port = int(peer.descriptors[rid].address["port"])
    before = _victim_bytes(peer, rid)
    assert np.array_equal(before, pattern(SIZE, 9))
    with _connect(port) as rogue:
        host, rogue_port = rogue.getsockname()[:2]
        here = f"{host}:{rogue_port}"
        for batch, key in ((1, b""), (2, bytes(16)), (3, secrets.token_bytes(16))):  # no key, the all-zero key, a guess
            rogue.sendall(encode_request(Op.READ, 1, batch, [TransferEntry(0, rid, 0, SIZE)], 0, {rid: key}))
            status, got_batch, error, payload = _reply(rogue)
            assert (status, got_batch, payload) == (Status.ERROR, batch, b"")
            assert error is not None and error["kind"] == "access_denied" and error["region_id"] == rid
        hostile = bytes([0xEE]) * SIZE
        rogue.sendall(encode_request(Op.WRITE, 1, 4, [TransferEntry(0, rid, 0, SIZE)], SIZE, {rid: secrets.token_bytes(16)}) + hostile)
        status, _, error, _ = _reply(rogue)
        assert status == Status.ERROR and error is not None and error["kind"] == "access_denied"
        # strided and many-entry forms are refused the same way, before any entry is looked at
        many = [TransferEntry(0, rid, i * 64, 64) for i in range(512)] + [TransferEntry(0, rid, 0, 16, count=8, remote_stride=512)]
        rogue.sendall(encode_request(Op.WRITE, 1, 5, many, 512 * 64 + 128, {}) + hostile[: 512 * 64 + 128])
        assert (_reply(rogue)[2] or {}).get("kind") == "access_denied"
    assert np.array_equal(_victim_bytes(peer, rid), before), "a refused write changed the region"
    refusals = _refusals(log, here)
    assert [r["op"] for r in refusals] == ["READ", "READ", "READ", "WRITE", "WRITE"]
    assert all(r["region"] == rid and r["peer"] == here and r["level"] == "warning" for r in refusals)
    assert peer.descriptors[rid].key.hex() not in log.read_text()  # the key itself is never logged


def test_a_rogue_that_keeps_guessing_keys_is_disconnected_while_the_key_holder_keeps_being_served(victim) -> None:
    peer, rid, log = victim
    port = int(peer.descriptors[rid].address["port"])
    desc = peer.descriptors[rid]
    with _connect(port) as rogue, _connect(port) as honest:
        frames = b"".join(
            encode_request(Op.READ, 1, i, [TransferEntry(0, rid, 0, 4 * KIB)], 0, {rid: secrets.token_bytes(16)}) for i in range(1, 21)
        )
        rogue.sendall(frames)
        answered = _read_to_eof(rogue)  # the server hangs up: the read ends
        assert answered.count(REPLY_MAGIC) == tcp_server_module._MAX_REFUSALS - 1  # the last guess gets no answer
        honest.sendall(encode_request(Op.READ, 1, 99, [TransferEntry(0, rid, 0, 4 * KIB)], 0, {rid: desc.key}))
        status, batch, _, payload = _reply(honest)
        assert (status, batch) == (Status.OK, 99) and payload == bytes(pattern(SIZE, 9)[: 4 * KIB])
    text = log.read_text()
    assert "tcp_connection_dropped" in text and "requests with wrong keys" in text


def test_a_client_without_a_certificate_gets_nothing_from_a_tls_server_and_is_logged_with_its_address(tmp_path: Path) -> None:
    from dualpath.transfer.tls_certs import make_pki

    cfg = make_pki(tmp_path / "pki", ["127.0.0.1"])["127.0.0.1"]
    rid, log = _rid("tls-victim"), tmp_path / "peer.log"
    with log.open("wb") as sink:
        peer = spawn_peer("tcp", {rid: SIZE}, seed=9, tls=cfg, stderr=sink)
    try:
        desc = peer.descriptors[rid]
        with _connect(int(desc.address["port"])) as rogue:  # knows the id and even the key, has no certificate
            host, rogue_port = rogue.getsockname()[:2]
            rogue.sendall(encode_request(Op.READ, 1, 1, [TransferEntry(0, rid, 0, SIZE)], 0, {rid: desc.key}))
            try:
                got = _read_to_eof(rogue)
            except ConnectionResetError:
                got = b""
        assert REPLY_MAGIC not in got and bytes(pattern(64, 9)) not in got
        deadline = time.monotonic() + 10
        while f"{host}:{rogue_port}" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        line = next(ln for ln in log.read_text().splitlines() if f"{host}:{rogue_port}" in ln)
        assert json.loads(line)["event"] == "tcp_tls_refused"
    finally:
        peer.stop()


# ---- malformed frames, generated, against a server whose region has guards -----------------


class _Window:
    """The middle ``size`` bytes of a larger region, served as a region of its own, so the
    bytes either side of it are guards a stray copy would overwrite."""

    def __init__(self, outer: MemoryRegion, offset: int, size: int, region_id: str) -> None:
        self.region_id, self.size, self.key = region_id, size, secrets.token_bytes(16)
        self.buf = outer.buf[offset : offset + size]
        self.closed = False

    accepts = MemoryRegion.accepts
    check_range = MemoryRegion.check_range


class _Quiet:
    """Stands in for the server's logger: keeps events (a flood of refusals would otherwise
    fill the captured output), so the test can see that no unexpected error was logged."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def _keep(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))

    def exception(self, event: str, **kw: Any) -> None:
        self._keep(event, **kw, traceback=traceback.format_exc())

    warning = info = error = _keep


class _Server:
    """A tcp transport on its own event loop in a thread, serving a guarded target window and
    a sentinel region no hostile frame holds the key of."""

    def __init__(self, quiet: _Quiet) -> None:
        self.quiet = quiet
        self.outer = MemoryRegion(_rid("outer"), GUARD + SIZE + GUARD)
        self.outer.buf[:] = bytes([GUARD_BYTE]) * self.outer.size
        self.target = _Window(self.outer, GUARD, SIZE, _rid("target"))
        self.target.buf[:] = bytes(pattern(SIZE, 1))
        self.sentinel = MemoryRegion(_rid("sentinel"), SIZE)
        self.sentinel.buf[:] = bytes(pattern(SIZE, 2))
        self.loop = asyncio.new_event_loop()
        self.loop_errors: list[dict[str, Any]] = []
        self.loop.set_exception_handler(lambda _loop, ctx: self.loop_errors.append(ctx))
        self.thread = threading.Thread(target=self.loop.run_forever, name="hostile-server", daemon=True)
        self.thread.start()
        self.transport = TcpTransport(node_id="victim")
        self._call(self.transport.start())
        self.port = self.transport.port
        self.transport.register(self.target)  # type: ignore[arg-type]  # a window quacks like a region
        self.transport.register(self.sentinel)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def guards_intact(self) -> bool:
        arr = self.outer.as_array()
        return bool((arr[:GUARD] == GUARD_BYTE).all() and (arr[GUARD + SIZE :] == GUARD_BYTE).all())

    def close(self) -> None:
        self._call(self.transport.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()
        self.target.buf.release()
        for r in (self.outer, self.sentinel):
            r.close()
            r.unlink()


class _Honest:
    """A well-behaved client on a connection of its own, reading the sentinel back and
    checking every byte (in a thread of its own: it keeps going while frames are thrown)."""

    def __init__(self, server: _Server) -> None:
        self.server, self.sock = server, _connect(server.port)
        self.batches = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="honest-client", daemon=True)

    def read_once(self, batch: int) -> None:
        s = self.server.sentinel
        offset, length = (batch * 4093) % (SIZE - 8 * KIB), 8 * KIB
        self.sock.sendall(encode_request(Op.READ, 0, batch, [TransferEntry(0, s.region_id, offset, length)], 0, {s.region_id: s.key}))
        status, got, error, payload = _reply(self.sock)
        if (status, got) != (Status.OK, batch) or payload != bytes(s.buf[offset : offset + length]):
            self.failures.append(f"batch {batch}: status {status}, error {error}")
        self.batches += 1

    def _run(self) -> None:
        batch = 1 << 20
        while not self._stop.is_set():
            try:
                self.read_once(batch)
            except OSError as exc:
                self.failures.append(f"batch {batch}: {exc!r}")
                return
            batch += 1
            time.sleep(0.002)

    def __enter__(self) -> _Honest:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.sock.close()


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    quiet = _Quiet()
    real = tcp_server_module._log
    tcp_server_module._log = quiet
    s = _Server(quiet)
    try:
        yield s
    finally:
        s.close()
        tcp_server_module._log = real


U32, U64 = (1 << 32) - 1, (1 << 64) - 1


def test_a_strided_entry_spanning_past_2_to_the_64_gets_an_error_reply_and_the_connection_goes_on(server: _Server) -> None:
    """Found by the generator below: the span of such an entry did not fit the error reply."""
    target = server.target
    huge = TransferEntry(0, target.region_id, 8, 1, count=U32, local_stride=1, remote_stride=U64)
    with _connect(server.port) as sock:
        sock.sendall(encode_request(Op.READ, 0, 1, [huge], 0, {target.region_id: target.key}))
        status, _, error, _ = _reply(sock)
        assert status == Status.ERROR and error is not None and error["kind"] == "out_of_bounds"
        sock.sendall(encode_request(Op.READ, 0, 2, [TransferEntry(0, target.region_id, 0, 64)], 0, {target.region_id: target.key}))
        assert _reply(sock)[3] == bytes(target.buf[:64])


_offsets = st.one_of(st.integers(0, SIZE + 64), st.sampled_from([SIZE - 1, SIZE, SIZE + 1, 1 << 63, U64, U64 - SIZE]))
_lengths = st.one_of(st.integers(0, 4 * KIB), st.integers(0, SIZE + 64), st.sampled_from([SIZE, SIZE + 1, 1 << 40, U64]))
_counts = st.one_of(st.integers(0, 4), st.integers(0, 64), st.sampled_from([U32, 1 << 20]))
_strides = st.one_of(st.integers(0, 8 * KIB), st.sampled_from([0, 1, SIZE, 1 << 62, U64]))


class _Frame(bytes):
    """A generated frame whose repr says how it was made (not its bytes: payloads are large)."""

    def __new__(cls, raw: bytes, how: str) -> _Frame:
        self = super().__new__(cls, raw)
        self.how = how
        return self

    def __repr__(self) -> str:
        return f"<frame of {len(self)} B: {self.how}>"


@st.composite
def _frames(draw: Any, target: _Window, sentinel: MemoryRegion) -> _Frame:
    """A request frame that is wrong in some way (or not: some are valid), possibly cut short."""
    # Each field is right most of the time, so that frames get past the first check often
    # enough to reach the later ones (keys, entries, payloads).
    magic = draw(st.sampled_from([REQUEST_MAGIC] * 12 + [b"DPq2", b"DPr1", b"\0\0\0\0", b"\xff" * 4]))
    op = draw(st.sampled_from([Op.READ, Op.WRITE] * 6 + [0, 3, 255]))
    kinds = draw(st.lists(st.sampled_from(["target", "target", "wrong-key", "sentinel-guess", "unknown", "not-utf8"]), max_size=3))
    records = []
    for kind in kinds:
        key = target.key if kind == "target" else secrets.token_bytes(16)
        rid = {"target": target.region_id, "wrong-key": target.region_id, "sentinel-guess": sentinel.region_id}.get(kind, "nobody")
        raw = b"\xff\xfe" if kind == "not-utf8" else rid.encode()
        records.append(key + struct.pack("<H", len(raw)) + raw)
    table = b"".join(records)
    table = draw(st.sampled_from([table] * 8 + [table[:-3], table + b"\x00\x01"]))
    n_regions = draw(st.sampled_from([len(records)] * 8 + [0, len(records) + 1, 0xFFFF]))
    slots = st.one_of(st.integers(0, max(len(records), 1)), st.sampled_from([U32]))
    entries = draw(st.lists(st.tuples(slots, _offsets, _lengths, _counts, _strides), max_size=6))
    body = b"".join(ENTRY.pack(*e) for e in entries)
    n_entries = draw(st.sampled_from([len(entries)] * 8 + [len(entries) + 1, MAX_ENTRIES, MAX_ENTRIES + 1, U32]))
    total = sum(length * max(count, 1) for _, _, length, count, _ in entries)
    payload_len = min(draw(st.sampled_from([total] * 6 + [0, total + 1, max(total - 1, 0), U64])), U64)
    payload = os.urandom(min(payload_len, 128 * KIB)) if op == Op.WRITE else b""
    head = REQUEST.pack(magic, op, draw(st.integers(0, 255)), n_regions, n_entries, len(table), draw(st.integers(0, U64)), payload_len)
    frame = head + table + body + payload
    cut = draw(st.sampled_from([len(frame)] * 4 + [-1]))
    cut = draw(st.integers(0, len(frame))) if cut < 0 else cut
    return _Frame(
        frame[:cut],
        f"{magic!r} op {op} regions {kinds} n_regions {n_regions} entries {entries} n_entries {n_entries} "
        f"payload_len {payload_len} sent {len(payload)} cut at {cut} of {len(frame)}",
    )


def test_generated_malformed_frames_never_crash_the_server_touch_guards_or_disturb_another_connection(server: _Server) -> None:
    sentinel_before = bytes(server.sentinel.buf)
    with _Honest(server) as honest:

        @settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(frame=_frames(server.target, server.sentinel))
        def throw(frame: bytes) -> None:
            with _connect(server.port) as sock:
                try:
                    sock.sendall(frame)
                    sock.shutdown(socket.SHUT_WR)  # what a truncated frame would wait for never comes
                    _read_to_eof(sock)  # every answer, then the server hangs up
                except TimeoutError:
                    raise  # the server neither answered nor hung up: a stuck connection
                except OSError:
                    pass  # the server dropped the connection mid-frame (reset, broken pipe): only this one
            assert server.guards_intact(), "bytes outside the served region changed"

        throw()
        after = honest.batches
        time.sleep(0.05)
    assert not honest.failures, honest.failures[:5]
    assert after > 0 and honest.batches >= after
    assert bytes(server.sentinel.buf) == sentinel_before  # nobody holds its key
    with _connect(server.port) as fresh:  # the accept loop is alive and a new connection is served
        target = server.target
        fresh.sendall(encode_request(Op.READ, 0, 7, [TransferEntry(0, target.region_id, 0, SIZE)], 0, {target.region_id: target.key}))
        status, _, _, payload = _reply(fresh)
        assert status == Status.OK and payload == bytes(server.target.buf)
    assert server.thread.is_alive() and not server.loop_errors, server.loop_errors[:3]
    unexpected = [(e, kw) for e, kw in server.quiet.events if e == "tcp_connection_failed"]
    assert not unexpected, unexpected[:3]
    reasons = {kw.get("reason") for e, kw in server.quiet.events if e == "tcp_connection_dropped"}
    assert "malformed request" in reasons  # the generator did reach the malformed-stream path
    assert any(e == "tcp_key_refused" for e, _ in server.quiet.events)
    assert re.fullmatch(r"127\.0\.0\.1:\d+", next(kw["peer"] for e, kw in server.quiet.events if e == "tcp_key_refused"))
