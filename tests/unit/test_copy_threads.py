"""The copy threads behind large same-node batches: results and errors come back to the
caller, copies run off the event loop, and a cancelled caller waits for its copy to end."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator

import numpy as np
import pytest

from dualpath.transfer import MemoryRegion, TransferEntry
from dualpath.transfer import shm as shm_module
from dualpath.transfer.copy_threads import THREADS, run_copy, submit_copy, wait_copy
from dualpath.transfer.shm import ShmTransport

pytestmark = pytest.mark.anyio

MIB = 1 << 20


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.asynccontextmanager
async def _shm_pair(size: int, seed: int) -> AsyncIterator[tuple[ShmTransport, MemoryRegion, MemoryRegion]]:
    """A transport with 1 MiB ``thread_copy_bytes``, a random ``src`` region it serves and a
    zeroed ``dst`` of ``size`` bytes; closed and unlinked after."""
    tag = uuid.uuid4().hex[:8]
    src = MemoryRegion(f"ct-src-{tag}", size)
    dst = MemoryRegion(f"ct-dst-{tag}", size)
    transport = ShmTransport(node_id="n", thread_copy_bytes=MIB)
    try:
        src.as_array()[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        dst.as_array()[:] = 0
        await transport.connect(transport.register(src))
        yield transport, src, dst
    finally:
        await transport.close()
        for region in (src, dst):
            region.close()
            region.unlink()


async def test_a_copy_runs_in_another_thread_and_returns_its_result() -> None:
    here = threading.get_ident()
    ident, name = await run_copy(lambda: (threading.get_ident(), threading.current_thread().name))
    assert ident != here
    assert name.startswith("dualpath-copy-")


async def test_an_exception_in_the_copy_is_raised_in_the_caller() -> None:
    def fail() -> None:
        raise OSError("disk on fire")

    with pytest.raises(OSError, match="disk on fire"):
        await run_copy(fail)
    assert await run_copy(lambda x: x + 1, 41) == 42  # the thread survives a failed job


async def test_the_event_loop_keeps_running_while_a_copy_holds_its_thread() -> None:
    started = threading.Event()

    def slow() -> str:
        started.set()
        time.sleep(0.3)
        return "done"

    job = asyncio.ensure_future(run_copy(slow))
    ticks = 0
    while not job.done():
        await asyncio.sleep(0.01)
        ticks += 1
    assert started.is_set() and job.result() == "done"
    assert ticks >= 10  # the loop ran on while the thread slept


async def test_a_cancelled_caller_returns_only_after_its_copy_has_ended() -> None:
    ended: list[float] = []

    def slow() -> None:
        time.sleep(0.2)
        ended.append(time.monotonic())

    job = asyncio.ensure_future(run_copy(slow))
    await asyncio.sleep(0.05)
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await job
    assert ended, "the caller saw its cancellation before the copy had finished writing"
    assert ended[0] <= time.monotonic()


async def test_concurrent_copies_run_on_several_threads_at_once() -> None:
    if THREADS < 2:
        pytest.skip("one copy thread on a one-core host")
    barrier = threading.Barrier(2, timeout=5)

    def meet() -> int:
        barrier.wait()  # only returns once two jobs run at the same time
        return threading.get_ident()

    a, b = await asyncio.gather(run_copy(meet), run_copy(meet))
    assert a != b


async def test_a_forked_child_starts_its_own_copy_threads() -> None:
    await run_copy(lambda: None)  # the parent's threads exist
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the parent's threads are gone, so the copy needs new ones
        try:
            out: list[bytes] = []  # a loop of its own, in a thread (this one still has the parent's running)
            child = threading.Thread(target=lambda: out.append(asyncio.run(asyncio.wait_for(run_copy(lambda: b"ok"), 5))))
            child.start()
            child.join()
            os.write(write, out[0] if out else b"no")
        finally:
            os._exit(0)
    os.close(write)
    try:
        got = os.read(read, 2)
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert got == b"ok"


async def test_a_large_shm_batch_lands_every_scattered_entry_through_the_copy_threads() -> None:
    async with _shm_pair(8 * MIB, seed=1) as (transport, src, dst):
        block = 64 * 1024
        order = [(i * 37) % 64 for i in range(64)]  # every remote block once, out of order
        entries = [TransferEntry(i * block, src.region_id, j * block, block) for i, j in enumerate(order)]
        assert await transport.read(dst, entries) == 64 * block
        d, s = dst.as_array(), src.as_array()
        for i, j in enumerate(order):
            assert np.array_equal(d[i * block : (i + 1) * block], s[j * block : (j + 1) * block])
        assert not d[64 * block :].any()  # nothing past the batch
        del d, s


def _bytes_of(entries: list[TransferEntry]) -> list[tuple[int, int]]:
    """Every (local byte, remote byte) pair the entries move, in order."""
    out = []
    for e in entries:
        for lo, ro, n in e.pieces():
            out += [(lo + k, ro + k) for k in range(n)]
    return out


def test_a_split_batch_moves_the_same_bytes_with_the_share_in_its_head() -> None:
    entries = [
        TransferEntry(0, "r", 1000, 300),
        TransferEntry(5000, "r", 0, 100, count=4, local_stride=200, remote_stride=150),
        TransferEntry(9000, "r", 7000, 50),
    ]
    whole = _bytes_of(entries)
    # a contiguous entry splits at the byte; a strided one (4 pieces of 100) only between pieces
    expected_head = {0: 0, 1: 1, 299: 299, 300: 300, 301: 300, 450: 400, 700: 700, 720: 720, 750: 750, 10_000: 750}
    for share, head_bytes in expected_head.items():
        head, rest = shm_module._split(entries, share)
        assert _bytes_of(head) + _bytes_of(rest) == whole
        assert sum(e.nbytes for e in head) == head_bytes


@pytest.mark.parametrize("strided", [False, True])
async def test_a_large_batch_of_large_pieces_lands_exactly_when_the_loop_shares_the_copy(strided: bool) -> None:
    async with _shm_pair(16 * MIB, seed=2) as (transport, src, dst):
        piece = 256 * 1024
        if strided:  # one layer's blocks: pieces a block apart on both sides
            entries = [TransferEntry(0, src.region_id, 3 * MIB, piece, count=8, local_stride=2 * piece, remote_stride=3 * piece)]
        else:
            entries = [TransferEntry(i * piece, src.region_id, ((i * 5) % 8) * piece + 8 * MIB, piece) for i in range(8)]
        assert sum(e.nbytes for e in entries) >= MIB  # the shared path (pieces of 256 KiB)
        assert await transport.read(dst, entries) == 8 * piece
        expect = np.zeros(16 * MIB, dtype=np.uint8)
        s = src.as_array()
        for e in entries:
            for lo, ro, n in e.pieces():
                expect[lo : lo + n] = s[ro : ro + n]
        assert np.array_equal(dst.as_array(), expect)  # every piece, and nothing else
        # and back: a write of the same entries puts the bytes where they came from
        src.as_array()[:] = 0
        assert await transport.write(dst, entries) == 8 * piece
        d = dst.as_array()
        for e in entries:
            for lo, ro, n in e.pieces():
                assert np.array_equal(s[ro : ro + n], d[lo : lo + n])
        del s, d, expect


async def test_a_region_can_be_closed_as_soon_as_a_threaded_batch_returns() -> None:
    transport = ShmTransport(node_id="n", thread_copy_bytes=MIB)
    tag = uuid.uuid4().hex[:8]
    src = MemoryRegion(f"ct-src-{tag}", 4 * MIB)
    try:
        await transport.connect(transport.register(src))
        for i in range(20):  # the copy thread must have dropped the batch's views by the time it returns
            dst = MemoryRegion(f"ct-dst-{tag}-{i}", 4 * MIB)
            try:
                entries = [TransferEntry(k * 64 * 1024, src.region_id, k * 64 * 1024, 64 * 1024) for k in range(32)]
                assert await transport.read(dst, entries) == 2 * MIB
            finally:
                dst.close()  # raises RegionInUseError if a view were still alive anywhere
                dst.unlink()
    finally:
        await transport.close()
        src.close()
        src.unlink()


async def test_a_batch_queued_behind_busy_threads_survives_its_region_being_recreated_smaller() -> None:
    """The batch was checked against the region as it was; a reconnect to a smaller re-created
    segment while it waits for a thread must not make the copy reach outside any mapping."""
    rid = f"ct-re-{uuid.uuid4().hex[:8]}"
    first_owner, second_owner, me = ShmTransport(node_id="a"), ShmTransport(node_id="a2"), ShmTransport(node_id="b")
    big = MemoryRegion(rid, 64 * MIB)
    local = MemoryRegion(f"ct-l-{uuid.uuid4().hex[:8]}", 64 * MIB)
    small: MemoryRegion | None = None
    blockers = [submit_copy(time.sleep, 0.3) for _ in range(THREADS)]  # the batch waits in the queue
    try:
        big.as_array()[32 * MIB :] = 7
        await me.connect(first_owner.register(big))
        entries = [TransferEntry(i * 65536, rid, 32 * MIB + i * 65536, 65536) for i in range(256)]
        batch = asyncio.ensure_future(me.read(local, entries))
        await asyncio.sleep(0.05)
        big.close()
        big.unlink()
        small = MemoryRegion(rid, 4096)  # the owner re-created it, smaller
        await me.connect(second_owner.register(small))
        assert await batch == 16 * MIB  # read from the mapping it was checked against
        assert (local.as_array()[: 16 * MIB] == 7).all()
    finally:
        for b in blockers:
            await wait_copy(b)
        await me.close()
        for region in (small, local):
            if region is not None:
                region.close()
                region.unlink()
