"""What the emulated NICs charge: completion (the last chunk too), full duplex, both ends of a
hop, loopback on both directions, and one link shared by several processes."""

from __future__ import annotations

import gc
import sys
import time
import uuid

import anyio
import pytest

from dualpath.transfer import (
    DuplexNic,
    EmulatedNic,
    MemoryRegion,
    TrafficClass,
    TransferEntry,
    create_transport,
)
from dualpath.transfer.nic import NicDirectory

pytestmark = pytest.mark.anyio

MB = 1_000_000
RATE = 20 * MB  # 1 MB takes 50 ms


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def shm_pair():
    """Two shm transports (an engine and a buffer on one host) and a region each."""
    tag = uuid.uuid4().hex[:10]
    engine = create_transport("shm", node_id="n0")
    buffer = create_transport("shm", node_id="n1")
    local = MemoryRegion(f"test-duplex-l-{tag}", 4 * MB)
    remote = MemoryRegion(f"test-duplex-r-{tag}", 4 * MB)
    try:
        engine.register(local)
        await engine.connect(buffer.register(remote))
        yield engine, local, remote.region_id
    finally:
        await engine.close()
        await buffer.close()
        for region in (local, remote):
            region.close()
            region.unlink()


async def test_a_transfer_on_an_idle_link_takes_its_bytes_over_the_rate_last_chunk_included(shm_pair) -> None:
    engine, local, rid = shm_pair
    engine.nic = DuplexNic.create(RATE, name="cnic", chunk_bytes=256 * 1024)
    nbytes = 2 * MB  # 8 chunks of 256 KiB: the last one is ~13 ms of link time
    t0 = time.monotonic()
    await engine.read(local, [TransferEntry(0, rid, 0, nbytes)])
    elapsed = time.monotonic() - t0
    assert elapsed >= nbytes / RATE * 0.99, elapsed  # completion, not the last chunk's start
    # and no more link time than that, on the link's own timeline (from its first grant: the
    # host's delay before the first chunk is enqueued is not link time)
    assert engine.nic.rx.busy_until - engine.nic.rx._grants[0][0] <= nbytes / RATE * 1.1


async def test_reads_and_writes_on_one_full_duplex_nic_each_get_the_whole_rate(shm_pair) -> None:
    engine, local, rid = shm_pair
    nic = engine.nic = DuplexNic.create(RATE, name="cnic")
    nbytes = 2 * MB
    gc.collect()  # a collection between the two starts (a large heap late in a full run) would stretch the timeline
    t0 = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.read, local, [TransferEntry(0, rid, 0, nbytes)])
        tg.start_soon(engine.write, local, [TransferEntry(nbytes, rid, nbytes, nbytes)])
    # On the links' own timeline (which a slow host does not stretch): both end together,
    # one transfer's time after the first chunk started, not two.
    first = min(nic.rx._grants[0][0], nic.tx._grants[0][0])
    assert max(nic.rx.busy_until, nic.tx.busy_until) - first <= nbytes / RATE * 1.3
    assert time.monotonic() - t0 >= nbytes / RATE * 0.98
    assert nic.rx.bytes_sent(TrafficClass.KV) == nbytes and nic.tx.bytes_sent(TrafficClass.KV) == nbytes


async def test_the_same_pair_on_one_half_duplex_link_takes_twice_as_long(shm_pair) -> None:
    """The check above can fail: a shared link serialises the two directions."""
    engine, local, rid = shm_pair
    engine.nic = EmulatedNic(RATE, name="cnic")
    nbytes = 2 * MB
    t0 = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.read, local, [TransferEntry(0, rid, 0, nbytes)])
        tg.start_soon(engine.write, local, [TransferEntry(nbytes, rid, nbytes, nbytes)])
    assert time.monotonic() - t0 >= 2 * nbytes / RATE * 0.98


