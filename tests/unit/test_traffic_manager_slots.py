"""The traffic manager keeps a slot while a storage read still writes into it: a free that
arrives meanwhile (a retried request) takes effect when the read ends, so the slot cannot be
handed to another request and receive late bytes."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

from dualpath.config import NodeConfig
from dualpath.kv import BlockStore
from dualpath.node.slots import QUARANTINE_S, slot_key
from dualpath.node.storage_io import StorageIO
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from dualpath.transfer import MemoryRegion, RegionDescriptor
from dualpath.transfer.nic import EmulatedNic
from services.traffic_manager.service import TrafficManager

LAYERS, TOKENS, BPT = 2, 4, 8  # 64 B blocks
DIGEST = 3


def test_a_free_during_a_read_is_deferred_until_the_read_ends(tmp_path):
    store = BlockStore(tmp_path)
    hashes = list(range(1, 41))
    for h in hashes:
        store.write(
            model_digest=DIGEST,
            block_hash=h,
            layers=LAYERS,
            tokens=TOKENS,
            bytes_per_token_layer=BPT,
            dtype="uint8",
            payload=bytes([h]) * (LAYERS * TOKENS * BPT),
        )
    region = MemoryRegion(f"test-tm-{uuid.uuid4().hex[:10]}", 64 * 64)
    desc = RegionDescriptor(region_id=region.region_id, node_id="n0", size=region.size, transport="tcp")
    # 40 blocks x 64 B at 12.8 kB/s: the read takes ~0.2 s, in grants of one block
    io = StorageIO(store, read_nic=EmulatedNic(12_800, name="snic", chunk_bytes=64, burst_bytes=64))
    tm = TrafficManager(None, NodeConfig(node_id="n0"), Subjects("t"), region, desc, io)
    load = m.LoadRequest(
        request_id="r1",
        model_digest=DIGEST,
        hashes=hashes,
        layers=LAYERS,
        bytes_per_token_layer=BPT,
        dtype="uint8",
        block_tokens=TOKENS,
        allocate=True,
        total_blocks=len(hashes),
    )

    async def run():
        task = asyncio.create_task(tm.load(load))
        await asyncio.sleep(0.05)
        freed = await tm.free(m.FreeRequest(request_id="r1"))
        held_during = tm.pool.get(slot_key("r1", 0)) is not None
        reply = await task
        return freed, held_during, reply

    try:
        freed, held_during, reply = asyncio.run(run())
        assert freed.detail == "deferred" and held_during  # the read still had the slot
        assert reply.loaded == len(hashes)
        assert tm.pool.get(slot_key("r1", 0)) is None and tm.pool.free_bytes == region.size  # released when the read ended
        assert asyncio.run(tm.free(m.FreeRequest(request_id="r1"))).detail == "no slot"
    finally:
        region.close()
        region.unlink()


def _tm(tmp_path, size: int = 16 * 4096) -> tuple[TrafficManager, MemoryRegion]:
    region = MemoryRegion(f"test-tm-{uuid.uuid4().hex[:10]}", size)
    desc = RegionDescriptor(region_id=region.region_id, node_id="n0", size=region.size, transport="tcp")
    return TrafficManager(None, NodeConfig(node_id="n0"), Subjects("t"), region, desc, StorageIO(BlockStore(tmp_path))), region


def _alloc(rid: str, attempt: int, instance: str = "") -> m.AllocRequest:
    return m.AllocRequest(request_id=rid, blocks=4, block_bytes=64 * 4, attempt=attempt, instance=instance)


def _persist(tm: TrafficManager, rid: str, attempt: int, *, free_after: bool) -> m.PersistRequest:
    return m.PersistRequest(
        request_id=rid,
        model_digest=DIGEST,
        region_id=tm.region.region_id,
        offset=0,
        hashes=[],
        parent_chain=[],
        layers=LAYERS,
        bytes_per_token_layer=BPT,
        dtype="uint8",
        block_tokens=TOKENS,
        free_after=free_after,
        attempt=attempt,
    )


def test_an_older_attempt_can_neither_share_free_nor_load_into_a_newer_attempts_slot(tmp_path):
    """A retry placed on the same decode node: the old attempt's late hand-off (its decode engine
    persists the prompt and frees "its" slot) or late read must not touch the retry's slot."""
    tm, region = _tm(tmp_path)

    async def run():
        old = await tm.alloc(_alloc("r", 0))
        new = await tm.alloc(_alloc("r", 1))  # reserved before the old slot was given back
        assert new.offset != old.offset  # its own slot: the old prefill's writes cannot land in it
        await tm.free(m.FreeRequest(request_id="r", before_attempt=1))  # the scheduler's retry frees older attempts
        await tm.persist(_persist(tm, "r", 0, free_after=True))  # the old run's decode engine frees its slot
        assert tm.pool.get(slot_key("r", 0)) is None and tm.pool.get(slot_key("r", 1)) is not None
        late_read = m.LoadRequest(
            request_id="r", model_digest=DIGEST, hashes=[1], layers=LAYERS, bytes_per_token_layer=BPT, dtype="uint8", block_tokens=TOKENS
        )
        try:
            await tm.load(late_read)  # attempt 0: its slot is gone
        except Exception as exc:  # noqa: BLE001
            return getattr(exc, "code", 0)
        return None

    try:
        assert asyncio.run(run()) == 404
        assert asyncio.run(tm.free(m.FreeRequest(request_id="r", attempt=1))).detail == "freed"
        assert tm.pool.free_bytes == region.size
    finally:
        region.close()
        region.unlink()


