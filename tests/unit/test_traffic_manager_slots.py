"""The traffic manager keeps a slot while a storage read still writes into it: a free that
arrives meanwhile (a retried request) takes effect when the read ends, so the slot cannot be
handed to another request and receive late bytes."""

from __future__ import annotations

import asyncio
import uuid

from dualpath.config import NodeConfig
from dualpath.kv import BlockStore
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
        held_during = tm.pool.get("r1") is not None
        reply = await task
        return freed, held_during, reply

    try:
        freed, held_during, reply = asyncio.run(run())
        assert freed.detail == "deferred" and held_during  # the read still had the slot
        assert reply.loaded == len(hashes)
        assert tm.pool.get("r1") is None and tm.pool.free_bytes == region.size  # released when the read ended
        assert asyncio.run(tm.free(m.FreeRequest(request_id="r1"))).detail == "no slot"
    finally:
        region.close()
        region.unlink()