async def test_a_hop_is_charged_at_both_ends_and_waits_for_the_busier_one(shm_pair) -> None:
    engine, local, rid = shm_pair
    engine.nic = DuplexNic.create(RATE, name="pe-cnic")
    peer = DuplexNic.create(RATE, name="de-cnic")
    # The peer's tx is busy for 100 ms with someone else's bytes: our read waits for it.
    async with anyio.create_task_group() as tg:
        tg.start_soon(peer.tx.send, 2 * MB)
        await anyio.sleep(0.005)
        t0 = time.monotonic()
        await engine.read(local, [TransferEntry(0, rid, 0, MB)], peer_nic=peer)
        elapsed = time.monotonic() - t0
    assert elapsed >= (3 * MB / RATE - 0.005) * 0.98, elapsed
    assert engine.nic.rx.bytes_sent(TrafficClass.KV) == MB
    assert peer.tx.bytes_sent(TrafficClass.KV) == 3 * MB and peer.rx.bytes_sent(TrafficClass.KV) == 0
    await engine.write(local, [TransferEntry(0, rid, 0, MB)], peer_nic=peer)
    assert engine.nic.tx.bytes_sent(TrafficClass.KV) == MB and peer.rx.bytes_sent(TrafficClass.KV) == MB


async def test_a_loopback_copy_occupies_both_directions_of_its_nic(shm_pair) -> None:
    engine, local, rid = shm_pair
    nic = engine.nic = DuplexNic.create(RATE, name="cnic")
    await engine.read(local, [TransferEntry(0, rid, 0, MB)], peer_nic=nic)  # an H2D through the GPU's own CNIC
    assert nic.rx.bytes_sent(TrafficClass.KV) == MB and nic.tx.bytes_sent(TrafficClass.KV) == MB


_CHILD = """
import asyncio, sys
from dualpath.transfer import EmulatedNic
async def main():
    link = EmulatedNic.attach(sys.argv[1])
    for _ in range(10):
        await link.send(100_000)
asyncio.run(main())
"""


async def test_a_shared_link_paces_two_processes_together() -> None:
    """Another process attaches to the link by its key: the two share its rate."""
    key = f"test-link-{uuid.uuid4().hex[:10]}"
    link = EmulatedNic(RATE, name="shared", shared=key)
    try:
        t0 = time.monotonic()
        async with await anyio.open_process([sys.executable, "-c", _CHILD, key]) as child:
            for _ in range(10):
                await link.send(100_000)
            assert await child.wait() == 0
        assert link.bytes_sent(TrafficClass.KV) == 2 * MB  # the child's megabyte counted here too
        assert link.busy_seconds == pytest.approx(2 * MB / RATE)
        assert time.monotonic() - t0 >= 2 * MB / RATE * 0.98
    finally:
        link.close()
    with pytest.raises(FileNotFoundError):
        EmulatedNic.attach(key)


async def test_an_engine_data_plane_charges_the_decode_gpus_cnic_for_its_buffer_and_its_own_for_its_node() -> None:
    """The testbed's hops: PE buffer -> PE (loopback on the PE's CNIC), DE buffer -> PE and
    PE -> DE buffer (the PE's CNIC and the DE GPU's, found by name across processes)."""
    from dualpath.engine.dataplane import EngineDataPlane
    from dualpath.testbed.profile import HardwareProfile, cnic_prefix

    ns = f"t{uuid.uuid4().hex[:8]}"
    profile = HardwareProfile(scale=1000.0)  # 50 MB/s CNICs
    pe_nic, de_nic = profile.cnic(ns, "pe0"), profile.cnic(ns, "de0")
    local = create_transport("shm", node_id="p0", nic=pe_nic)
    remote = create_transport("tcp", node_id="p0", nic=pe_nic)
    window = MemoryRegion(f"{ns}-win", 4 * MB)
    pe_buf, de_buf = MemoryRegion(f"{ns}-p0-buf", 4 * MB), MemoryRegion(f"{ns}-d0-buf", 4 * MB)
    dp = EngineDataPlane(node_id="p0", region=window, local=local, remote=remote, peers=NicDirectory(cnic_prefix(ns)), same_host=True)
    try:
        await remote.start()
        for region, node in ((pe_buf, "p0"), (de_buf, "d0")):
            desc = create_transport("shm", node_id=node).register(region)
            entries = [TransferEntry(0, region.region_id, 0, MB)]
            await dp.read(desc, entries, peer_engine="de0")
            await dp.write(desc, entries, peer_engine="de0")
        kv = TrafficClass.KV
        # own node's buffer: a loopback read and write (both directions of the PE's CNIC);
        # then the DE buffer: PE rx + DE tx for the read, PE tx + DE rx for the write
        assert (pe_nic.rx.bytes_sent(kv), pe_nic.tx.bytes_sent(kv)) == (3 * MB, 3 * MB)
        assert (de_nic.rx.bytes_sent(kv), de_nic.tx.bytes_sent(kv)) == (MB, MB)
        assert isinstance(await dp.transport_for(desc), type(local))  # shared memory for every same-host hop
    finally:
        await dp.close()
        for region in (pe_buf, de_buf):
            region.close()
            region.unlink()
        pe_nic.close()
        de_nic.close()