def test_a_dead_schedulers_unclaimed_reservations_are_given_back_after_the_grace_and_only_those(tmp_path):
    tm, region = _tm(tmp_path)
    grace = tm.reclaim_after_s
    clock = [0.0]
    tm.clock = lambda: clock[0]

    def at(t: float, instance: str) -> None:
        clock[0] = t
        tm.on_scheduler(instance)

    async def run():
        at(0.0, "old")
        for rid in ("never-dispatched", "handed-off", "admitted", "superseded"):
            await tm.alloc(_alloc(rid, 0, instance="old"))
        await tm.claim(m.SlotClaimed(request_id="handed-off", attempt=0))  # its decode engine took the hand-off
        await tm.persist(_persist(tm, "admitted", 0, free_after=False))  # its decode engine took the KV in
        at(100.0, "new")
        await tm.alloc(_alloc("placed-by-new", 0, instance="new"))

    def reclaim_at(t: float) -> list[str]:
        clock[0] = t
        return sorted(tm.reclaim())

    try:
        asyncio.run(run())
        assert reclaim_at(100.0 + grace - 1) == []  # in-flight hand-offs still have time to land
        assert reclaim_at(100.0 + grace) == [slot_key("never-dispatched", 0), slot_key("superseded", 0)]
        assert all(tm.pool.get(slot_key(rid, 0)) is not None for rid in ("handed-off", "admitted", "placed-by-new"))
        assert reclaim_at(1e9) == [] and tm.reclaimed == 2
        assert tm.pool.free_bytes == region.size - 3 * 4096
    finally:
        region.close()
        region.unlink()


def test_a_slot_a_retry_gave_up_is_not_reused_until_its_quarantine_ends(tmp_path):
    """The old attempt's prefill batch may still write into it after the retry's free."""
    tm, region = _tm(tmp_path)
    clock = [0.0]
    tm.clock = lambda: clock[0]

    async def run() -> tuple[int, int, str]:
        old = await tm.alloc(_alloc("r", 0))
        freed = await tm.free(m.FreeRequest(request_id="r", before_attempt=1))
        other = await tm.alloc(_alloc("other", 0))
        return old.offset, other.offset, freed.detail

    try:
        old, other, detail = asyncio.run(run())
        assert detail == "quarantined 1" and other != old
        clock[0] = QUARANTINE_S - 0.1
        tm.sweep()
        assert tm.pool.get(slot_key("r", 0)) is not None
        clock[0] = QUARANTINE_S
        tm.sweep()
        assert tm.pool.get(slot_key("r", 0)) is None and tm.pool.free_bytes == region.size - 4096
    finally:
        region.close()
        region.unlink()


def test_a_persist_from_a_slot_that_was_given_back_writes_nothing(tmp_path):
    """Its bytes may belong to another request by now: persisting them would commit wrong KV."""
    tm, region = _tm(tmp_path)

    async def run() -> str:
        slot = await tm.alloc(_alloc("r", 0))
        await tm.free(m.FreeRequest(request_id="r", attempt=0))
        await tm.alloc(_alloc("someone-else", 0))  # first fit: the same bytes
        late = replace(_persist(tm, "r", 0, free_after=True), hashes=[11], offset=slot.offset)
        return (await tm.persist(late)).detail

    try:
        assert asyncio.run(run()) == "no slot"
        assert not list(tmp_path.rglob("*.blk")) and not [p for p in tmp_path.rglob("*") if p.is_file()]
        assert tm.pool.get(slot_key("someone-else", 0)) is not None
    finally:
        region.close()
        region.unlink()
