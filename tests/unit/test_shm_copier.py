"""The shm transport's batch copier (``dualpath.transfer._copier``, C) against the Python path it
replaces where it is built: the same bytes for every kind of entry, the same errors with nothing
moved, each piece copied once however many threads share a batch, and no thread touching a
region once the batch has let go of it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest

from dualpath.transfer import MemoryRegion, TransferEntry
from dualpath.transfer import shm as shm_module
from dualpath.transfer.errors import OutOfBoundsError, RegionInUseError, UnknownRegionError
from dualpath.transfer.shm import ShmTransport

pytestmark = pytest.mark.anyio

KIB, MIB = 1 << 10, 1 << 20
NATIVE = shm_module._copier
needs_native = pytest.mark.skipif(
    NATIVE is None, reason="the C copier is not built (dualpath compiled build; DUALPATH_COMPILED=0 turns it off)"
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["native", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test on the C copier and on the Python copies it replaces."""
    if request.param == "native" and NATIVE is None:
        pytest.skip("the C copier is not built (dualpath compiled build)")
    if request.param == "python":
        monkeypatch.setattr(shm_module, "_copier", None)
    return request.param


@contextlib.contextmanager
def _regions(*sizes: int) -> Iterator[list[MemoryRegion]]:
    tag = uuid.uuid4().hex[:8]
    regions = [MemoryRegion(f"cp-{tag}-{i}", size) for i, size in enumerate(sizes)]
    try:
        yield regions
    finally:
        for region in regions:
            region.close()
            region.unlink()


@contextlib.asynccontextmanager
async def _served(*sizes: int, seed: int = 0) -> AsyncIterator[tuple[ShmTransport, list[MemoryRegion], MemoryRegion]]:
    """A transport (1 MiB ``thread_copy_bytes``) serving random regions of ``sizes``, and a
    zeroed local region of 16 MiB."""
    rng = np.random.default_rng(seed)
    transport = ShmTransport(node_id="n", thread_copy_bytes=MIB)
    with _regions(16 * MIB, *sizes) as (local, *remotes):
        try:
            for region in remotes:
                region.as_array()[:] = rng.integers(0, 256, region.size, dtype=np.uint8)
                await transport.connect(transport.register(region))
            local.as_array()[:] = 0
            yield transport, remotes, local
        finally:
            await transport.close()


def _expected(local: np.ndarray, remotes: dict[str, np.ndarray], entries: list[TransferEntry], read: bool) -> None:
    """Apply ``entries`` piece by piece with numpy (the reference)."""
    for e in entries:
        for lo, ro, n in e.pieces():
            r = remotes[e.remote_region]
            if read:
                local[lo : lo + n] = r[ro : ro + n]
            else:
                r[ro : ro + n] = local[lo : lo + n]


def _mixed(remotes: list[MemoryRegion], scale: int) -> list[TransferEntry]:
    """Contiguous pieces of several sizes, strided ones, a zero-length one and two regions,
    scattered in both regions; ``scale`` multiplies the pieces (below or above the threaded
    size)."""
    a, b = remotes[0].region_id, remotes[1].region_id
    k = KIB * scale
    return [
        TransferEntry(0, a, 5 * k, 4 * k),
        TransferEntry(64 * k, b, 0, 3 * k + 7),
        TransferEntry(128 * k, a, 200 * k, k, count=5, local_stride=2 * k, remote_stride=3 * k),
        TransferEntry(300 * k, a, 0, 0),
        TransferEntry(320 * k + 1, b, 50 * k + 3, 17 * k, count=3, local_stride=17 * k, remote_stride=40 * k),
        TransferEntry(500 * k, a, 700 * k, 150 * k),
    ]


