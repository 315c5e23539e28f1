"""Region keys (the data plane's rkeys): each region's own random key, handed out only in its
descriptor, checked once per region per tcp frame and on every shm connect, in constant time."""

from __future__ import annotations

import dataclasses
import hmac
import os
import stat
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

from dualpath.transfer import (
    AccessDeniedError,
    MemoryRegion,
    RegionDescriptor,
    TransferEntry,
    UnknownRegionError,
    create_transport,
    tcp_server,
)
from dualpath.transfer import shm as shm_module
from dualpath.transfer.region import KEY_BYTES
from dualpath.transfer.tcp import TcpTransport
from dualpath.transfer.tcp_wire import ENTRY, REQUEST, decode_table, encode_request
from dualpath.transfer.tcp_wire import Op as WireOp

pytestmark = pytest.mark.anyio

MIB = 1 << 20


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _rid(tag: str) -> str:
    return f"test-key-{tag}-{uuid.uuid4().hex[:12]}"


class _Log:
    """Stands in for a module's structlog logger: keeps each event and its fields (structlog's
    ``capture_logs`` misses loggers cached by an earlier ``configure_logging`` in the process)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def _keep(self, event: str, **kw: Any) -> None:
        self.events.append({"event": event, **kw})

    warning = info = error = exception = _keep


@pytest.fixture
def regions() -> Iterator[list[MemoryRegion]]:
    made = [MemoryRegion(_rid(str(i)), MIB) for i in range(3)]
    try:
        yield made
    finally:
        for r in made:
            r.close()
            r.unlink()


async def test_every_region_gets_its_own_random_128_bit_key_and_every_transport_hands_out_only_that(regions) -> None:
    keys = {r.key for r in regions}
    assert len(keys) == 3 and all(len(k) == KEY_BYTES == 16 for k in keys)
    tcp, shm = create_transport("tcp", node_id="n"), create_transport("shm", node_id="n")
    await tcp.start()
    try:
        for t in (tcp, shm):
            desc = t.register(regions[0])
            assert desc.key == regions[0].key
            assert regions[0].key.hex() not in repr(desc) and str(regions[0].key) not in repr(desc)  # logs show no key
            wire = msgpack.unpackb(msgpack.packb(desc.to_wire()))
            assert RegionDescriptor.from_wire(wire) == desc
    finally:
        await tcp.close()


def test_an_attacher_reads_the_owners_key_and_the_segment_is_the_owners_alone(regions) -> None:
    owner = regions[0]
    other = MemoryRegion.attach(owner.region_id)
    try:
        assert other.key == owner.key and other.size == owner.size
        assert other.accepts(owner.key) and not other.accepts(regions[1].key) and not other.accepts(b"")
        mode = stat.S_IMODE(os.stat(f"/dev/shm/{owner.shm_name}").st_mode)
        assert mode == 0o600
        owner.buf[:] = b"\xff" * owner.size  # writes through buf never reach the key after it
        assert MemoryRegion.attach(owner.region_id).key == owner.key
    finally:
        other.close()


def test_a_descriptor_without_a_key_or_with_a_key_that_is_not_bytes_is_refused_on_the_wire(regions) -> None:
    desc = RegionDescriptor(region_id="r", node_id="n", size=MIB, transport="tcp", address={"host": "h", "port": 1}, key=regions[0].key)
    wire = desc.to_wire()
    with pytest.raises(ValueError, match="key"):
        RegionDescriptor.from_wire({k: v for k, v in wire.items() if k != "key"})
    with pytest.raises(ValueError, match="key"):
        RegionDescriptor.from_wire({**wire, "key": 16})  # bytes(16) would be sixteen zero bytes
    with pytest.raises(ValueError, match="version"):
        RegionDescriptor.from_wire({**wire, "v": 1})  # a descriptor from before keys


def test_the_request_frame_carries_each_region_once_with_its_key_beside_its_id(regions) -> None:
    a, b = regions[0], regions[1]
    entries = [TransferEntry(i * 4096, (a if i % 2 else b).region_id, i * 4096, 4096) for i in range(64)]
    frame = encode_request(WireOp.READ, 1, 7, entries, 0, {a.region_id: a.key, b.region_id: b.key})
    magic, _op, _cls, n_regions, n_entries, table_len, _id, _payload = REQUEST.unpack_from(frame)
    assert magic == b"DPq3" and (n_regions, n_entries) == (2, 64)
    table = decode_table(frame[REQUEST.size : REQUEST.size + table_len], n_regions)
    assert table == [(b.region_id, b.key), (a.region_id, a.key)]
    rows = frame[REQUEST.size + table_len :]
    assert [table[slot][0] for slot, *_ in ENTRY.iter_unpack(rows)] == [e.remote_region for e in entries]  # each entry's own region
    # An id equal to a region's but another str object (as one decoded off the wire is) names the same slot.
    twin = [dataclasses.replace(e, remote_region="".join(e.remote_region)) for e in entries[:3]]
    assert twin[0].remote_region == entries[0].remote_region and twin[0].remote_region is not entries[0].remote_region
    twin_frame = encode_request(WireOp.READ, 1, 7, [*entries[:3], *twin], 0, {a.region_id: a.key, b.region_id: b.key})
    (_, _, _, n_twin, _, twin_len, _, _) = REQUEST.unpack_from(twin_frame)
    assert n_twin == 2
    assert [slot for slot, *_ in ENTRY.iter_unpack(twin_frame[REQUEST.size + twin_len :])] == [0, 1, 0, 0, 1, 0]
    unkeyed = encode_request(WireOp.READ, 1, 7, entries[:1], 0, {})
    (_, _, _, n, _, tlen, _, _) = REQUEST.unpack_from(unkeyed)
    assert decode_table(unkeyed[REQUEST.size : REQUEST.size + tlen], n)[0][1] == bytes(16)  # no region has it


async def test_the_tcp_server_checks_one_key_per_region_per_frame_not_one_per_entry(regions, monkeypatch) -> None:
    client, server = TcpTransport(node_id="a", timeout_s=5.0), TcpTransport(node_id="b")
    local, r1, r2 = regions
    checks: list[bytes] = []
    real = MemoryRegion.accepts

    def counting(self: MemoryRegion, key: bytes) -> bool:
        checks.append(key)
        return real(self, key)

    await client.start()
    await server.start()
    try:
        await client.connect(server.register(r1))
        await client.connect(server.register(r2))
        r1.buf[:] = bytes(range(256)) * (MIB // 256)
        monkeypatch.setattr(MemoryRegion, "accepts", counting)
        entries = [TransferEntry(i * 2048, (r1 if i % 2 else r2).region_id, i * 2048, 2048) for i in range(256)]
        assert await client.read(local, entries) == 256 * 2048
        assert len(checks) == 2  # two regions in the frame: two comparisons for 256 entries
        assert bytes(local.buf[2048:4096]) == bytes(r1.buf[2048:4096])
    finally:
        await client.close()
        await server.close()


async def test_a_descriptor_with_a_stale_key_is_refused_by_the_tcp_server_and_moves_nothing(regions, monkeypatch) -> None:
    monkeypatch.setattr(tcp_server, "_log", log := _Log())
    client, server = TcpTransport(node_id="a", timeout_s=5.0), TcpTransport(node_id="b")
    local, remote, _ = regions
    await client.start()
    await server.start()
    try:
        good = server.register(remote)
        remote.buf[:] = b"\x5a" * remote.size
        local.buf[:] = b"\x11" * local.size
        await client.connect(dataclasses.replace(good, key=os.urandom(16)))
        with pytest.raises(AccessDeniedError, match=remote.region_id):
            await client.read(local, [TransferEntry(0, remote.region_id, 0, MIB)])
        with pytest.raises(AccessDeniedError):
            await client.write(local, [TransferEntry(0, remote.region_id, 0, MIB)])
        assert bytes(local.buf) == b"\x11" * local.size and bytes(remote.buf) == b"\x5a" * remote.size
        refusals = [e for e in log.events if e["event"] == "tcp_key_refused"]
        assert [e["op"] for e in refusals] == ["READ", "WRITE"]
        assert all(e["region"] == remote.region_id and e["peer"].startswith("127.0.0.1:") for e in refusals)
        await client.connect(good)  # the right descriptor works on the same connection
        assert await client.read(local, [TransferEntry(0, remote.region_id, 0, MIB)]) == MIB
        assert bytes(local.buf) == bytes(remote.buf)
    finally:
        await client.close()
        await server.close()


async def test_shm_maps_a_region_only_for_a_descriptor_with_the_segments_key_and_logs_a_refusal(regions, monkeypatch) -> None:
    owner_t, peer_t = create_transport("shm", node_id="owner"), create_transport("shm", node_id="peer")
    local, remote, _ = regions
    desc = owner_t.register(remote)
    remote.buf[:8] = b"original"
    try:
        for bad in (b"", os.urandom(16), desc.key[:-1] + bytes([desc.key[-1] ^ 1])):
            monkeypatch.setattr(shm_module, "_log", log := _Log())
            with pytest.raises(AccessDeniedError):
                await peer_t.connect(dataclasses.replace(desc, key=bad))
            assert [e["event"] for e in log.events] == ["shm_key_refused"] and log.events[0]["region"] == remote.region_id
            with pytest.raises(UnknownRegionError):  # refused: no batch can name it
                await peer_t.write(local, [TransferEntry(0, remote.region_id, 0, 8)])
        assert bytes(remote.buf[:8]) == b"original"
        await peer_t.connect(desc)
        local.buf[:8] = b"replaced"
        await peer_t.write(local, [TransferEntry(0, remote.region_id, 0, 8)])
        assert bytes(remote.buf[:8]) == b"replaced"
    finally:
        await peer_t.close()
        await owner_t.close()


def test_region_keys_are_compared_in_constant_time(regions, monkeypatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    guess = bytes(np.random.default_rng(0).integers(0, 256, 16, dtype=np.uint8))
    assert not regions[0].accepts(guess)
    assert regions[0].accepts(regions[0].key)
    assert calls == [(guess, regions[0].key), (regions[0].key, regions[0].key)]
