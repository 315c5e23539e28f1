"""Value types of the data plane: traffic classes, batch entries, region descriptors.

A ``RegionDescriptor`` is what a peer needs to reach a registered region: it travels over
the control plane (NATS, msgpack) as the plain dict ``to_wire()`` returns; the region's bytes
never do. It is also the only thing that hands out the region's key (as RDMA hands out an
rkey with the address it unlocks): keep it out of logs (its ``repr`` leaves the key out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

__all__ = ["DESCRIPTOR_VERSION", "RegionDescriptor", "TrafficClass", "TransferEntry"]

DESCRIPTOR_VERSION = 2  # 2: the region's key


class TrafficClass(IntEnum):
    """The two classes every NIC schedules (the paper's §5, CNIC-centric management).

    ``MODEL`` (model-execution traffic: collectives, layer hand-offs) has strict priority and
    gets its demand; ``KV`` (KV-cache loads and stores) uses all remaining and idle capacity
    and keeps a small guaranteed share so it never starves.
    """

    MODEL = 0
    KV = 1


@dataclass(frozen=True, slots=True)
class TransferEntry:
    """One piece of a batch: ``length`` bytes at ``local_offset`` of the local region and
    ``remote_offset`` of ``remote_region``.

    A strided entry (``count > 1``, like ``cudaMemcpy2D`` or a chained RDMA work-request list)
    stands for ``count`` such pieces, piece ``i`` at ``local_offset + i * local_stride`` and
    ``remote_offset + i * remote_stride``; strides are at least ``length`` (pieces never
    overlap). One layer of a request's cached KV — one Layer Block per Full Block, a block's
    size apart in the slot — is one strided entry, not one entry per block.
    """

    local_offset: int
    remote_region: str
    remote_offset: int
    length: int
    count: int = 1
    local_stride: int = 0
    remote_stride: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes the entry moves (``length * count``)."""
        return self.length * self.count

    @property
    def local_end(self) -> int:
        """One past the last local byte touched."""
        return self.local_offset + (self.count - 1) * self.local_stride + self.length

    @property
    def remote_end(self) -> int:
        """One past the last remote byte touched."""
        return self.remote_offset + (self.count - 1) * self.remote_stride + self.length

    @property
    def local_contiguous(self) -> bool:
        """Whether the local pieces form one contiguous range."""
        return self.count == 1 or self.local_stride == self.length

    @property
    def remote_contiguous(self) -> bool:
        """Whether the remote pieces form one contiguous range."""
        return self.count == 1 or self.remote_stride == self.length

    def pieces(self) -> list[tuple[int, int, int]]:
        """``(local_offset, remote_offset, length)`` of every piece, in order."""
        return [
            (self.local_offset + i * self.local_stride, self.remote_offset + i * self.remote_stride, self.length) for i in range(self.count)
        ]


@dataclass(frozen=True, slots=True, kw_only=True)
class RegionDescriptor:
    """How to reach a registered region: its id, owner node, size, transport, the
    transport-specific ``address`` (host/port for tcp, segment name for shm, QP endpoint and
    rkey for verbs) and the region's ``key`` (``MemoryRegion.key``, 16 random bytes), which
    every tcp request and every shm ``connect`` must present. ``address`` holds only
    msgpack-able values. An empty ``key`` (a descriptor made by hand) is refused by any
    serving side."""

    region_id: str
    node_id: str
    size: int
    transport: str
    address: dict[str, Any] = field(default_factory=dict)
    key: bytes = field(default=b"", repr=False)
    version: int = DESCRIPTOR_VERSION

    def to_wire(self) -> dict[str, Any]:
        """The descriptor as a plain msgpack-able dict."""
        return {
            "v": self.version,
            "region_id": self.region_id,
            "node_id": self.node_id,
            "size": self.size,
            "transport": self.transport,
            "address": dict(self.address),
            "key": self.key,  # msgpack bin
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> RegionDescriptor:
        """Rebuild a descriptor from ``to_wire()`` output.

        Raises:
            ValueError: the dict is from an unknown descriptor version or misses a field.
        """
        version = wire.get("v")
        if version != DESCRIPTOR_VERSION:
            raise ValueError(f"unsupported region descriptor version {version!r}")
        key = wire.get("key", None)
        if not isinstance(key, bytes | bytearray):  # bytes(n) of an int would be n zero bytes
            raise ValueError("region descriptor misses field 'key' (or it is not bytes)")
        try:
            return cls(
                region_id=str(wire["region_id"]),
                node_id=str(wire["node_id"]),
                size=int(wire["size"]),
                transport=str(wire["transport"]),
                address=dict(wire["address"]),
                key=bytes(key),
                version=version,
            )
        except KeyError as exc:
            raise ValueError(f"region descriptor misses field {exc.args[0]!r}") from exc
