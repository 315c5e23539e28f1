"""``EngineDataPlane``: an engine's view of the data plane.

The engine owns one registered memory region (its transfer window, the stand-in for
RDMA-registered HBM) carved into per-batch windows by a ``BufferPool``. Remote regions are
reached through the node-local transport (shared memory) when they live on this engine's
node, else through the inter-node transport (tcp or verbs). Descriptors arrive over NATS,
fresh with every task (the decode node's ``AllocReply``, the read node's ``LoadReply``): a
descriptor whose address differs from the one in use (a restarted traffic manager listens
on a new port) is connected again, and a transfer that loses its peer forgets the region,
so the next task's descriptor is looked up afresh instead of the dead address being reused.
"""

from __future__ import annotations

import dataclasses

from dualpath.node.buffer import BufferPool
from dualpath.transfer import (
    MemoryRegion,
    PeerLostError,
    RegionDescriptor,
    TrafficClass,
    TransferEntry,
    Transport,
)
from dualpath.transfer.nic import DuplexNic, NicDirectory

__all__ = ["EngineDataPlane"]


class EngineDataPlane:
    def __init__(
        self,
        *,
        node_id: str,
        region: MemoryRegion,
        local: Transport,
        remote: Transport,
        peers: NicDirectory | None = None,
        same_host: bool = False,
    ) -> None:
        """``peers`` finds the emulated CNICs of other engines (testbed), so a transfer to or
        from a decode node's buffer is charged on the decode GPU's CNIC too; ``same_host``:
        every region is on this host (the testbed), so shared memory reaches all of them."""
        self.node_id = node_id
        self.region = region
        self.pool = BufferPool(region.size)
        self._local = local
        self._remote = remote
        self._known: dict[str, tuple[RegionDescriptor, Transport]] = {}  # region id -> the descriptor in use, its transport
        self._peers = peers
        self._same_host = same_host

    async def transport_for(self, desc: RegionDescriptor) -> Transport:
        """The transport that reaches ``desc`` (connecting on first use, and again when the
        region's descriptor changed: its owner restarted elsewhere)."""
        known = self._known.get(desc.region_id)
        if known is not None and known[0] == desc:
            t = known[1]
            if t is self._local:  # re-maps the segment if its owner created it again (same descriptor)
                await t.connect(dataclasses.replace(desc, transport=t.name, address={}))
            return t
        key = desc
        if desc.node_id == self.node_id or self._same_host:
            # Same node (or host): map the owner's shared memory directly, whatever it
            # serves remotely; emulated NICs still charge the modeled link.
            t = self._local
            desc = dataclasses.replace(desc, transport=t.name, address={})
        else:
            t = self._remote
        await t.connect(desc)  # a newer descriptor for the same id replaces the old one
        self._known[desc.region_id] = (key, t)
        return t

    def forget(self, region_id: str) -> None:
        """Stop using what is known of ``region_id`` (its peer was lost): the next transfer
        connects with the descriptor it is given."""
        self._known.pop(region_id, None)

    def peer_nic(self, desc: RegionDescriptor, peer_engine: str = "", nic: DuplexNic | None = None) -> DuplexNic | None:
        """The emulated NIC serving ``desc``'s memory: this engine's own for its node's buffer
        (``nic``; a loopback copy), ``peer_engine``'s CNIC for another node's buffer."""
        if desc.node_id == self.node_id:
            return nic
        if peer_engine and self._peers is not None:
            return self._peers.get(peer_engine)
        return None

    async def read(
        self, desc: RegionDescriptor, entries: list[TransferEntry], *, traffic_class=TrafficClass.KV, peer_engine: str = ""
    ) -> int:
        """Remote ``desc`` -> this engine's region, one batch (one round trip); emulated NICs
        charge this engine's CNIC and the one serving ``desc`` (``peer_nic``)."""
        if not entries:
            return 0
        t = await self.transport_for(desc)
        try:
            return await t.read(self.region, entries, traffic_class=traffic_class, peer_nic=self.peer_nic(desc, peer_engine, t.nic))
        except PeerLostError:
            self.forget(desc.region_id)
            raise

    async def write(
        self, desc: RegionDescriptor, entries: list[TransferEntry], *, traffic_class=TrafficClass.KV, peer_engine: str = ""
    ) -> int:
        """This engine's region -> remote ``desc``, one batch; charged as ``read``."""
        if not entries:
            return 0
        t = await self.transport_for(desc)
        try:
            return await t.write(self.region, entries, traffic_class=traffic_class, peer_nic=self.peer_nic(desc, peer_engine, t.nic))
        except PeerLostError:
            self.forget(desc.region_id)
            raise

    async def close(self) -> None:
        """Close both transports and release the engine region."""
        await self._local.close()
        await self._remote.close()
        self.region.close()
        self.region.unlink()
