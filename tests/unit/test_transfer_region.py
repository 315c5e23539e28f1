"""Memory regions, region descriptors and the transport factory."""

from __future__ import annotations

import subprocess
import sys
import uuid

import msgpack
import numpy as np
import pytest
import torch

from dualpath.transfer import (
    MemoryRegion,
    OutOfBoundsError,
    RegionDescriptor,
    RegionExistsError,
    RegionInUseError,
    TransportUnavailableError,
    UnknownRegionError,
    available_transports,
    create_transport,
)
from dualpath.transfer.verbs import verbs_available


@pytest.fixture
def region():
    r = MemoryRegion(f"test-region-{uuid.uuid4().hex[:12]}", 1 << 16)
    yield r
    r.close()
    r.unlink()


def test_an_attached_region_shares_bytes_with_its_owner(region: MemoryRegion) -> None:
    other = MemoryRegion.attach(region.region_id)
    try:
        region.buf[10:15] = b"hello"
        other.buf[100:103] = b"abc"
        assert bytes(other.buf[10:15]) == b"hello"
        assert bytes(region.buf[100:103]) == b"abc"
        assert other.size == region.size and not other.owner
    finally:
        other.close()


def test_a_second_region_with_the_same_id_is_refused(region: MemoryRegion) -> None:
    with pytest.raises(RegionExistsError, match=region.region_id):
        MemoryRegion(region.region_id, 100)


def test_attaching_a_missing_or_too_small_region_fails_clearly(region: MemoryRegion) -> None:
    with pytest.raises(UnknownRegionError, match="no-such-region"):
        MemoryRegion.attach("no-such-region-" + uuid.uuid4().hex)
    with pytest.raises(OutOfBoundsError):
        MemoryRegion.attach(region.region_id, region.size + 1)


def test_an_attacher_process_that_exits_does_not_remove_the_owners_memory(
    region: MemoryRegion,
) -> None:
    code = "import sys; from dualpath.transfer import MemoryRegion; r = MemoryRegion.attach(sys.argv[1]); r.buf[0:3] = b'xyz'; r.close()"
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code, region.region_id],
        check=False,
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert b"leaked" not in done.stderr  # the resource tracker never saw the attachment
    again = MemoryRegion.attach(region.region_id)  # still there after the attacher left
    try:
        assert bytes(again.buf[0:3]) == b"xyz"
    finally:
        again.close()


def test_an_unlinked_region_cannot_be_attached_but_stays_mapped_for_its_holders() -> None:
    r = MemoryRegion(f"test-region-{uuid.uuid4().hex[:12]}", 4096)
    r.buf[0] = 42
    r.unlink()
    try:
        with pytest.raises(UnknownRegionError):
            MemoryRegion.attach(r.region_id)
        assert r.buf[0] == 42
    finally:
        r.close()


def test_tensor_and_array_views_alias_the_region_without_copying(region: MemoryRegion) -> None:
    t = region.as_tensor(256, 64, torch.float16)  # [32] fp16
    t[:] = 1.5
    a = region.as_array(256, 64, np.float16)
    assert t.shape == (32,) and (a == 1.5).all()
    a[0] = -2.0
    assert t[0].item() == -2.0
    with pytest.raises(OutOfBoundsError):
        region.as_tensor(region.size - 8, 16)
    with pytest.raises(ValueError):
        region.as_tensor(0, 3, torch.float16)


def test_closing_a_region_with_live_views_is_refused_until_they_are_gone(
    region: MemoryRegion,
) -> None:
    view = region.as_tensor(0, 16)
    with pytest.raises(RegionInUseError):
        region.close()
    assert region.buf[0] == 0  # still usable after the refusal
    del view
    region.close()
    assert region.closed


def test_a_descriptor_survives_msgpack_and_refuses_unknown_versions() -> None:
    desc = RegionDescriptor(region_id="r1", node_id="n1", size=4096, transport="tcp", address={"host": "h", "port": 1})
    wire = msgpack.unpackb(msgpack.packb(desc.to_wire()))
    assert RegionDescriptor.from_wire(wire) == desc
    with pytest.raises(ValueError, match="version"):
        RegionDescriptor.from_wire({**wire, "v": 99})
    with pytest.raises(ValueError, match="size"):
        RegionDescriptor.from_wire({k: v for k, v in wire.items() if k != "size"})


def test_the_factory_names_why_a_transport_is_unavailable() -> None:
    with pytest.raises(TransportUnavailableError, match="unknown transport"):
        create_transport("carrier-pigeon", node_id="n")
    ok, reason = verbs_available()
    assert available_transports()["verbs"] == ("" if ok else reason)
    if not ok:
        with pytest.raises(TransportUnavailableError, match="verbs"):
            create_transport("verbs", node_id="n")
