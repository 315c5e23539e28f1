"""Errors raised by the data plane.

Hierarchy::

    TransferError
    ├── UnknownRegionError        a region id nobody registered (or learned through connect)
    ├── AccessDeniedError         a region named with a wrong or missing key
    ├── OutOfBoundsError          an entry reaches past the end of its region
    ├── RegionExistsError         a region id whose shared memory already exists
    ├── RegionInUseError          a region closed while views of its memory are alive
    ├── PeerLostError             the remote side went away in the middle of a transfer
    ├── TransferTimeoutError      a transfer took longer than the transport's timeout
    └── TransportUnavailableError a transport that cannot run on this host

A failed batch may have moved some of its bytes (a peer that dies mid-write leaves part of
the remote range written), but a batch rejected for a bad entry moves none: transports check
every entry before the first byte moves.
"""

from __future__ import annotations

__all__ = [
    "AccessDeniedError",
    "OutOfBoundsError",
    "PeerLostError",
    "RegionExistsError",
    "RegionInUseError",
    "TransferError",
    "TransferTimeoutError",
    "TransportUnavailableError",
    "UnknownRegionError",
]


class TransferError(Exception):
    """Base class of every error raised by ``dualpath.transfer``."""


class UnknownRegionError(TransferError):
    """Raised when a batch names a region the serving side does not know.

    The initiator raises it for a region it never learned through ``Transport.connect``; the
    server answers it for a region that was never registered or has been deregistered; the
    shared-memory transport raises it when the region's segment does not exist.
    """

    def __init__(self, region_id: str, detail: str = "") -> None:
        self.region_id = region_id
        self.detail = detail
        suffix = f" ({detail})" if detail else ""
        super().__init__(f"unknown memory region {region_id!r}{suffix}")


class AccessDeniedError(TransferError):
    """Raised when a batch names a region with a key other than the one its descriptor
    handed out (the region's rkey, in RDMA terms).

    The tcp server answers it, before any byte of the region is read or written, for a
    request whose region table carries a wrong or missing key; the shared-memory transport
    raises it from ``connect`` for a descriptor whose key is not the segment's. A descriptor
    kept from before its owner re-created the region (a restart) ends here too: the new region
    has a new key.
    """

    def __init__(self, region_id: str, detail: str = "") -> None:
        self.region_id = region_id
        self.detail = detail
        suffix = f" ({detail})" if detail else ""
        super().__init__(f"access to memory region {region_id!r} refused: wrong or missing key{suffix}")


class OutOfBoundsError(TransferError):
    """Raised when an entry's ``[offset, offset + length)`` is not inside its region.

    Checked on both sides: by the initiator against the local region and the remote
    descriptor, and again by the server; nothing of the batch is moved.
    """

    def __init__(self, region_id: str, offset: int, length: int, size: int) -> None:
        self.region_id = region_id
        self.offset = offset
        self.length = length
        self.size = size
        super().__init__(f"range [{offset}, {offset + length}) is outside region {region_id!r} of {size} bytes")


class RegionExistsError(TransferError):
    """Raised by ``MemoryRegion.create`` when the region's shared memory already exists.

    Either another live region uses the same id on this host, or a crashed process left the
    segment behind (remove it with ``MemoryRegion.attach(...).unlink()``).
    """

    def __init__(self, region_id: str, shm_name: str) -> None:
        self.region_id = region_id
        self.shm_name = shm_name
        super().__init__(f"region {region_id!r} already exists as shared memory {shm_name!r}")


class RegionInUseError(TransferError):
    """Raised by ``MemoryRegion.close`` while numpy arrays, tensors or memoryviews of the
    region's memory are still alive (unmapping would leave them dangling)."""

    def __init__(self, region_id: str) -> None:
        self.region_id = region_id
        super().__init__(f"region {region_id!r} cannot be closed: views of its memory are still alive")


class PeerLostError(TransferError):
    """Raised when the connection to the peer serving a region breaks mid-transfer.

    The peer closed or reset the connection (process killed, host gone), or an RDMA work
    request failed with a transport retry error. Every batch in flight to that peer fails
    with it; the next batch reconnects.
    """

    def __init__(self, peer: str, detail: str = "") -> None:
        self.peer = peer
        self.detail = detail
        suffix = f": {detail}" if detail else ""
        super().__init__(f"lost peer {peer}{suffix}")


class TransferTimeoutError(TransferError):
    """Raised when a batch does not complete within the transport's ``timeout_s``.

    A peer that stops answering without closing its connection (a hung or stopped process)
    ends here instead of hanging the caller.
    """

    def __init__(self, peer: str, timeout_s: float) -> None:
        self.peer = peer
        self.timeout_s = timeout_s
        super().__init__(f"transfer with {peer} did not complete within {timeout_s:g} s")


class TransportUnavailableError(TransferError):
    """Raised by ``create_transport`` (or a transport's ``start``) when the named transport
    cannot run here: an unknown name, pyverbs missing, or no RDMA device."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason
        super().__init__(f"transport {name!r} is unavailable: {reason}")
