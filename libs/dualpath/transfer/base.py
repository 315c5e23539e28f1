"""The transport interface every data-plane transport implements (``factory`` builds them).

A transport serves the memory regions registered with it and moves bytes one-sided: the
initiator names remote ranges and the remote side's code does not take part in the copy
(for ``tcp`` the remote transport's server task does it, for ``verbs`` the HCA, for ``shm``
the initiator's own memcpy). Connection set-up goes through ``RegionDescriptor`` values that
callers pass around over the control plane; bytes never travel that way.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Sequence
from typing import Self

from dualpath.transfer.errors import OutOfBoundsError, UnknownRegionError
from dualpath.transfer.nic import DuplexNic, EmulatedNic, complete, reserve, withdraw
from dualpath.transfer.region import MemoryRegion
from dualpath.transfer.types import RegionDescriptor, TrafficClass, TransferEntry

__all__ = ["Transport", "check_entries"]


class Transport(abc.ABC):
    """One-sided batched reads and writes between registered memory regions.

    Lifecycle: ``await start()``, ``register`` local regions and hand their descriptors to
    peers, ``await connect(descriptor)`` for every remote region to be reached, then
    ``read``/``write``; ``await close()`` at the end. Also usable as ``async with``.
    """

    name: str = ""

    def __init__(self, *, node_id: str, nic: DuplexNic | EmulatedNic | None = None) -> None:
        """``nic``: the emulated NIC this transport's traffic goes through (testbed); a single
        ``EmulatedNic`` is a half-duplex link that reads and writes share."""
        self.node_id = node_id
        self.nic = nic
        self._local: dict[str, MemoryRegion] = {}
        self._remote: dict[str, RegionDescriptor] = {}

    @property
    def nic(self) -> DuplexNic | None:
        """The emulated NIC of this end (None: not emulated)."""
        return self._nic

    @nic.setter
    def nic(self, value: DuplexNic | EmulatedNic | None) -> None:
        self._nic = DuplexNic.half_duplex(value) if isinstance(value, EmulatedNic) else value

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
            raise ValueError(f"descriptor of region {remote.region_id!r} is for transport {remote.transport!r}, not {self.name!r}")
        self._remote[remote.region_id] = remote

    async def read(
        self,
        local: MemoryRegion,
        entries: Sequence[TransferEntry],
        *,
        traffic_class: TrafficClass = TrafficClass.KV,
        peer_nic: DuplexNic | None = None,
    ) -> int:
        """Copy every entry's remote range into ``local``; return the bytes moved once all of
        them have landed.

        With emulated NICs the batch goes through this end's ``nic`` and ``peer_nic`` (the
        NIC that serves the remote memory; this end's own for a loopback copy) in chunks of
        the smaller chunk size, and returns when the last chunk has been sent on every link
        it occupies (bytes / rate of link time, the last chunk included).

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
        return await self._transfer(local, entries, traffic_class, read=True, links=self._nic_links(True, peer_nic))

    async def write(
        self,
        local: MemoryRegion,
        entries: Sequence[TransferEntry],
        *,
        traffic_class: TrafficClass = TrafficClass.KV,
        peer_nic: DuplexNic | None = None,
    ) -> int:
        """Copy every entry's local range to its remote region; return the bytes moved once
        the remote side holds all of them. Paced and raises as ``read``."""
        return await self._transfer(local, entries, traffic_class, read=False, links=self._nic_links(False, peer_nic))

    @abc.abstractmethod
    async def _transfer(
        self,
        local: MemoryRegion,
        entries: Sequence[TransferEntry],
        cls: TrafficClass,
        *,
        read: bool,
        links: tuple[EmulatedNic, ...],
    ) -> int:
        """Move one batch: remote ranges into ``local`` when ``read``, else ``local`` out;
        with emulated ``links`` the move runs under ``_paced``."""

    def _nic_links(self, read: bool, peer: DuplexNic | None) -> tuple[EmulatedNic, ...]:
        """The emulated links one batch occupies (none when neither end is emulated)."""
        if self._nic is not None:
            return self._nic.links(read, peer)
        if peer is not None:
            return (peer.tx if read else peer.rx,)
        return ()

    @staticmethod
    async def _paced(links: tuple[EmulatedNic, ...], total: int, cls: TrafficClass, move: Awaitable[object]) -> None:
        """Run ``move`` (the host moving a checked batch of ``total`` bytes) while the batch's
        chunks are queued on every link at once; return when both are done: the bytes have
        landed and the links have sent the last chunk (bytes / rate of link time)."""
        if not links:
            await move
            return
        futures = reserve(links, total, cls)
        try:
            await move
        except BaseException:
            withdraw(links, futures)
            raise
        await complete(links, futures)

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

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def check_entries(transport: Transport, local: MemoryRegion, entries: Sequence[TransferEntry]) -> int:
    """Check every entry against ``local`` and the known remote descriptors; return the
    batch's byte count.

    Raises:
        UnknownRegionError: an entry names a remote region not learned through ``connect``.
        OutOfBoundsError: an entry reaches outside the local or the remote region.
        ValueError: an entry has a negative length, a count below 1 or overlapping pieces.
    """
    total = 0
    size = local.size
    remote_sizes: dict[str, int] = {}  # per remote region named in the batch: its size
    region, remote_size = None, 0  # the last entry's remote region and its size: a batch names few
    for entry in entries:
        length, count = entry.length, entry.count
        if length < 0:
            raise ValueError(f"entry length must not be negative: {entry}")
        local_offset, remote_offset = entry.local_offset, entry.remote_offset
        if count == 1:  # the common case, without the properties' arithmetic
            local_end, remote_end, nbytes = local_offset + length, remote_offset + length, length
        else:
            if count < 1:
                raise ValueError(f"entry count must be at least 1: {entry}")
            if entry.local_stride < length or entry.remote_stride < length:
                raise ValueError(f"a strided entry's strides must be at least its length (no overlap): {entry}")
            local_end, remote_end, nbytes = entry.local_end, entry.remote_end, entry.nbytes
        if local_offset < 0 or local_end > size:
            raise OutOfBoundsError(local.region_id, local_offset, local_end - local_offset, size)
        if entry.remote_region is not region:
            region = entry.remote_region
            known = remote_sizes.get(region)
            remote_size = remote_sizes[region] = transport.descriptor(region).size if known is None else known
        if remote_offset < 0 or remote_end > remote_size:
            raise OutOfBoundsError(entry.remote_region, remote_offset, remote_end - remote_offset, remote_size)
        total += nbytes
    return total
