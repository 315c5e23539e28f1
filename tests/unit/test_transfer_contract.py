"""The transport contract, run against every transport present (tcp, shm; verbs where an
RDMA device and pyverbs exist, skipped with the reason otherwise)."""

from __future__ import annotations

import os
import random
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import numpy as np
import pytest

from dualpath.transfer import (
    MemoryRegion,
    OutOfBoundsError,
    PeerLostError,
    RegionDescriptor,
    TrafficClass,
    TransferEntry,
    TransferError,
    TransferTimeoutError,
    Transport,
    UnknownRegionError,
    create_transport,
)
from dualpath.transfer.peer import pattern, spawn_peer
from dualpath.transfer.verbs import verbs_available

pytestmark = pytest.mark.anyio

MIB = 1 << 20
NETWORKED = {"tcp", "verbs"}  # transports where a dead peer must fail the transfer

_VERBS_OK, _VERBS_REASON = verbs_available()
TRANSPORTS = [
    "tcp",
    "shm",
    pytest.param(
        "verbs",
        marks=[
            pytest.mark.rdma,
            pytest.mark.skipif(not _VERBS_OK, reason=f"verbs transport: {_VERBS_REASON}"),
        ],
    ),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _rid(tag: str) -> str:
    # shared memory names are host-global: other test runs must not collide with ours
    return f"test-{tag}-{uuid.uuid4().hex[:12]}"


@dataclass
class Pair:
    """An initiator and a target transport of one kind, with one region each."""

    kind: str
    initiator: Transport
    target: Transport
    local: MemoryRegion
    remote: MemoryRegion
    remote_desc: RegionDescriptor


@pytest.fixture(params=TRANSPORTS)
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    kind = request.param
    initiator = create_transport(kind, node_id="initiator")
    target = create_transport(kind, node_id="target")
    local = MemoryRegion(_rid("local"), 12 * MIB)
    remote = MemoryRegion(_rid("remote"), 12 * MIB)
    try:
        await initiator.start()
        await target.start()
        initiator.register(local)
        desc = RegionDescriptor.from_wire(target.register(remote).to_wire())
        await initiator.connect(desc)
        yield Pair(kind, initiator, target, local, remote, desc)
    finally:
        await initiator.close()
        await target.close()
        for region in (local, remote):
            region.close()
            region.unlink()


def _random_batch(rid: str, n: int, seed: int, max_len: int = 20_000) -> list[TransferEntry]:
    """``n`` entries of random lengths at shuffled, non-overlapping offsets on both sides."""
    rng = random.Random(seed)
    lengths = [rng.randrange(1, max_len) for _ in range(n)]
    slots = list(range(n))
    rng.shuffle(slots)
    local_starts = np.cumsum([0, *lengths[:-1]])
    remote_starts = np.cumsum([0, *[lengths[s] for s in slots[:-1]]])
    remote_at = {s: int(remote_starts[i]) for i, s in enumerate(slots)}
    return [TransferEntry(int(local_starts[i]), rid, remote_at[i], lengths[i]) for i in range(n)]


def _fill(region: MemoryRegion, seed: int) -> None:
    region.as_array()[:] = pattern(region.size, seed)


async def test_write_of_a_many_entry_batch_lands_exactly_where_each_entry_says(pair: Pair) -> None:
    _fill(pair.local, seed=1)
    _fill(pair.remote, seed=2)
    entries = _random_batch(pair.remote.region_id, 300, seed=3)
    expected = pair.remote.as_array().copy()
    src = pair.local.as_array()
    for e in entries:
        expected[e.remote_offset : e.remote_offset + e.length] = src[e.local_offset : e.local_offset + e.length]

    moved = await pair.initiator.write(pair.local, entries, traffic_class=TrafficClass.KV)

    assert moved == sum(e.length for e in entries)
    assert np.array_equal(pair.remote.as_array(), expected)


async def test_read_of_a_many_entry_batch_lands_exactly_where_each_entry_says(pair: Pair) -> None:
    _fill(pair.local, seed=4)
    _fill(pair.remote, seed=5)
    entries = _random_batch(pair.remote.region_id, 256, seed=6)
    expected = pair.local.as_array().copy()
    src = pair.remote.as_array()
    for e in entries:
        expected[e.local_offset : e.local_offset + e.length] = src[e.remote_offset : e.remote_offset + e.length]

    moved = await pair.initiator.read(pair.local, entries, traffic_class=TrafficClass.MODEL)

    assert moved == sum(e.length for e in entries)
    assert np.array_equal(pair.local.as_array(), expected)


async def test_four_mib_entries_survive_a_write_then_read_round_trip(pair: Pair) -> None:
    _fill(pair.local, seed=7)
    rid = pair.remote.region_id
    out = [TransferEntry(0, rid, 4 * MIB, 4 * MIB), TransferEntry(4 * MIB, rid, 0, 4 * MIB)]
    back = [TransferEntry(8 * MIB, rid, 4 * MIB, 4 * MIB)]

    assert await pair.initiator.write(pair.local, out) == 8 * MIB
    assert await pair.initiator.read(pair.local, back) == 4 * MIB

    arr = pair.local.as_array()
    assert np.array_equal(arr[8 * MIB : 12 * MIB], arr[0 : 4 * MIB])
    assert np.array_equal(pair.remote.as_array()[0 : 4 * MIB], arr[4 * MIB : 8 * MIB])


async def test_an_empty_batch_moves_nothing_and_returns_zero(pair: Pair) -> None:
    _fill(pair.remote, seed=8)
    before = pair.remote.as_array().copy()

    assert await pair.initiator.write(pair.local, []) == 0
    assert await pair.initiator.read(pair.local, []) == 0
    assert np.array_equal(pair.remote.as_array(), before)


async def test_a_batch_naming_an_unserved_region_fails_and_writes_none_of_its_entries(
    pair: Pair,
) -> None:
    _fill(pair.local, seed=9)
    _fill(pair.remote, seed=10)
    before = pair.remote.as_array().copy()
    address = dict(pair.remote_desc.address)
    if "rkey" in address:  # verbs: a key the target's HCA never issued
        address["rkey"] ^= 0x5A5A5A
    ghost = RegionDescriptor(
        region_id=_rid("ghost"),
        node_id=pair.remote_desc.node_id,
        size=MIB,
        transport=pair.kind,
        address=address,
    )
    good = TransferEntry(0, pair.remote.region_id, 0, 4096)

    with pytest.raises(UnknownRegionError) as info:
        await pair.initiator.connect(ghost)  # shm maps eagerly and fails here
        # Ghost first: an RDMA queue pair stops at its first failed request, so only what
        # precedes it could land (tcp and shm check the whole batch first; see test_transfer_tcp).
        await pair.initiator.write(pair.local, [TransferEntry(0, ghost.region_id, 0, 4096), good])

    assert ghost.region_id in str(info.value)
    assert np.array_equal(pair.remote.as_array(), before)


async def test_a_batch_never_connected_to_its_region_is_refused_before_sending(pair: Pair) -> None:
    with pytest.raises(UnknownRegionError, match="not connected"):
        await pair.initiator.read(pair.local, [TransferEntry(0, "never-heard-of-it", 0, 10)])


async def test_an_out_of_bounds_entry_fails_the_batch_and_writes_nothing(pair: Pair) -> None:
    _fill(pair.local, seed=11)
    _fill(pair.remote, seed=12)
    before = pair.remote.as_array().copy()
    rid, size = pair.remote.region_id, pair.remote.size
    good = TransferEntry(0, rid, 0, 4096)

    with pytest.raises(OutOfBoundsError) as info:
        await pair.initiator.write(pair.local, [good, TransferEntry(0, rid, size - 10, 20)])
    assert info.value.offset == size - 10 and info.value.size == size

    with pytest.raises(OutOfBoundsError):  # the local side is checked too
        await pair.initiator.write(pair.local, [good, TransferEntry(pair.local.size - 1, rid, 0, 2)])

    assert np.array_equal(pair.remote.as_array(), before)


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_peer_killed_mid_transfer_never_hangs_the_initiator(kind: str) -> None:
    """Networked transports fail with a TransferError within seconds; shm keeps the dead
    peer's memory mapped, so its transfers simply complete."""
    rid = _rid("victim")
    local = MemoryRegion(_rid("local"), 32 * MIB)
    options = {"timeout_s": 10.0} if kind in NETWORKED else {}
    transport = create_transport(kind, node_id="initiator", **options)
    await transport.start()
    peer = spawn_peer(kind, {rid: 32 * MIB})
    failure: BaseException | None = None
    try:
        await transport.connect(peer.descriptors[rid])
        batch = [TransferEntry(i * MIB, rid, i * MIB, MIB) for i in range(32)]
        await transport.read(local, batch)  # the peer works before it dies
        assert np.array_equal(local.as_array(0, MIB), pattern(32 * MIB, 0)[:MIB])

        async def kill_soon() -> None:
            await anyio.sleep(0.05)
            os.kill(peer.proc.pid, signal.SIGKILL)

        with anyio.fail_after(5):  # never hang
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill_soon)
                deadline = anyio.current_time() + 0.5
                try:
                    while anyio.current_time() < deadline:
                        await transport.read(local, batch)
                except TransferError as exc:
                    failure = exc
    finally:
        peer.kill()
        await transport.close()
        local.close()
        local.unlink()
    if kind in NETWORKED:
        assert isinstance(failure, PeerLostError | TransferTimeoutError), failure
    else:
        assert failure is None