@pytest.mark.parametrize("scale", [1, 8])  # 0.4 MiB: copied in the loop; 3.3 MiB: shared with a copy thread
@pytest.mark.parametrize("read", [True, False])
async def test_every_kind_of_entry_moves_the_same_bytes_on_both_paths(path: str, scale: int, read: bool) -> None:
    async with _served(8 * MIB, 8 * MIB, seed=scale) as (transport, remotes, local):
        local.as_array()[:] = np.random.default_rng(99).integers(0, 256, local.size, dtype=np.uint8)
        entries = _mixed(remotes, scale)
        want_local = local.as_array().copy()
        want_remotes = {r.region_id: r.as_array().copy() for r in remotes}
        _expected(want_local, want_remotes, entries, read)
        moved = await (transport.read if read else transport.write)(local, entries)
        assert moved == sum(e.nbytes for e in entries)
        assert np.array_equal(local.as_array(), want_local)  # every piece, and nothing else
        for r in remotes:
            assert np.array_equal(r.as_array(), want_remotes[r.region_id])


def _bad_batches(remote: str) -> list[tuple[list[TransferEntry], type[Exception]]]:
    good = TransferEntry(0, remote, 0, 2 * MIB)  # a threaded batch but for its bad entry
    return [
        ([good, TransferEntry(16 * MIB - 10, remote, 0, 11)], OutOfBoundsError),  # past the local region
        ([good, TransferEntry(0, remote, 4 * MIB - 10, 11)], OutOfBoundsError),  # past the remote one
        ([good, TransferEntry(0, remote, 0, 64, count=4, local_stride=64, remote_stride=2 * MIB)], OutOfBoundsError),
        ([good, TransferEntry(-1, remote, 0, 8)], OutOfBoundsError),
        ([good, TransferEntry(0, "never-connected", 0, 8)], UnknownRegionError),
        ([good, TransferEntry(0, remote, 0, -8)], ValueError),
        ([good, TransferEntry(0, remote, 0, 64, count=2, local_stride=32, remote_stride=64)], ValueError),  # overlapping pieces
        ([good, TransferEntry(0, remote, 0, 64, count=0)], ValueError),
    ]


async def test_a_bad_entry_raises_what_every_transport_raises_and_moves_nothing(path: str) -> None:
    async with _served(4 * MIB) as (transport, remotes, local):
        for entries, error in _bad_batches(remotes[0].region_id):
            with pytest.raises(error):
                await transport.read(local, entries)
            assert not local.as_array().any()  # the good entry before it did not land either


