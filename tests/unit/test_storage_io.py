"""``StorageIO``: a node's block reads in NIC-chunk groups, the read queue, corrupt blocks."""

from __future__ import annotations

import asyncio

import pytest

from dualpath.kv import BlockStore
from dualpath.node.storage_io import BlockFormat, StorageIO
from dualpath.transfer import TrafficClass
from dualpath.transfer.nic import EmulatedNic

FMT = BlockFormat(layers=3, block_tokens=4, bytes_per_token_layer=10, dtype="uint8")  # 120 B blocks
DIGEST = 0xD1


def _payload(i: int) -> bytes:
    return bytes((i * 7 + k) % 251 for k in range(FMT.block_bytes))


def _write(store: BlockStore, hashes: list[int]) -> None:
    for i, h in enumerate(hashes):
        store.write(
            model_digest=DIGEST,
            block_hash=h,
            layers=FMT.layers,
            tokens=FMT.block_tokens,
            bytes_per_token_layer=FMT.bytes_per_token_layer,
            dtype=FMT.dtype,
            payload=_payload(i),
        )


@pytest.mark.parametrize("fsync", [True, False])
@pytest.mark.parametrize("chunk", [None, 250, 100_000], ids=["no-nic", "2-blocks-per-grant", "all-in-one-grant"])
def test_reads_land_block_by_block_and_the_queue_drains(tmp_path, chunk, fsync):
    store = BlockStore(tmp_path, fsync=fsync)
    hashes = list(range(100, 117))
    _write(store, hashes)
    nic = EmulatedNic(10e6, name="snic", chunk_bytes=chunk) if chunk else None
    io = StorageIO(store, read_nic=nic)
    dest = memoryview(bytearray(len(hashes) * FMT.block_bytes))

    result = asyncio.run(io.read_blocks(DIGEST, hashes, FMT, dest))

    assert result.loaded == len(hashes) and result.bad == [] and result.bytes_read == len(hashes) * FMT.block_bytes
    assert bytes(dest) == b"".join(_payload(i) for i in range(len(hashes)))
    assert (io.read_q_tokens, io.read_q_bytes) == (0, 0) and io.bytes_read == len(hashes) * FMT.block_bytes
    if nic is not None:
        assert nic.bytes_sent(TrafficClass.KV) == len(hashes) * FMT.block_bytes


def test_a_corrupt_block_ends_the_hit_there_and_is_reported(tmp_path):
    store = BlockStore(tmp_path)
    hashes = list(range(200, 210))
    _write(store, hashes)
    path = store.path_for(DIGEST, hashes[6])
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    io = StorageIO(store, read_nic=EmulatedNic(10e6, name="snic", chunk_bytes=3 * FMT.block_bytes))
    dest = memoryview(bytearray(len(hashes) * FMT.block_bytes))

    result = asyncio.run(io.read_blocks(DIGEST, hashes, FMT, dest))

    assert result.loaded == 6 and result.bad == [hashes[6]] and io.bytes_read == 6 * FMT.block_bytes
    assert bytes(dest[: 6 * FMT.block_bytes]) == b"".join(_payload(i) for i in range(6))
    assert (io.read_q_tokens, io.read_q_bytes) == (0, 0)


def test_the_read_queue_counts_blocks_not_yet_read(tmp_path):
    store = BlockStore(tmp_path)
    hashes = list(range(300, 340))
    _write(store, hashes)
    # 40 blocks x 120 B at 24 kB/s: about 0.2 s, in grants of 2 blocks
    io = StorageIO(store, read_nic=EmulatedNic(24_000, name="snic", chunk_bytes=240, burst_bytes=240))
    dest = memoryview(bytearray(len(hashes) * FMT.block_bytes))

    async def run():
        task = asyncio.create_task(io.read_blocks(DIGEST, hashes, FMT, dest))
        midway = 0
        while not task.done():  # polled, not one sleep: a slow first read must not read 'all'
            await asyncio.sleep(0.005)
            if 0 < io.read_q_tokens < len(hashes) * FMT.block_tokens:
                midway = io.read_q_tokens
        result = await task
        return midway, result

    midway, result = asyncio.run(run())
    assert 0 < midway < len(hashes) * FMT.block_tokens
    assert result.loaded == len(hashes) and io.read_q_tokens == 0


@pytest.mark.parametrize("bad_at", [0, 3, 4, 9])
def test_a_bad_block_ends_the_hit_while_later_groups_are_in_flight(tmp_path, bad_at):
    """Without an SNIC a request's groups run in parallel: the hit is still the prefix before
    the first bad block, and nothing is left in the read queue."""
    store = BlockStore(tmp_path)
    hashes = list(range(400, 410))
    _write(store, [h for i, h in enumerate(hashes) if i != bad_at])
    io = StorageIO(store, fanout=3)
    dest = memoryview(bytearray(len(hashes) * FMT.block_bytes))

    result = asyncio.run(io.read_blocks(DIGEST, hashes, FMT, dest))

    assert result.loaded == bad_at and result.bad == [hashes[bad_at]] and io.bytes_read == bad_at * FMT.block_bytes
    assert (io.read_q_tokens, io.read_q_bytes) == (0, 0)
    io.close()


def test_writes_in_parallel_groups_all_land_and_read_back(tmp_path):
    store = BlockStore(tmp_path)
    hashes = list(range(500, 537))
    io = StorageIO(store, fanout=4)
    src = memoryview(b"".join(_payload(i) for i in range(len(hashes))))
    dest = memoryview(bytearray(len(src)))

    async def run():
        written = await io.write_blocks(DIGEST, hashes, FMT, src)
        return written, await io.read_blocks(DIGEST, hashes, FMT, dest)

    written, result = asyncio.run(run())
    assert result.loaded == len(hashes) and bytes(dest) == bytes(src)
    assert written == io.bytes_written > len(src)  # headers included
    io.close()


def test_a_buffer_can_be_closed_as_soon_as_a_read_returns(tmp_path):
    """No worker thread keeps a view of the caller's buffer once the read has returned."""
    store = BlockStore(tmp_path)
    hashes = list(range(600, 604))
    _write(store, hashes)
    io = StorageIO(store)

    async def run():
        for _ in range(200):
            buf = bytearray(len(hashes) * FMT.block_bytes)
            with memoryview(buf) as dest:
                assert (await io.read_blocks(DIGEST, hashes, FMT, dest)).loaded == len(hashes)
            buf.extend(b"x")  # a bytearray with a view still exported refuses to resize

    asyncio.run(run())
    io.close()


def test_a_cancelled_read_empties_its_queue_and_frees_the_buffer(tmp_path):
    """Cancelled while groups are in flight: it waits for them, so no thread writes into the
    buffer afterwards, and its blocks leave the read queue."""
    store = BlockStore(tmp_path)
    hashes = list(range(700, 740))
    _write(store, hashes)
    io = StorageIO(store, read_nic=EmulatedNic(24_000, name="snic", chunk_bytes=240, burst_bytes=240))
    dest = memoryview(bytearray(len(hashes) * FMT.block_bytes))

    async def run():
        task = asyncio.create_task(io.read_blocks(DIGEST, hashes, FMT, dest))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert (io.read_q_tokens, io.read_q_bytes) == (0, 0)
    dest.release()  # raises BufferError while any slice of it is still alive
    io.close()