def _strided_batch(rid: str) -> list[TransferEntry]:
    """Layer-block-like strided entries: remote pieces a 'block' apart, local pieces packed,
    plus one strided on both sides, one plain entry and a one-piece strided entry."""
    return [
        TransferEntry(0, rid, 100, 640, 50, 640, 7_680),  # 50 pieces, remote stride 7680
        TransferEntry(40_000, rid, 500_000, 333, 7, 1_000, 4_000),  # strided on both sides
        TransferEntry(60_000, rid, 900_000, 12_345),
        TransferEntry(80_000, rid, 950_000, 64, 1, 0, 0),
    ]


def _apply(dst: np.ndarray, src: np.ndarray, entries: list[TransferEntry], *, to_local: bool) -> None:
    for e in entries:
        for lo, ro, n in e.pieces():
            if to_local:
                dst[lo : lo + n] = src[ro : ro + n]
            else:
                dst[ro : ro + n] = src[lo : lo + n]


@pytest.mark.parametrize("chunk_bytes", [None, 5_000], ids=["whole", "split-by-nic"])
async def test_strided_entries_read_and_write_every_piece_and_nothing_between(pair: Pair, chunk_bytes) -> None:
    if chunk_bytes:
        from dualpath.transfer.nic import EmulatedNic

        pair.initiator.nic = EmulatedNic(1e9, name="test", chunk_bytes=chunk_bytes)
    _fill(pair.local, seed=21)
    _fill(pair.remote, seed=22)
    entries = _strided_batch(pair.remote.region_id)
    total = sum(e.length * e.count for e in entries)

    expected_remote = pair.remote.as_array().copy()
    _apply(expected_remote, pair.local.as_array(), entries, to_local=False)
    assert await pair.initiator.write(pair.local, entries) == total
    assert np.array_equal(pair.remote.as_array(), expected_remote)

    _fill(pair.remote, seed=23)
    expected_local = pair.local.as_array().copy()
    _apply(expected_local, pair.remote.as_array(), entries, to_local=True)
    assert await pair.initiator.read(pair.local, entries) == total
    assert np.array_equal(pair.local.as_array(), expected_local)


async def test_a_strided_entry_reaching_past_the_region_or_overlapping_itself_is_refused(pair: Pair) -> None:
    rid = pair.remote.region_id
    _fill(pair.remote, seed=24)
    before = pair.remote.as_array().copy()
    past_end = TransferEntry(0, rid, 12 * MIB - 10_000, 100, 11, 100, 1_000)  # last piece ends 100 B past the end
    with pytest.raises(OutOfBoundsError):
        await pair.initiator.write(pair.local, [past_end])
    with pytest.raises(ValueError, match="stride"):
        await pair.initiator.write(pair.local, [TransferEntry(0, rid, 0, 100, 3, 100, 50)])
    assert np.array_equal(pair.remote.as_array(), before)