async def test_the_errors_are_the_python_paths_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Type and message: a caller cannot tell which path refused the batch."""
    if NATIVE is None:
        pytest.skip("the C copier is not built (dualpath compiled build)")
    async with _served(4 * MIB) as (transport, remotes, local):
        for entries, _ in _bad_batches(remotes[0].region_id):
            errors = []
            for copier in (NATIVE, None):
                monkeypatch.setattr(shm_module, "_copier", copier)
                with pytest.raises(Exception) as info:
                    await transport.read(local, entries)
                errors.append((type(info.value), str(info.value)))
            assert errors[0] == errors[1]


async def test_a_batch_may_name_many_remote_regions(path: str) -> None:
    async with _served(*[64 * KIB] * 12) as (transport, remotes, local):
        entries = [TransferEntry(i * 64 * KIB, r.region_id, 0, 64 * KIB) for i, r in enumerate(remotes)] * 2
        assert await transport.read(local, entries) == 24 * 64 * KIB
        for i, r in enumerate(remotes):
            assert np.array_equal(local.as_array()[i * 64 * KIB : (i + 1) * 64 * KIB], r.as_array())


@needs_native
def test_threads_sharing_a_job_copy_every_piece_exactly_once() -> None:
    with _regions(32 * MIB, 32 * MIB) as (src, dst):
        src.as_array()[:] = np.random.default_rng(5).integers(0, 256, src.size, dtype=np.uint8)
        entries = [TransferEntry(i * 4 * KIB, src.region_id, ((i * 7919) % 4096) * 4 * KIB, 4 * KIB) for i in range(4096)]
        job = NATIVE.Job(entries, dst.buf, lambda rid: (src.buf, src.size), True, 64 * KIB)
        assert (job.total, job.pieces) == (16 * MIB, 4096)
        counts: list[int] = []
        start = threading.Barrier(4)

        def work() -> None:
            start.wait()
            counts.append(job.copy())

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(counts) == 16 * MIB  # no piece twice, none left out
        assert job.claimed and job.done and job.wait(0.0)
        d, s = dst.as_array(), src.as_array()
        for e in entries:
            assert np.array_equal(d[e.local_offset : e.local_offset + e.length], s[e.remote_offset : e.remote_offset + e.length])
        del d, s
        job.release()


@needs_native
def test_a_budget_stops_a_copy_and_another_call_finishes_it() -> None:
    with _regions(4 * MIB, 4 * MIB) as (src, dst):
        src.as_array()[:] = 3
        job = NATIVE.Job([TransferEntry(0, src.region_id, 0, 4 * MIB)], dst.buf, lambda rid: (src.buf, src.size), True, 128 * KIB)
        assert job.copy(MIB) == MIB  # whole pieces until the budget is reached
        assert not job.claimed and not job.done and not job.wait(0.001)
        assert job.copy() == 3 * MIB
        assert job.done and (dst.as_array() == 3).all()
        job.release()


@needs_native
def test_a_job_holds_its_regions_until_released_and_copies_nothing_after() -> None:
    with _regions(MIB, MIB) as (src, dst):
        src.as_array()[:] = 9
        job = NATIVE.Job([TransferEntry(0, src.region_id, 0, MIB)], dst.buf, lambda rid: (src.buf, src.size), True, 64 * KIB)
        assert job.copy(64 * KIB) == 64 * KIB
        with pytest.raises(RegionInUseError):
            dst.close()  # the job holds its buffer
        job.release()
        assert job.claimed and not job.done
        assert job.copy() == 0  # released: no piece is handed out any more
        assert (dst.as_array()[: 64 * KIB] == 9).all() and not dst.as_array()[64 * KIB :].any()


@needs_native
def test_a_region_too_small_for_its_descriptor_is_refused() -> None:
    with _regions(MIB, MIB) as (src, dst):
        with pytest.raises(NATIVE.BadEntry, match="outside its remote region"):
            NATIVE.Job([TransferEntry(0, src.region_id, MIB - 8, 16)], dst.buf, lambda rid: (src.buf, 2 * MIB), True, 64 * KIB)
        with pytest.raises(BufferError):  # a read-only buffer is refused before anything is copied
            NATIVE.Job([TransferEntry(0, src.region_id, 0, 16)], dst.buf, lambda rid: (bytes(16), 16), True, 64 * KIB)


async def test_a_batch_shared_by_several_threads_lands_every_block_once(path: str) -> None:
    async with _served(32 * MIB, seed=7) as (transport, remotes, local):
        block = 96 * KIB  # not a multiple of the pieces: they end mid-block
        order = [(i * 61) % 160 for i in range(160)]  # every remote block once, out of order: 15 MiB
        entries = [TransferEntry(i * block, remotes[0].region_id, j * block, block) for i, j in enumerate(order)]
        assert await transport.read(local, entries) == 160 * block
        want = np.zeros(local.size, dtype=np.uint8)
        _expected(want, {remotes[0].region_id: remotes[0].as_array()}, entries, True)
        assert np.array_equal(local.as_array(), want)


async def test_a_cancelled_batch_leaves_nothing_copying_once_it_returns(path: str) -> None:
    """Cancelled while threads copy, the batch returns only when no thread can touch either
    region any more: the local bytes stop changing and the region can be closed at once."""
    async with _served(64 * MIB, seed=8) as (transport, remotes, local):
        with _regions(64 * MIB) as (big,):
            entries = [TransferEntry(i * 64 * KIB, remotes[0].region_id, i * 64 * KIB, 64 * KIB) for i in range(1024)]
            for delay in (0.0, 0.001, 0.003):
                big.as_array()[:] = 0
                task = asyncio.ensure_future(transport.read(big, entries))
                await asyncio.sleep(delay)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                snapshot = big.as_array().copy()
                time.sleep(0.05)  # a thread still copying would change the bytes meanwhile
                assert np.array_equal(big.as_array(), snapshot)
            del snapshot
        # _regions closed ``big`` above: no view of it was left behind
