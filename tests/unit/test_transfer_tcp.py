"""tcp-transport specifics: one round trip per batch, the server's own checks, pipelining,
timeouts on a peer that stops answering, and recovery after errors."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import anyio
import numpy as np
import pytest
from conftest import pause
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.transfer import (
    MemoryRegion,
    OutOfBoundsError,
    PeerLostError,
    TransferEntry,
    TransferTimeoutError,
    UnknownRegionError,
    create_transport,
    tcp_server,
)
from dualpath.transfer.peer import pattern, spawn_peer
from dualpath.transfer.tcp import TcpTransport
from dualpath.transfer.tcp_conn import local_views

pytestmark = pytest.mark.anyio

MIB = 1 << 20


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _rid(tag: str) -> str:
    return f"test-tcp-{tag}-{uuid.uuid4().hex[:12]}"


@contextlib.asynccontextmanager
async def _linked(size: int = 4 * MIB, **kw) -> AsyncIterator[tuple[TcpTransport, TcpTransport, MemoryRegion, MemoryRegion]]:
    """Initiator ``a`` connected to ``b``, which serves ``remote``; ``kw`` go to both transports."""
    a = TcpTransport(node_id="a", timeout_s=5.0, **kw)
    b = TcpTransport(node_id="b", **kw)
    local, remote = MemoryRegion(_rid("l"), size), MemoryRegion(_rid("r"), size)
    try:
        await a.start()
        await b.start()
        await a.connect(b.register(remote))
        yield a, b, local, remote
    finally:
        await a.close()
        await b.close()
        for region in (local, remote):
            region.close()
            region.unlink()


@pytest.fixture
async def duo() -> AsyncIterator[tuple[TcpTransport, TcpTransport, MemoryRegion, MemoryRegion]]:
    async with _linked() as linked:
        yield linked


async def test_a_batch_of_256_blocks_is_one_request_and_one_reply(duo, monkeypatch) -> None:
    a, _, local, remote = duo
    answered = []
    real = tcp_server._resolve

    def counting(*args, **kwargs):
        answered.append(args[5])  # the op
        return real(*args, **kwargs)

    monkeypatch.setattr(tcp_server, "_resolve", counting)
    entries = [TransferEntry(i * 4096, remote.region_id, (255 - i) * 4096, 4096) for i in range(256)]

    assert await a.read(local, entries) == 256 * 4096
    assert len(answered) == 1


async def test_the_server_rejects_a_range_its_region_does_not_have_even_if_the_client_thinks_so(
    duo,
) -> None:
    a, _, local, remote = duo
    remote.as_array()[:] = 7
    inflated = replace(a.descriptor(remote.region_id), size=8 * MIB)  # a stale, wrong size
    await a.connect(inflated)

    with pytest.raises(OutOfBoundsError) as info:
        await a.write(
            local,
            [
                TransferEntry(0, remote.region_id, 0, 10),
                TransferEntry(0, remote.region_id, 5 * MIB, 10),
            ],
        )

    assert info.value.size == 4 * MIB
    assert (remote.as_array() == 7).all()
    # The connection survived the error reply: a good batch still works.
    assert await a.write(local, [TransferEntry(0, remote.region_id, 0, 10)]) == 10


async def test_a_deregistered_region_is_unknown_to_the_server_and_others_keep_working(duo) -> None:
    a, b, local, remote = duo
    other = MemoryRegion(_rid("o"), MIB)
    try:
        await a.connect(b.register(other))
        b.deregister(remote.region_id)
        local.as_array()[:] = 1

        with pytest.raises(UnknownRegionError, match=remote.region_id):  # checked as a whole:
            await a.write(
                local,
                [
                    TransferEntry(0, other.region_id, 0, 100),
                    TransferEntry(0, remote.region_id, 0, 100),
                ],
            )
        assert not other.as_array().any()  # the good entry before the bad one did not land
        assert await a.write(local, [TransferEntry(0, other.region_id, 0, 100)]) == 100
        assert other.as_array(0, 100).all()
    finally:
        other.close()
        other.unlink()


async def test_concurrent_batches_pipeline_on_one_connection_and_each_lands_exactly(duo) -> None:
    a, _, local, remote = duo
    remote.as_array()[:] = pattern(remote.size, 3)
    results = {}

    async def one(i: int) -> None:
        entries = [TransferEntry(i * 65536 + j * 4096, remote.region_id, (63 - i) * 65536 + j * 4096, 4096) for j in range(16)]
        results[i] = await a.read(local, entries)

    async with anyio.create_task_group() as tg:
        for i in range(64):
            tg.start_soon(one, i)

    assert all(v == 65536 for v in results.values()) and len(results) == 64
    src, dst = remote.as_array(), local.as_array()
    for i in range(64):
        assert np.array_equal(dst[i * 65536 : (i + 1) * 65536], src[(63 - i) * 65536 : (64 - i) * 65536])


async def test_a_cancelled_read_never_lands_and_leaves_the_connection_usable(duo) -> None:
    a, _, local, remote = duo
    remote.as_array()[:] = pattern(remote.size, 4)
    rid = remote.region_id
    await a.read(local, [TransferEntry(0, rid, 0, 1)])  # dial first: no await before sending
    local.as_array()[:] = 0
    with anyio.move_on_after(0) as scope:  # cancelled once the request is on the wire
        await a.read(local, [TransferEntry(0, rid, 0, 3 * MIB)])
    assert scope.cancelled_caught

    assert await a.read(local, [TransferEntry(3 * MIB, rid, 3 * MIB, MIB)]) == MIB
    assert not local.as_array(0, 3 * MIB).any()  # its reply was drained, not written
    assert np.array_equal(local.as_array(3 * MIB, MIB), remote.as_array(3 * MIB, MIB))


async def test_a_stopped_peer_fails_the_transfer_with_a_timeout_instead_of_hanging() -> None:
    rid = _rid("stopped")
    local = MemoryRegion(_rid("l"), 16 * MIB)
    transport = create_transport("tcp", node_id="initiator", timeout_s=1.0)
    await transport.start()
    peer = spawn_peer("tcp", {rid: 16 * MIB})
    try:
        await transport.connect(peer.descriptors[rid])
        pause(peer.proc.pid)  # stopped for sure: a peer still running could answer the read
        started = anyio.current_time()
        with anyio.fail_after(5), pytest.raises(TransferTimeoutError):
            await transport.read(local, [TransferEntry(0, rid, 0, 16 * MIB)])
        assert anyio.current_time() - started < 3
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
        peer.kill()
        await transport.close()
        local.close()
        local.unlink()


async def test_a_vanished_peer_fails_fast_and_its_restarted_successor_is_reached() -> None:
    rid = _rid("gone")
    local = MemoryRegion(_rid("l"), MIB)
    transport = create_transport("tcp", node_id="initiator", timeout_s=5.0)
    await transport.start()
    try:
        with spawn_peer("tcp", {rid: MIB}) as peer:
            await transport.connect(peer.descriptors[rid])
            assert await transport.read(local, [TransferEntry(0, rid, 0, 10)]) == 10
            peer.kill()
        with anyio.fail_after(3), pytest.raises(PeerLostError):
            await transport.read(local, [TransferEntry(0, rid, 0, 10)])
        await _until_segment_is_gone(rid)  # the dead peer's resource tracker removes it
        with spawn_peer("tcp", {rid: MIB}, seed=9) as again:
            await transport.connect(again.descriptors[rid])  # new address, same region id
            assert await transport.read(local, [TransferEntry(0, rid, 0, MIB)]) == MIB
            assert np.array_equal(local.as_array(), pattern(MIB, 9))
    finally:
        await transport.close()
        local.close()
        local.unlink()


async def _until_segment_is_gone(region_id: str) -> None:
    with anyio.fail_after(5):
        while True:
            try:
                MemoryRegion.attach(region_id).close()
            except UnknownRegionError:
                return
            await anyio.sleep(0.02)


async def test_one_batch_spanning_two_peers_lands_in_both(duo) -> None:
    a, _, local, remote = duo
    c = TcpTransport(node_id="c")
    other = MemoryRegion(_rid("c"), MIB)
    try:
        await c.start()
        await a.connect(c.register(other))
        local.as_array()[:] = pattern(local.size, 8)
        entries = [TransferEntry(i * 8192, (remote if i % 2 else other).region_id, i * 4096, 8192) for i in range(64)]

        assert await a.write(local, entries) == 64 * 8192

        src = local.as_array()
        for e in entries:
            dst = (remote if e.remote_region == remote.region_id else other).as_array()
            expected = src[e.local_offset : e.local_offset + e.length]
            assert np.array_equal(dst[e.remote_offset : e.remote_offset + e.length], expected)
    finally:
        await c.close()
        other.close()
        other.unlink()


async def test_a_large_write_cancelled_mid_payload_lets_go_of_the_region_and_the_next_batch_redials() -> None:
    rid = _rid("stalled")
    local, other = MemoryRegion(_rid("l"), 64 * MIB), MemoryRegion(_rid("o"), 8 * MIB)
    transport = create_transport("tcp", node_id="initiator", timeout_s=10.0)
    await transport.start()
    peer = spawn_peer("tcp", {rid: 64 * MIB})
    try:
        await transport.connect(peer.descriptors[rid])
        assert await transport.read(local, [TransferEntry(0, rid, 0, 10)]) == 10  # dialled
        os.kill(peer.proc.pid, signal.SIGSTOP)  # the peer stops reading: the payload stalls mid-send
        with anyio.fail_after(5):
            with anyio.move_on_after(0.3) as scope:
                await transport.write(local, [TransferEntry(0, rid, 0, 64 * MIB)])
        assert scope.cancelled_caught
        local.close()  # nothing holds its memory any more (RegionInUseError otherwise)
        os.kill(peer.proc.pid, signal.SIGCONT)
        other.as_array()[:] = pattern(other.size, 5)
        assert await transport.write(other, [TransferEntry(0, rid, 0, 8 * MIB)]) == 8 * MIB
        assert await transport.read(other, [TransferEntry(0, rid, 0, 8 * MIB)]) == 8 * MIB
        assert np.array_equal(other.as_array(), pattern(other.size, 5))
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
        peer.kill()
        await transport.close()
        for region in (local, other):
            region.close()
            region.unlink()


def _algorithm(sock) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()


def _available() -> set[str]:
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
            return set(f.read().split())
    except OSError:
        return set()


@pytest.mark.skipif("cubic" not in _available(), reason="the kernel offers no cubic congestion control")
async def test_both_ends_of_a_data_connection_use_cubic_or_reno_by_default_and_the_host_s_when_told(monkeypatch) -> None:
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        host = f.read().strip()
    with open("/proc/sys/net/ipv4/tcp_allowed_congestion_control") as f:
        allowed = f.read().split()
    first = "cubic" if os.geteuid() == 0 or "cubic" in allowed else "reno"  # reno: every process may set it
    for env, want in ((None, first), ("", host)):
        if env is None:
            monkeypatch.delenv("DUALPATH_TCP_CONGESTION", raising=False)
        else:
            monkeypatch.setenv("DUALPATH_TCP_CONGESTION", env)
        async with _linked(MIB) as (a, b, local, remote):
            remote.as_array()[:] = 7
            await a.read(local, [TransferEntry(0, remote.region_id, 0, MIB)])
            assert (local.as_array() == 7).all()
            (conn,) = a._peers.values()
            assert _algorithm(conn.sock) == want  # the dialed end
            assert b._listener is not None and _algorithm(b._listener) == want  # accepted sockets inherit it


async def test_a_congestion_control_the_kernel_refuses_leaves_the_host_s_and_transfers_still_work() -> None:
    from dualpath.transfer import tcp as tcp_module

    sock = socket.socket()
    try:
        before = _algorithm(sock)
        assert tcp_module.set_congestion(sock, "no-such-algorithm") == ""
        assert _algorithm(sock) == before
        assert tcp_module.set_congestion(sock, "") == ""  # "": nothing asked
        assert tcp_module.set_congestion(sock, "no-such-algorithm, reno") == "reno"  # the first the kernel takes
        assert _algorithm(sock) == "reno"
    finally:
        sock.close()
    async with _linked(MIB, congestion="no-such-algorithm") as (a, _, local, remote):
        remote.as_array()[:] = 3
        assert await a.read(local, [TransferEntry(0, remote.region_id, 0, MIB)]) == MIB
        assert (local.as_array() == 3).all()
        (conn,) = a._peers.values()
        assert _algorithm(conn.sock) == before


_entry = st.builds(
    lambda lo, length, count, gap: TransferEntry(lo, "r", 0, length, count, (length + gap) if count > 1 else 0, length),
    st.integers(0, 200),
    st.integers(0, 9),
    st.integers(1, 4),
    st.integers(0, 3),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_entry, max_size=8), st.booleans())
def test_local_views_are_the_entries_pieces_in_order_merged_where_adjacent(entries: list[TransferEntry], chain: bool) -> None:
    """What a batch moves locally, against the definition: every piece of every entry in
    order (``TransferEntry.pieces``), empty ones left out, one view wherever a piece starts
    where the previous one ended."""
    if chain:  # each entry starts where the one before ended: the views must merge
        at, chained = 0, []
        for e in entries:
            chained.append(replace(e, local_offset=at))
            at = e.local_end - e.local_offset + at
        entries = chained
    buf = memoryview(bytearray(1024))
    base = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    expected: list[list[int]] = []
    for e in entries:
        for lo, _, n in e.pieces():
            if not n:
                continue
            if expected and expected[-1][1] == lo:
                expected[-1][1] = lo + n
            else:
                expected.append([lo, lo + n])
    got = []
    for view in local_views(buf, entries):
        start = np.frombuffer(view, dtype=np.uint8).ctypes.data - base
        got.append([start, start + view.nbytes])
    assert got == expected
