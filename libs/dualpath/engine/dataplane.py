"""``EngineDataPlane``: an engine's view of the data plane.

The engine owns one registered memory region (its transfer window, the stand-in for
RDMA-registered HBM) carved into per-batch windows by a ``BufferPool``. Remote regions are
reached through the node-local transport (shared memory) when they live on this engine's
node, else through the inter-node transport (tcp or verbs). Descriptors arrive over NATS.
"""

from __future__ import annotations

import dataclasses

from dualpath.node.buffer import BufferPool
from dualpath.transfer import MemoryRegion, RegionDescriptor, Transport, TransferEntry, TrafficClass

__all__ = ["EngineDataPlane"]


class EngineDataPlane:
    def __init__(self, *, node_id: str, region: MemoryRegion, local: Transport, remote: Transport) -> None:
        self.node_id = node_id
        self.region = region
        self.pool = BufferPool(region.size)
        self._local = local
        self._remote = remote
        self._known: dict[str, Transport] = {}

    async def transport_for(self, desc: RegionDescriptor) -> Transport:
        """The transport that reaches ``desc`` (connecting on first use)."""
        t = self._known.get(desc.region_id)
        if t is None:
            if desc.node_id == self.node_id:
                # Same node: map the owner's shared memory directly, whatever it serves remotely.
                t = self._local
                desc = dataclasses.replace(desc, transport=t.name, address={})
            else:
                t = self._remote
            await t.connect(desc)
            self._known[desc.region_id] = t
        return t

    async def read(self, desc: RegionDescriptor, entries: list[TransferEntry], *, traffic_class=TrafficClass.KV) -> int:
        """Remote ``desc`` -> this engine's region, one batch (one round trip)."""
        if not entries:
            return 0
        t = await self.transport_for(desc)
        return await t.read(self.region, entries, traffic_class=traffic_class)

    async def write(self, desc: RegionDescriptor, entries: list[TransferEntry], *, traffic_class=TrafficClass.KV) -> int:
        """This engine's region -> remote ``desc``, one batch."""
        if not entries:
            return 0
        t = await self.transport_for(desc)
        return await t.write(self.region, entries, traffic_class=traffic_class)

    async def close(self) -> None:
        """Close both transports and release the engine region."""
        await self._local.close()
        await self._remote.close()
        self.region.close()
        self.region.unlink()
