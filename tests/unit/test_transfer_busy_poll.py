"""Adaptive busy polling of the tcp transport: the window's learning rule, the env knob;
against a real peer process, that back-to-back batches complete while the initiator polls
(not through an event-loop wake-up); that a served connection used every few milliseconds
stops spinning; and that two transports of one process never spin against each other."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid

import anyio
import pytest

from dualpath.transfer import MemoryRegion, TransferEntry, tcp_conn, tcp_server
from dualpath.transfer.busy_poll import ENV, BusyPoll, busy_poll_default
from dualpath.transfer.peer import spawn_peer
from dualpath.transfer.tcp import TcpTransport
from dualpath.transfer.tcp_wire import REPLY, Op, encode_request
from tests.unit.test_transfer_tcp import duo  # noqa: F401  (the fixture: two transports of this process)

KIB = 1 << 10


def test_a_wake_up_soon_after_a_missed_spin_doubles_the_window_up_to_the_max() -> None:
    poll = BusyPoll(max_us=200, start_us=10)
    poll.window_s = 0.0
    for expected_us in (10, 20, 40, 80, 160, 200, 200):
        poll.missed(1.0)
        poll.woke(1.0 + 50e-6)  # the bytes came 50 us after the wait began: a spin would have caught them
        assert poll.window_s == pytest.approx(expected_us / 1e6)


def test_a_wake_up_later_than_the_max_halves_the_window_and_a_quiet_connection_stops_spinning() -> None:
    poll = BusyPoll(max_us=200, start_us=10)
    seen = []
    for _ in range(6):
        poll.missed(1.0)
        poll.woke(1.01)  # 10 ms later: no spin of <= 200 us would have caught it
        seen.append(round(poll.window_s * 1e6, 3))
    assert seen == [100, 50, 25, 12.5, 0, 0]
    assert not poll.enabled


def test_a_caught_spin_keeps_the_window_and_a_wake_up_without_a_wait_teaches_nothing() -> None:
    poll = BusyPoll(max_us=200, start_us=10)
    poll.window_s = 40e-6
    poll.caught()
    poll.woke(5.0)  # not waiting: no lesson
    assert poll.window_s == pytest.approx(40e-6)


def test_max_zero_never_spins_and_bad_windows_are_refused() -> None:
    poll = BusyPoll(max_us=0)
    poll.missed(1.0)
    poll.woke(1.0 + 1e-6)
    assert not poll.enabled
    with pytest.raises(ValueError):
        BusyPoll(max_us=-1)
    with pytest.raises(ValueError):
        BusyPoll(max_us=100, start_us=0)


def test_the_env_knob_sets_the_default_and_rejects_nonsense(monkeypatch) -> None:
    monkeypatch.setenv(ENV, "75")
    assert busy_poll_default() == 75.0
    assert TcpTransport(node_id="x").busy_poll_us == 75.0
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match=ENV):
        busy_poll_default()
    monkeypatch.setenv(ENV, "-5")
    with pytest.raises(ValueError, match=ENV):
        busy_poll_default()
    with pytest.raises(ValueError):
        TcpTransport(node_id="x", busy_poll_us=-1)


async def _reads_through_the_loop(busy_poll_us: float, batches: int) -> int:
    """Read ``batches`` 4 KiB blocks, one at a time, from a real peer process; how many
    replies the event loop delivered (a wake-up, not a spin)."""
    rid = f"test-busy-{uuid.uuid4().hex[:10]}"
    peer = spawn_peer("tcp", {rid: 1 << 20}, node_id="busy-peer")
    transport = TcpTransport(node_id="busy", busy_poll_us=busy_poll_us)
    local = MemoryRegion(f"{rid}-local", 1 << 20)
    woken = 0
    real = tcp_conn.PeerConnection._on_loop_readable

    def counting(self: tcp_conn.PeerConnection) -> None:
        nonlocal woken
        woken += 1
        real(self)

    try:
        await transport.start()
        await transport.connect(peer.descriptors[rid])
        tcp_conn.PeerConnection._on_loop_readable = counting  # type: ignore[method-assign]
        for i in range(batches):
            await transport.read(local, [TransferEntry(0, rid, (i % 16) * 4 * KIB, 4 * KIB)])
    finally:
        tcp_conn.PeerConnection._on_loop_readable = real  # type: ignore[method-assign]
        await transport.close()
        peer.stop()
        local.close()
        local.unlink()
    return woken


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_back_to_back_batches_from_a_peer_process_complete_while_polling(anyio_backend) -> None:
    # A generous window so a loaded host's scheduling delays still fall inside it.
    polled = await _reads_through_the_loop(5000, 200)
    plain = await _reads_through_the_loop(0, 50)
    assert plain >= 50  # without polling every reply wakes the loop
    assert polled < 100, f"{polled} of 200 replies came through an event-loop wake-up"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_served_connection_whose_requests_come_every_10_ms_stops_spinning(anyio_backend) -> None:
    rid = f"test-busy-srv-{uuid.uuid4().hex[:10]}"
    region = MemoryRegion(rid, 1 << 20)
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    conn = tcp_server._Connection(ours, lambda r: region if r == rid else None, "srv", asyncio.get_running_loop(), BusyPoll(250))
    frame = encode_request(Op.READ, 0, 1, [TransferEntry(0, rid, 0, 4 * KIB)], 0, {rid: region.key})
    windows = []

    def client() -> None:  # a plain blocking peer in a thread: the loop is free meanwhile
        for _ in range(8):
            theirs.sendall(frame)
            got = 0
            while got < REPLY.size + 4 * KIB:
                got += len(theirs.recv(1 << 16))
            time.sleep(0.01)
            windows.append(conn.poll.window_s)

    try:
        conn.start()
        await anyio.to_thread.run_sync(client)
    finally:
        conn.close()
        theirs.close()
        region.close()
        region.unlink()
    assert windows[0] == pytest.approx(250e-6)  # the first wait teaches nothing yet
    assert windows[-1] == 0.0, windows  # halved at every 10 ms gap, then off


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_two_transports_of_one_process_do_not_spin_against_each_other(anyio_backend, duo) -> None:  # noqa: F811
    a, _, local, remote = duo
    for _ in range(5):
        await a.read(local, [TransferEntry(0, remote.region_id, 0, 4 * KIB)])
    (conn,) = a._peers.values()
    assert a.busy_poll_us > 0
    assert not conn.poll.enabled  # a spin here would hold the loop the server needs


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_spin_that_finds_nothing_yields_the_cpu_between_polls(anyio_backend, monkeypatch) -> None:
    """On a host with fewer free cores than runnable processes, the peer may need this core to answer."""
    yields = []
    monkeypatch.setattr(tcp_conn, "yield_cpu", lambda: yields.append(1))
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    try:
        conn = tcp_conn.PeerConnection(ours, "silent-peer", busy_poll_us=500)
        never: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        conn.spin(never)  # nothing ever arrives: the whole window is spent polling
        assert not never.done() and len(yields) > 1
    finally:
        ours.close()
        theirs.close()
