"""An engine's data plane when a traffic manager dies and comes back on a new address."""

from __future__ import annotations

import dataclasses
import uuid

import anyio
import numpy as np
import pytest

from dualpath.engine.dataplane import EngineDataPlane
from dualpath.transfer import (
    AccessDeniedError,
    MemoryRegion,
    PeerLostError,
    RegionDescriptor,
    TransferEntry,
    UnknownRegionError,
    create_transport,
)
from dualpath.transfer.peer import pattern, spawn_peer

pytestmark = pytest.mark.anyio

MIB = 1 << 20


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_restarted_peer_with_the_same_region_id_on_a_new_address_is_reached_after_the_old_one_is_lost() -> None:
    rid = f"test-dp-buf-{uuid.uuid4().hex[:12]}"  # a traffic manager keeps its buffer's id across restarts
    local, remote = create_transport("shm", node_id="engine-node"), create_transport("tcp", node_id="engine-node", timeout_s=5.0)
    await local.start()
    await remote.start()
    dp = EngineDataPlane(node_id="engine-node", region=MemoryRegion(f"test-dp-l-{uuid.uuid4().hex[:12]}", MIB), local=local, remote=remote)
    try:
        with spawn_peer("tcp", {rid: MIB}) as peer:
            old = peer.descriptors[rid]
            assert await dp.read(old, [TransferEntry(0, rid, 0, 10)]) == 10
            peer.kill()
        with anyio.fail_after(3), pytest.raises(PeerLostError):  # in flight through the dead peer: fails fast
            await dp.read(old, [TransferEntry(0, rid, 0, 10)])
        await _until_segment_is_gone(rid)
        with spawn_peer("tcp", {rid: MIB}, seed=9) as again:
            new = again.descriptors[rid]
            assert new.address != old.address
            assert await dp.read(new, [TransferEntry(0, rid, 0, MIB)]) == MIB
            assert np.array_equal(dp.region.as_array(), pattern(MIB, 9))
    finally:
        await dp.close()


async def test_a_changed_descriptor_is_connected_again_even_without_a_failed_transfer_first() -> None:
    rid = f"test-dp-buf-{uuid.uuid4().hex[:12]}"
    local, remote = create_transport("shm", node_id="engine-node"), create_transport("tcp", node_id="engine-node", timeout_s=5.0)
    await local.start()
    await remote.start()
    dp = EngineDataPlane(node_id="engine-node", region=MemoryRegion(f"test-dp-l-{uuid.uuid4().hex[:12]}", MIB), local=local, remote=remote)
    try:
        with spawn_peer("tcp", {rid: MIB}) as peer:
            assert await dp.read(peer.descriptors[rid], [TransferEntry(0, rid, 0, 10)]) == 10
            peer.kill()
        await _until_segment_is_gone(rid)
        with spawn_peer("tcp", {rid: MIB}, seed=5) as again:
            assert await dp.read(again.descriptors[rid], [TransferEntry(0, rid, 0, MIB)]) == MIB
            assert np.array_equal(dp.region.as_array(), pattern(MIB, 5))
    finally:
        await dp.close()


async def _until_segment_is_gone(region_id: str) -> None:
    with anyio.fail_after(5):
        while True:
            try:
                MemoryRegion.attach(region_id).close()
            except UnknownRegionError:
                return
            await anyio.sleep(0.02)


async def test_a_same_node_region_created_again_by_a_restarted_owner_is_mapped_again_not_kept_stale() -> None:
    rid = f"test-dp-shm-{uuid.uuid4().hex[:12]}"
    owner = MemoryRegion(rid, MIB)
    local, remote = create_transport("shm", node_id="n0"), create_transport("tcp", node_id="n0", timeout_s=5.0)
    await local.start()
    await remote.start()
    dp = EngineDataPlane(node_id="n0", region=MemoryRegion(f"test-dp-l-{uuid.uuid4().hex[:12]}", MIB), local=local, remote=remote)
    desc = RegionDescriptor(region_id=rid, node_id="n0", size=MIB, transport="tcp", address={"host": "127.0.0.1", "port": 1}, key=owner.key)
    try:
        owner.buf[:] = pattern(MIB, 1).data
        assert await dp.read(desc, [TransferEntry(0, rid, 0, MIB)]) == MIB
        assert np.array_equal(dp.region.as_array(), pattern(MIB, 1))
        owner.close()
        owner.unlink()  # the owner died; its successor creates the region again, same id and address
        owner = MemoryRegion(rid, MIB)
        owner.buf[:] = pattern(MIB, 4).data
        with pytest.raises(AccessDeniedError):  # the old descriptor's key does not open the new segment
            await dp.read(desc, [TransferEntry(0, rid, 0, MIB)])
        fresh = dataclasses.replace(desc, key=owner.key)  # what the successor hands out
        assert await dp.read(fresh, [TransferEntry(0, rid, 0, MIB)]) == MIB
        assert np.array_equal(dp.region.as_array(), pattern(MIB, 4))
    finally:
        await dp.close()
        owner.close()
        owner.unlink()
