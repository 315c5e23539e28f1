"""The traffic manager's prefetch: staged runs live in the cache beside the request buffer
(never its room), a load takes them (bytes as stored), a request that needs the physical
room they hold drops them rather than wait, and staging starts only while the node reads
nothing for a request."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import Iterator

import pytest

from dualpath.bus import HandlerError
from dualpath.config import NodeConfig
from dualpath.kv import BlockStore
from dualpath.node.storage_io import StorageIO
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from dualpath.transfer import MemoryRegion, RegionDescriptor
from services.traffic_manager.service import TrafficManager

LAYERS, TOKENS, BPT = 2, 64, 32  # 4 KiB blocks
BB = LAYERS * TOKENS * BPT
CACHE_BLOCKS = (1 << 20) // BB  # --prefetch-mb 1
DIGEST = 5


@contextlib.contextmanager
def _tm(tmp_path, blocks: int, buffer_blocks: int) -> Iterator[tuple[TrafficManager, MemoryRegion, list[int]]]:
    """A traffic manager over a store of ``blocks`` blocks (hash h holds bytes h mod 256), a request
    buffer of ``buffer_blocks`` and a 1 MiB prefetch cache beside it; its region is closed and
    unlinked afterwards."""
    store = BlockStore(tmp_path)
    hashes = list(range(1, blocks + 1))
    for h in hashes:
        store.write(
            model_digest=DIGEST,
            block_hash=h,
            layers=LAYERS,
            tokens=TOKENS,
            bytes_per_token_layer=BPT,
            dtype="uint8",
            payload=bytes([h % 256]) * BB,
        )
    region = MemoryRegion(f"test-tmpf-{uuid.uuid4().hex[:10]}", (buffer_blocks + CACHE_BLOCKS) * BB)
    desc = RegionDescriptor(region_id=region.region_id, node_id="n0", size=region.size, transport="tcp")
    cfg = NodeConfig(node_id="n0", prefetch_mb=1, prefetch_ttl_s=60.0)
    try:
        yield TrafficManager(None, cfg, Subjects("t"), region, desc, StorageIO(store)), region, hashes
    finally:
        region.close()
        region.unlink()


def _load(rid: str, hashes: list[int], total: int) -> m.LoadRequest:
    return m.LoadRequest(
        request_id=rid,
        model_digest=DIGEST,
        hashes=hashes,
        layers=LAYERS,
        bytes_per_token_layer=BPT,
        dtype="uint8",
        block_tokens=TOKENS,
        allocate=True,
        total_blocks=total,
    )


async def _stage(tm: TrafficManager, hashes: list[int]) -> None:
    stop = asyncio.Event()
    assert tm.prefetcher is not None
    await tm.prefetcher._one(m.PrefetchRequest(session="s", model_digest=DIGEST, hashes=hashes), stop)


def test_a_load_takes_the_staged_blocks_from_the_buffer_and_reads_the_rest(tmp_path):
    with _tm(tmp_path, blocks=6, buffer_blocks=32) as (tm, region, hashes):

        async def run():
            await _stage(tm, hashes[:4])
            assert tm.prefetcher is not None and tm.prefetcher.cache.bytes == 4 * BB
            report = tm.report()  # staged runs sit beside the request buffer: all of it is free
            assert report.buffer_bytes == report.buffer_free_bytes == 32 * BB
            reply = await tm.load(_load("r1", hashes, 6))
            return reply

        reply = asyncio.run(run())
        assert reply.loaded == 6 and reply.bytes_read == 2 * BB  # four blocks came from the staged run
        got = bytes(region.buf[reply.offset : reply.offset + 6 * BB])
        assert got == b"".join(bytes([h]) * BB for h in hashes)
        stats = tm._prefetch_stats()
        assert stats["prefetch_used_bytes"] == 4 * BB and stats["prefetch_cached_bytes"] == 0


def test_a_staged_run_never_takes_a_requests_room(tmp_path):
    with _tm(tmp_path, blocks=8, buffer_blocks=8) as (tm, region, hashes):

        async def run():
            await _stage(tm, hashes[:6])
            return await tm.alloc(m.AllocRequest(request_id="r2", blocks=8, block_bytes=BB))

        assert asyncio.run(run()).nbytes == 8 * BB  # the whole request buffer, and the run stays
        stats = tm._prefetch_stats()
        assert stats["prefetch_evictions"] == 0 and stats["prefetch_cached_bytes"] == 6 * BB
        assert tm.report().buffer_free_bytes == 0


def test_requests_hold_at_most_the_request_buffer_though_the_cache_has_room(tmp_path):
    with _tm(tmp_path, blocks=1, buffer_blocks=8) as (tm, region, _):

        async def run():
            await tm.alloc(m.AllocRequest(request_id="r1", blocks=6, block_bytes=BB))
            with pytest.raises(HandlerError) as full:
                await tm.alloc(m.AllocRequest(request_id="r2", blocks=4, block_bytes=BB))
            with pytest.raises(HandlerError) as larger:
                await tm.alloc(m.AllocRequest(request_id="r3", blocks=9, block_bytes=BB))
            return full.value, larger.value

        full, larger = asyncio.run(run())
        assert full.code == m.BUFFER_FULL and larger.code == 400 and "whole" in str(larger)
        assert tm.pool.free_bytes == region.size - 6 * BB  # the cache's room was not lent


def test_a_request_that_needs_the_physical_room_a_run_holds_drops_it_instead_of_waiting(tmp_path):
    with _tm(tmp_path, blocks=CACHE_BLOCKS, buffer_blocks=8) as (tm, region, hashes):

        async def run():
            await _stage(tm, hashes[:4])  # run A: blocks 0-4 of the region
            await tm.alloc(m.AllocRequest(request_id="r1", blocks=4, block_bytes=BB))  # 4-8
            await _stage(tm, hashes[4:])  # run B: the rest of the cache budget, 8-260
            await tm.free(m.FreeRequest(request_id="r1"))  # free: 4-8 and 260-264, 8 blocks apart
            return await tm.alloc(m.AllocRequest(request_id="r2", blocks=8, block_bytes=BB))

        assert asyncio.run(run()).nbytes == 8 * BB
        stats = tm._prefetch_stats()
        assert stats["prefetch_evictions"] == 1 and stats["prefetch_dropped_bytes"] == 4 * BB  # run A, the oldest
        assert stats["prefetch_cached_bytes"] == (CACHE_BLOCKS - 4) * BB


def test_staging_waits_while_a_request_read_is_queued(tmp_path):
    with _tm(tmp_path, blocks=4, buffer_blocks=32) as (tm, region, hashes):

        async def run():
            tm.io.read_q_tokens = 64  # a request's read is queued on this node
            task = asyncio.create_task(_stage(tm, hashes))
            await asyncio.sleep(0.1)
            assert tm.prefetcher is not None
            waiting = tm.prefetcher.blocks_read == 0 and tm.prefetcher.cache.bytes == 0  # no buffer taken either
            tm.io.read_q_tokens = 0
            await asyncio.wait_for(task, 5)
            return waiting

        assert asyncio.run(run())
        assert tm.prefetcher is not None and tm.prefetcher.blocks_read == 4


class _CommitBus:
    """Answers the index commit a persist sends (nothing else is asked here)."""

    async def request(self, *_args, **_kwargs) -> m.Ok:
        return m.Ok()


def test_a_pe_read_slot_given_back_stays_as_a_run_and_the_next_load_reads_only_the_new_blocks(tmp_path):
    with _tm(tmp_path, blocks=6, buffer_blocks=32) as (tm, region, hashes):

        async def run():
            await tm.load(_load("t1", hashes[:4], 5))  # the PE read path: the load allocates the slot
            await tm.free(m.FreeRequest(request_id="t1"))  # its prefill ended
            assert tm.prefetcher is not None and tm.prefetcher.cache.bytes == 5 * BB  # the slot, kept in place
            assert tm.report().buffer_free_bytes == 32 * BB  # the retained run left the request buffer
            return await tm.load(_load("t2", hashes, 6))

        reply = asyncio.run(run())
        assert reply.loaded == 6 and reply.bytes_read == 2 * BB  # four blocks came from the retained slot
        assert bytes(region.buf[reply.offset : reply.offset + 6 * BB]) == b"".join(bytes([h]) * BB for h in hashes)
        stats = tm._prefetch_stats()
        assert stats["prefetch_retained_bytes"] == 4 * BB and stats["prefetch_used_bytes"] == 4 * BB
        assert stats["prefetch_staged_bytes"] == 0 and tm.prefetcher is not None and tm.prefetcher.bytes_read == 0


def test_a_de_read_slot_keeps_its_hits_and_the_prompt_blocks_persisted_from_it(tmp_path):
    with _tm(tmp_path, blocks=3, buffer_blocks=32) as (tm, region, hashes):
        tm.bus = _CommitBus()  # type: ignore[assignment]

        async def run():
            slot = await tm.alloc(m.AllocRequest(request_id="t1", blocks=4, block_bytes=BB))
            await tm.load(dataclasses.replace(_load("t1", hashes[:2], 4), allocate=False))  # the DE read path's hits
            new = b"".join(bytes([200 + i]) * BB for i in range(2))  # the prefill wrote the prompt's new blocks
            region.buf[slot.offset + 2 * BB : slot.offset + 4 * BB] = new
            persist = m.PersistRequest(
                request_id="t1",
                model_digest=DIGEST,
                region_id=region.region_id,
                offset=slot.offset + 2 * BB,
                hashes=[900, 901],
                parent_chain=hashes[:2],
                layers=LAYERS,
                bytes_per_token_layer=BPT,
                dtype="uint8",
                block_tokens=TOKENS,
                free_after=True,
            )
            await tm.persist(persist)
            dest = memoryview(bytearray(4 * BB))
            assert tm.prefetcher is not None
            return tm.prefetcher.cache.take_prefix(DIGEST, [*hashes[:2], 900, 901], BB, dest), bytes(dest), new

        n, got, new = asyncio.run(run())
        assert n == 4 and got == bytes([1]) * BB + bytes([2]) * BB + new
        assert tm._prefetch_stats()["prefetch_retained_bytes"] == 4 * BB


def test_a_slot_nothing_was_read_into_is_freed_not_retained(tmp_path):
    with _tm(tmp_path, blocks=1, buffer_blocks=8) as (tm, region, _):

        async def run():
            await tm.alloc(m.AllocRequest(request_id="t1", blocks=4, block_bytes=BB))  # the PE read path's DE slot
            await tm.free(m.FreeRequest(request_id="t1"))

        asyncio.run(run())
        assert tm.prefetcher is not None and tm.prefetcher.cache.bytes == 0 and tm.pool.free_bytes == region.size


def test_a_retained_run_leaves_the_whole_request_buffer_to_the_next_request(tmp_path):
    with _tm(tmp_path, blocks=4, buffer_blocks=8) as (tm, region, hashes):

        async def run():
            await tm.load(_load("t1", hashes, 4))
            await tm.free(m.FreeRequest(request_id="t1"))
            return await tm.alloc(m.AllocRequest(request_id="r2", blocks=8, block_bytes=BB))

        assert asyncio.run(run()).nbytes == 8 * BB
        stats = tm._prefetch_stats()
        assert stats["prefetch_evictions"] == 0 and stats["prefetch_cached_bytes"] == 4 * BB
