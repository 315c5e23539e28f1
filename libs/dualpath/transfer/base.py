"""The transport interface every data-plane transport implements, and its factory.

A transport serves the memory regions registered with it and moves bytes one-sided: the
initiator names remote ranges and the remote side's code does not take part in the copy
(for ``tcp`` the remote transport's server task does it, for ``verbs`` the HCA, for ``shm``
the initiator's own memcpy). Connection set-up goes through ``RegionDescriptor`` values that
callers pass around over the control plane; bytes never travel that way.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dualpath.transfer.errors import (
    OutOfBoundsError,
    TransportUnavailableError,
    UnknownRegionError,
)
from dualpath.transfer.nic import split_entries
from dualpath.transfer.region import MemoryRegion
from dualpath.transfer.types import RegionDescriptor, TrafficClass, TransferEntry

if TYPE_CHECKING:
    from dualpath.transfer.nic import EmulatedNic

__all__ = ["TRANSPORT_NAMES", "Transport", "check_entries", "create_transport"]

TRANSPORT_NAMES = ("tcp", "shm", "verbs")


class Transport(abc.ABC):
    """One-sided batched reads and writes between registered memory regions.

    Lifecycle: ``await start()``, ``register`` local regions and hand their descriptors to
    peers, ``await connect(descriptor)`` for every remote region to be reached, then
    ``read``/``write``; ``await close()`` at the end. Also usable as ``async with``.
    """

    name: str = ""

    def __init__(self, *, node_id: str, nic: EmulatedNic | None = None) -> None:
        self.node_id = node_id
        self.nic = nic
        self._local: dict[str, MemoryRegion] = {}
        self._remote: dict[str, RegionDescriptor] = {}

    @abc.abstractmethod
    async def start(self) -> None:
        """Open the transport's resources (listening socket, device context).

        Raises:
            TransportUnavailableError: the transport cannot run on this host.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Fail in-flight batches, close connections and stop serving (idempotent)."""

    @abc.abstractmethod
    def register(self, region: MemoryRegion) -> RegionDescriptor:
        """Serve ``region`` to peers and return the descriptor they need to reach it.

        Raises:
            ValueError: another region with the same id is registered.
        """

    def deregister(self, region_id: str) -> None:
        """Stop serving ``region_id``; later batches naming it fail with
        ``UnknownRegionError`` (idempotent)."""
        self._local.pop(region_id, None)

    async def connect(self, remote: RegionDescriptor) -> None:
        """Learn a remote region so batches can name it (idempotent; a newer descriptor for
        the same id replaces the old one).

        Raises:
            ValueError: the descriptor belongs to another transport.
            PeerLostError: the peer cannot be reached (transports that connect eagerly).
        """
        if remote.transport != self.name:
            raise ValueError(
                f"descriptor of region {remote.region_id!r} is for transport "
                f"{remote.transport!r}, not {self.name!r}"
            )
        self._remote[remote.region_id] = remote

    async def read(
        self,
        local: MemoryRegion,
        entries: Sequence[TransferEntry],
        *,
        traffic_class: TrafficClass = TrafficClass.KV,
    ) -> int:
        """Copy every entry's remote range into ``local``; return the bytes moved once all of
        them have landed.

        Raises:
            UnknownRegionError: an entry names a region not learned through ``connect`` or
                not served by its peer; nothing is moved (verbs: a region its peer
                deregistered is found only by the HCA, so requests posted before the failed
                one may have landed).
            OutOfBoundsError: an entry reaches outside its local or remote region (as far as
                the descriptor says; the serving side checks again); nothing is moved.
            PeerLostError: the peer went away mid-batch.
            TransferTimeoutError: the batch took longer than the transport's timeout.
        """
        return await self._transfer(local, entries, traffic_class, read=True)

    async def write(
        self,
        local: MemoryRegion,
        entries: Sequence[TransferEntry],
        *,
        traffic_class: TrafficClass = TrafficClass.KV,
    ) -> int:
        """Copy every entry's local range to its remote region; return the bytes moved once
        the remote side holds all of them. Raises as ``read``."""
        return await self._transfer(local, entries, traffic_class, read=False)

    @abc.abstractmethod
    async def _transfer(
        self, local: MemoryRegion, entries: Sequence[TransferEntry], cls: TrafficClass, *, read: bool
    ) -> int:
        """Move one batch: remote ranges into ``local`` when ``read``, else ``local`` out."""

    def _chunks(self, entries: Sequence[TransferEntry]) -> list[list[TransferEntry]]:
        """The batch in the pieces the emulated NIC paces (whole when there is none)."""
        return [list(entries)] if self.nic is None else split_entries(entries, self.nic.chunk_bytes)

    def descriptor(self, region_id: str) -> RegionDescriptor:
        """The descriptor of a remote region learned through ``connect``.

        Raises:
            UnknownRegionError: the region was never connected.
        """
        try:
            return self._remote[region_id]
        except KeyError:
            raise UnknownRegionError(region_id, "not connected on this transport") from None

    def _add_local(self, region: MemoryRegion) -> None:
        current = self._local.get(region.region_id)
        if current is not None and current is not region:
            raise ValueError(f"another region {region.region_id!r} is already registered")
        self._local[region.region_id] = region

    async def __aenter__(self) -> Transport:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def check_entries(
    transport: Transport, local: MemoryRegion, entries: Sequence[TransferEntry]
) -> int:
    """Check every entry against ``local`` and the known remote descriptors; return the
    batch's byte count.

    Raises:
        UnknownRegionError: an entry names a remote region not learned through ``connect``.
        OutOfBoundsError: an entry reaches outside the local or the remote region.
        ValueError: an entry has a negative length, a count below 1 or overlapping pieces.
    """
    total = 0
    for entry in entries:
        if entry.length < 0:
            raise ValueError(f"entry length must not be negative: {entry}")
        if entry.count != 1:
            if entry.count < 1:
                raise ValueError(f"entry count must be at least 1: {entry}")
            if entry.local_stride < entry.length or entry.remote_stride < entry.length:
                raise ValueError(f"a strided entry's strides must be at least its length (no overlap): {entry}")
        local.check_range(entry.local_offset, entry.local_end - entry.local_offset)
        remote = transport.descriptor(entry.remote_region)
        if entry.remote_offset < 0 or entry.remote_end > remote.size:
            raise OutOfBoundsError(remote.region_id, entry.remote_offset, entry.remote_end - entry.remote_offset, remote.size)
        total += entry.nbytes
    return total


def create_transport(
    name: str,
    *,
    node_id: str,
    host: str = "127.0.0.1",
    nic: EmulatedNic | None = None,
    **kw: Any,
) -> Transport:
    """Build the transport ``name`` ("tcp", "shm" or "verbs"); call ``start()`` next.

    ``host`` is the address the tcp server (or the verbs connection manager) listens on;
    extra keywords go to the transport's constructor (e.g. ``timeout_s``, ``port``).

    Raises:
        TransportUnavailableError: unknown name, or verbs without pyverbs / an RDMA device.
    """
    if name == "tcp":
        from dualpath.transfer.tcp import TcpTransport

        return TcpTransport(node_id=node_id, host=host, nic=nic, **kw)
    if name == "shm":
        from dualpath.transfer.shm import ShmTransport

        return ShmTransport(node_id=node_id, nic=nic, **kw)
    if name == "verbs":
        from dualpath.transfer.verbs import VerbsTransport, verbs_available

        ok, reason = verbs_available()
        if not ok:
            raise TransportUnavailableError("verbs", reason)
        return VerbsTransport(node_id=node_id, host=host, nic=nic, **kw)
    raise TransportUnavailableError(name, f"unknown transport; choose one of {TRANSPORT_NAMES}")