async def test_the_host_transport_does_not_change_the_modeled_time_of_a_transfer() -> None:
    """The same 2 MB read over tcp and over shared memory: the same link time, and each takes
    at least that long (the host copy hides inside the modeled time)."""
    tag = uuid.uuid4().hex[:10]
    local = MemoryRegion(f"test-host-l-{tag}", 4 * MB)
    remote = MemoryRegion(f"test-host-r-{tag}", 4 * MB)
    timeline = {}
    try:
        for kind in ("tcp", "shm"):
            nic = DuplexNic.create(RATE, name=f"cnic-{kind}")
            engine, buffer = create_transport(kind, node_id="n0", nic=nic), create_transport(kind, node_id="n1")
            try:
                await engine.start()
                await buffer.start()
                await engine.connect(buffer.register(remote))
                t0 = time.monotonic()
                await engine.read(local, [TransferEntry(0, remote.region_id, 0, 2 * MB)])
                elapsed = time.monotonic() - t0
            finally:
                await engine.close()
                await buffer.close()
            first = nic.rx._grants[0][0]
            timeline[kind] = nic.rx.busy_until - first
            assert nic.rx.busy_seconds == pytest.approx(2 * MB / RATE)
            assert elapsed >= 2 * MB / RATE * 0.98, (kind, elapsed)
    finally:
        for region in (local, remote):
            region.close()
            region.unlink()
    assert timeline["tcp"] == pytest.approx(timeline["shm"], rel=0.1), timeline


_FIFO_CHILD = """
import asyncio, sys, time
from dualpath.transfer import EmulatedNic
async def main():
    link = EmulatedNic.attach(sys.argv[1])
    waits = []
    for _ in range(5):
        t0 = time.monotonic()
        await link.send(10_000)
        waits.append(time.monotonic() - t0)
    print(min(waits), max(waits))
asyncio.run(main())
"""


async def test_a_shared_link_serves_another_process_first_come_first_served_beside_a_backlog() -> None:
    """The owner keeps eight 50 KB jobs (2.5 ms each) queued at all times; another process's
    jobs wait their turn behind the jobs queued before them: neither ahead of them nor until
    the backlog ends."""
    key = f"test-fifo-{uuid.uuid4().hex[:10]}"
    link = EmulatedNic(RATE, name="shared", shared=key, chunk_bytes=50_000)
    try:

        async def backlog() -> None:
            while True:
                await link.send(50_000)

        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(backlog)
            result = await anyio.run_process([sys.executable, "-c", _FIFO_CHILD, key])
            tg.cancel_scope.cancel()
        shortest, longest = map(float, result.stdout.split())
        assert shortest >= 0.010, shortest  # it never jumps the ~7 jobs (17 ms) queued before it
        # nor waits for the backlog to end (it never ends: a wait for it would hang the child);
        # 3 s leaves room for a stalled shared host
        assert longest < 3.0, longest
    finally:
        link.close()
