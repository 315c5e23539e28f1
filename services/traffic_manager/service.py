"""traffic-manager service: the node's DRAM buffer, storage reads/writes, data-plane endpoint.

Handlers (subjects ``{ns}.tm.{node}.*``):

- ``alloc``/``free``/``claim``: slots of the buffer, one per request attempt (the DE buffer slot
  is reserved by the scheduler before dispatch, so prefill never waits for room on the decode
  side); an older attempt of a request can never read, write or free a newer one's slot. Their
  lifecycle (placement, use, quarantine of given-up attempts, reclaim of a dead scheduler's
  reservations, retained prefetch runs) is the node core's, ``dualpath.node.slots.NodeBuffer``;
  a persist from a slot that is gone writes nothing (its bytes may be another request's by now);
- ``load``: Full Blocks storage -> buffer (PE read path into the PE buffer, DE read path into
  the DE buffer slot); its queue is the node's ``read_q`` the scheduler balances;
- ``persist``: Full Blocks buffer -> storage (atomic files), then commit to kv-persistence;
- ``describe``: the buffer's region descriptor (connection set-up; bytes never cross NATS);
- ``probe``: whether a load is still running here (``LoadProbe``): the engine awaiting it asks
  every second, so a load lost with this process (killed, restarted) fails fast.

Every ``report_interval`` it publishes a ``NodeReport`` (read queue, buffer room).

A scheduler that accepts a resubmission cancels the old runs of the request at once, so none
keeps writing into its old slot after it is reclaimed (``NodeBuffer``); what stays at risk is a
run of a request nobody resubmitted (its gateway died too) whose prefill is still going
``reclaim_after_s`` after the failover.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time

from anyio.abc import TaskGroup

from dualpath.bus import Bus
from dualpath.bus.client import HandlerError
from dualpath.config import (
    BusConfig,
    EmulationConfig,
    NodeConfig,
    add_arguments,
    from_args,
)
from dualpath.kv import BlockStore
from dualpath.node import BufferFullError, BufferPool, StorageIO
from dualpath.node.prefetch import PrefetchCache
from dualpath.node.slots import RECLAIM_AFTER_S, NodeBuffer, Reclaimed, slot_key
from dualpath.node.storage_io import BlockFormat
from dualpath.protocol import ProtocolError, decode
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from dualpath.protocol.timeouts import TIMEOUTS
from dualpath.runtime import run_service, start_logged
from dualpath.telemetry.logs import get_logger
from dualpath.telemetry.metrics import nic_observations, observe
from dualpath.telemetry.tracing import get_tracer
from dualpath.transfer import MemoryRegion, create_transport
from dualpath.transfer.nic import EmulatedNic
from services.traffic_manager.prefetcher import Prefetcher

log = get_logger("traffic-manager")
tracer = get_tracer("dualpath.traffic_manager")


class TrafficManager:
    def __init__(
        self,
        bus: Bus,
        cfg: NodeConfig,
        subjects: Subjects,
        region: MemoryRegion,
        descriptor,
        storage: StorageIO,
        reclaim_after_s: float = RECLAIM_AFTER_S,
    ) -> None:
        self.bus, self.cfg, self.subjects = bus, cfg, subjects
        self.region = region
        self.descriptor = descriptor
        pool = BufferPool(region.size)
        # The request buffer (what the scheduler plans with): requests' slots hold at most this
        # much of the region; the rest (``--prefetch-mb``, beside it) is for staged prefetch runs.
        buffer_bytes = region.size - (cfg.prefetch_mb << 20)
        if buffer_bytes <= 0:
            raise ValueError(f"region of {region.size} bytes leaves no request buffer beside a {cfg.prefetch_mb} MiB prefetch cache")
        self.io = storage
        # Agent-aware prefetch (a hint): staged runs are slots of the same region, beside the
        # request buffer (at most ``prefetch_mb`` of them), given up first whenever a request
        # needs physical room the runs hold.
        cache = PrefetchCache(pool, region.buf, cfg.prefetch_mb << 20, cfg.prefetch_ttl_s) if cfg.prefetch_mb > 0 else None
        self.prefetcher = Prefetcher(storage, cache) if cache is not None else None
        # The slots' lifecycle (placement, use, quarantine, reclaim, retained runs): the node core.
        self.buffer = NodeBuffer(pool, buffer_bytes, cache, reclaim_after_s=reclaim_after_s)
        self.clock = time.monotonic  # of reservations and scheduler changes
        self._loads: dict[str, int] = {}  # slot key -> load handlers running (``probe``'s answer)

    @property
    def pool(self) -> BufferPool:
        return self.buffer.pool

    @property
    def buffer_bytes(self) -> int:
        return self.buffer.buffer_bytes

    @property
    def reclaim_after_s(self) -> float:
        return self.buffer.reclaim_after_s

    @property
    def reclaimed(self) -> int:
        return self.buffer.reclaimed

    def sweep(self) -> None:
        """Periodic upkeep (every report): quarantined slots whose time is up, and ``reclaim``."""
        self._log_reclaimed(self.buffer.sweep(self.clock()))

    def on_scheduler(self, instance: str) -> None:
        """The active scheduler's heartbeat named ``instance`` (``Subjects.sched_alive``)."""
        self.buffer.on_scheduler(instance, self.clock())

    def reclaim(self) -> list[str]:
        """Give back the reservations of inactive scheduler instances (``NodeBuffer.reclaim``); their keys."""
        return self._log_reclaimed(self.buffer.reclaim(self.clock()))

    def _log_reclaimed(self, gone: list[Reclaimed]) -> list[str]:
        for r in gone:
            log.warning("reservation_reclaimed", slot=r.key, instance=r.instance, active=self.buffer.scheduler, outcome=r.outcome)
        return [r.key for r in gone]

    def _slot_view(self, offset: int, nbytes: int) -> memoryview:
        self.region.check_range(offset, nbytes)
        return self.region.buf[offset : offset + nbytes]

    async def alloc(self, req: m.AllocRequest) -> m.AllocReply:
        if req.blocks * req.block_bytes > self.buffer_bytes:
            raise HandlerError(
                400,
                f"request {req.request_id} needs {req.blocks * req.block_bytes} bytes, more than node "
                f"{self.cfg.node_id}'s whole {self.buffer_bytes}-byte buffer",
            )
        try:  # a scheduler's reservation names its instance: claimed by the hand-off or the persist
            slot = self.buffer.alloc(req.request_id, req.attempt, req.blocks * req.block_bytes, instance=req.instance, now=self.clock())
        except BufferFullError as exc:
            raise HandlerError(m.BUFFER_FULL, str(exc)) from None
        return m.AllocReply(region=self.descriptor.to_wire(), offset=slot.offset, nbytes=slot.nbytes)

    async def free(self, req: m.FreeRequest) -> m.Ok:
        """The slot of ``(request_id, attempt)``, or of every attempt below ``before_attempt``."""
        if req.before_attempt < 0:
            return m.Ok(detail=self.buffer.free(req.request_id, req.attempt))
        older = self.buffer.give_up_below(req.request_id, req.before_attempt, self.clock())  # out of reuse for a while
        return m.Ok(detail=f"quarantined {older}" if older else "no slot")

    async def load(self, req: m.LoadRequest) -> m.LoadReply:
        key = slot_key(req.request_id, req.attempt)
        self._loads[key] = self._loads.get(key, 0) + 1
        try:
            return await self._load(req)
        finally:
            left = self._loads.pop(key) - 1
            if left:
                self._loads[key] = left

    async def probe(self, req: m.LoadProbe) -> m.LoadProbeReply:
        """Whether the load of ``(request_id, attempt)`` runs here (a new process never has it)."""
        return m.LoadProbeReply(running=slot_key(req.request_id, req.attempt) in self._loads)

    async def _load(self, req: m.LoadRequest) -> m.LoadReply:
        fmt = BlockFormat(
            layers=req.layers,
            block_tokens=req.block_tokens,
            bytes_per_token_layer=req.bytes_per_token_layer,
            dtype=req.dtype,
            kv_layout=req.kv_layout,
        )
        if self.prefetcher is not None:
            self.prefetcher.fmt = fmt
        key = slot_key(req.request_id, req.attempt)
        slot = self.pool.get(key)
        if slot is None:
            if not req.allocate:
                raise HandlerError(404, f"request {req.request_id} has no buffer slot on node {self.cfg.node_id}")
            if max(req.total_blocks, len(req.hashes)) * fmt.block_bytes > self.buffer_bytes:
                raise HandlerError(400, f"request {req.request_id}'s KV is larger than node {self.cfg.node_id}'s whole buffer")
            try:
                slot = self.buffer.alloc(req.request_id, req.attempt, max(req.total_blocks, len(req.hashes)) * fmt.block_bytes)
            except BufferFullError as exc:
                raise HandlerError(m.BUFFER_FULL, str(exc)) from None
        need = len(req.hashes) * fmt.block_bytes
        skip = max(req.first_block, 0) * fmt.block_bytes  # a split read's DE share starts past the PE share's blocks
        if skip + need > slot.nbytes:
            raise HandlerError(
                400, f"blocks {req.first_block}..{req.first_block + len(req.hashes)} do not fit the request's {slot.nbytes}-byte slot"
            )
        attrs = {"node": self.cfg.node_id, "blocks": len(req.hashes), "bytes": need, "request_id": req.request_id}
        with tracer.start_as_current_span("storage.read", attributes=attrs) as span:
            view = self._slot_view(slot.offset + skip, max(need, 0))
            cache = self.prefetcher.cache if self.prefetcher is not None else None
            staged = cache.take_prefix(req.model_digest, req.hashes, fmt.block_bytes, view) if cache is not None else 0
            with self.buffer.using(key):
                res = await self.io.read_blocks(req.model_digest, req.hashes[staged:], fmt, view[staged * fmt.block_bytes :])
            if staged:  # the leading blocks came from the prefetch cache (a memory copy, no storage read)
                res = dataclasses.replace(res, loaded=staged + res.loaded)
                span.set_attribute("prefetched_blocks", staged)
            if skip == 0 and res.loaded:  # the slot's leading blocks, verified: it may be retained
                self.buffer.loaded(key, req.model_digest, req.hashes[: res.loaded], fmt.block_bytes)
            if span.is_recording():
                span.set_attributes(
                    {
                        "loaded_blocks": res.loaded,
                        "bytes_read": res.bytes_read,
                        "queue_wait_s": res.queue_wait_s,
                        "read_s": res.read_s,
                        "bad_blocks": len(res.bad),
                    }
                )
        if res.bad:
            log.warning("bad_blocks", request_id=req.request_id, count=len(res.bad))
            await self._drop_from_index(req.model_digest, res.bad)
        return m.LoadReply(
            loaded=res.loaded,
            region=self.descriptor.to_wire(),
            offset=slot.offset,
            bytes_read=res.bytes_read,
            queue_wait_s=res.queue_wait_s,
            read_s=res.read_s,
        )

    async def _drop_from_index(self, digest: int, hashes: list[int]) -> None:
        try:
            await self.bus.request(
                self.subjects.kv_remove, m.RemoveRequest(model_digest=digest, hashes=hashes), m.Ok, timeout=TIMEOUTS.kv_remove
            )
        except Exception as exc:  # noqa: BLE001 - the index heals on the next failed read anyway
            log.warning("index_remove_failed", error=str(exc))

    async def persist(self, req: m.PersistRequest) -> m.Ok:
        fmt = BlockFormat(
            layers=req.layers,
            block_tokens=req.block_tokens,
            bytes_per_token_layer=req.bytes_per_token_layer,
            dtype=req.dtype,
            kv_layout=req.kv_layout,
        )
        if req.region_id != self.region.region_id:
            raise HandlerError(404, f"region {req.region_id} is not this node's buffer")
        if self.prefetcher is not None:
            self.prefetcher.fmt = fmt
        key = slot_key(req.request_id, req.attempt)
        self.buffer.claim(req.request_id, req.attempt)  # the decode engine took its KV in
        slot = self.pool.get(key)
        nbytes = len(req.hashes) * fmt.block_bytes
        if req.hashes and (slot is None or not slot.offset <= req.offset <= req.offset + nbytes <= slot.offset + slot.nbytes):
            # its slot was given back (a retry, a reclaim): the bytes there may be another request's
            log.warning("persist_without_slot", request_id=req.request_id, attempt=req.attempt, blocks=len(req.hashes))
            if req.free_after:
                self.buffer.release(key)
            return m.Ok(detail="no slot")
        persisted = False
        try:
            if req.hashes:
                src = self._slot_view(req.offset, len(req.hashes) * fmt.block_bytes)
                attrs = {
                    "node": self.cfg.node_id,
                    "blocks": len(req.hashes),
                    "bytes": len(req.hashes) * fmt.block_bytes,
                    "request_id": req.request_id,
                }
                with tracer.start_as_current_span("storage.write", attributes=attrs), self.buffer.using(key):
                    await self.io.write_blocks(req.model_digest, req.hashes, fmt, src)
                # the index needs only the parent of the new blocks, not the whole chain (which grows with the context)
                chain = [*req.parent_chain[-1:], *req.hashes]
                with tracer.start_as_current_span("kv.commit", attributes={"blocks": len(req.hashes)}):
                    commit = m.CommitRequest(model_digest=req.model_digest, hashes=chain, start=min(1, len(req.parent_chain)))
                    await self.bus.request(self.subjects.kv_commit, commit, m.Ok, timeout=TIMEOUTS.kv_commit)
            persisted = True
        finally:
            if req.free_after:
                if persisted:  # a DE read path's slot may stay as a prefetch run of the whole prompt
                    self.buffer.keep_prompt(key, req.model_digest, req.parent_chain, req.hashes, req.offset, fmt.block_bytes)
                self.buffer.release(key)
        return m.Ok(detail=f"persisted {len(req.hashes)}")

    async def claim(self, req: m.SlotClaimed) -> None:
        """A decode engine took the hand-off of this slot: it is in use (see the module docstring)."""
        self.buffer.claim(req.request_id, req.attempt)

    async def on_scheduler_alive(self, raw) -> None:
        """NATS callback of the scheduler's heartbeat (``SubmitReply`` naming its instance)."""
        try:
            beat = decode(raw.data, m.SubmitReply)
        except ProtocolError as exc:
            log.warning("bad_scheduler_heartbeat", error=exc.reason)
            return
        self.on_scheduler(beat.instance)

    async def describe(self, _req: m.DescribeRequest) -> m.DescribeReply:
        return m.DescribeReply(node_id=self.cfg.node_id, regions=[self.descriptor.to_wire()])

    def report(self) -> m.NodeReport:
        return m.NodeReport(
            node_id=self.cfg.node_id,
            read_q_tokens=self.io.read_q_tokens,
            read_q_bytes=self.io.read_q_bytes,
            buffer_free_bytes=self.buffer.room(),  # the largest slot it can place (staged runs are not the requests' room)
            buffer_bytes=self.buffer_bytes,
            regions=[self.descriptor.to_wire()],
            bytes_read=self.io.bytes_read,
            bytes_written=self.io.bytes_written,
            prefetch=self._prefetch_stats(),
            ts=time.time(),
        )

    def request_bytes(self) -> int:
        """Bytes of the region held by requests' slots (not by staged prefetch runs)."""
        return self.buffer.request_bytes()

    def _prefetch_stats(self) -> dict:
        p = self.prefetcher
        if p is None:
            return {}
        return {
            **p.cache.stats.to_dict(),
            "prefetch_cached_bytes": p.cache.bytes,
            "prefetch_peak_bytes": p.cache.peak_bytes,
            "prefetch_read_bytes": p.bytes_read,
            "prefetch_hints": p.hints,
        }

    async def prefetch(self, req: m.PrefetchRequest) -> None:
        """A session's blocks to stage while idle (dropped when prefetch is off)."""
        if self.prefetcher is not None:
            self.prefetcher.stage(req)


def register_metrics(tm: TrafficManager) -> None:
    """The node's storage read queue, buffer occupancy, storage bytes and SNIC (read at scrape time)."""
    node = {"node": tm.cfg.node_id}
    io = tm.io
    observe("dualpath.storage.read_q", "hit tokens queued for reading from storage (read_q)", lambda: [(io.read_q_tokens, node)])
    observe("dualpath.storage.read_q_bytes", "bytes queued for reading from storage", lambda: [(io.read_q_bytes, node)], unit="By")
    observe(
        "dualpath.storage.bytes",
        "bytes moved between storage and the node buffer",
        lambda: [(io.bytes_read, {**node, "direction": "read"}), (io.bytes_written, {**node, "direction": "write"})],
        unit="By",
        kind="counter",
    )
    observe(
        "dualpath.buffer.used",
        "bytes of the node DRAM buffer held by requests",
        lambda: [(tm.request_bytes(), node)],
        unit="By",
    )
    observe(
        "dualpath.buffer.prefetch",
        "bytes of the node's DRAM held by staged prefetch runs (beside the request buffer)",
        lambda: [(tm.buffer.prefetch_bytes, node)],
        unit="By",
    )
    observe("dualpath.buffer.size", "bytes of the node DRAM buffer for requests", lambda: [(tm.buffer_bytes, node)], unit="By")
    nic_observations(lambda: [n for n in (io.nic, io.write_nic) if n is not None])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dualpath service traffic-manager", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p, BusConfig)
    add_arguments(p, NodeConfig)
    add_arguments(p, EmulationConfig, skip=("compute", "gpu", "cnic_gbps"))
    return p


def storage_io(cfg: NodeConfig, emu: EmulationConfig) -> StorageIO:
    """The node's storage I/O: through an emulated SNIC (both directions) when one is configured."""
    read_nic = write_nic = None
    if emu.snic_gbps:
        profile = emu.profile()
        rate = profile.snic_bytes_per_s(emu.engines())
        chunk = profile.nic_chunk_bytes(rate)
        read_nic = EmulatedNic(rate, name=f"{cfg.node_id}-snic-read", chunk_bytes=chunk)
        write_nic = EmulatedNic(rate, name=f"{cfg.node_id}-snic-write", chunk_bytes=chunk)
    store = BlockStore(cfg.storage, fsync=cfg.storage_fsync, direct=cfg.storage_direct)
    return StorageIO(store, read_nic=read_nic, write_nic=write_nic, oracle=emu.oracle)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    bus_cfg, cfg, emu = from_args(BusConfig, ns), from_args(NodeConfig, ns), from_args(EmulationConfig, ns)
    subjects = Subjects(bus_cfg.namespace)

    async def serve(bus: Bus, stop: asyncio.Event, tasks: TaskGroup) -> None:
        # one registered region: the request buffer, then the prefetch cache beside it
        region = MemoryRegion(f"{bus_cfg.namespace}-{cfg.node_id}-buf", (cfg.buffer_mb + cfg.prefetch_mb) << 20)
        transport = create_transport(cfg.transport, node_id=cfg.node_id, host=cfg.data_host, data_tls=cfg.data_tls_config())
        await transport.start()
        descriptor = transport.register(region)
        tm = TrafficManager(bus, cfg, subjects, region, descriptor, storage_io(cfg, emu), reclaim_after_s=cfg.reclaim_after_s)
        register_metrics(tm)
        for topic, handler, msg in (
            ("alloc", tm.alloc, m.AllocRequest),
            ("free", tm.free, m.FreeRequest),
            ("load", tm.load, m.LoadRequest),
            ("persist", tm.persist, m.PersistRequest),
            ("describe", tm.describe, m.DescribeRequest),
            ("claim", tm.claim, m.SlotClaimed),
            ("probe", tm.probe, m.LoadProbe),
        ):
            await bus.serve(subjects.tm(cfg.node_id, topic), handler, msg)
        await bus.subscribe_raw(subjects.sched_alive, tm.on_scheduler_alive)
        if tm.prefetcher is not None:
            await bus.serve(subjects.tm(cfg.node_id, "prefetch"), tm.prefetch, m.PrefetchRequest)
            start_logged(tasks, "prefetch", tm.prefetcher.run, stop)  # in the service's task group; ends with stop
        log.info(
            "traffic_manager_ready",
            node=cfg.node_id,
            buffer_mb=cfg.buffer_mb,
            prefetch_mb=cfg.prefetch_mb,
            transport=cfg.transport,
            data_tls=cfg.data_tls,
        )
        try:
            while not stop.is_set():
                tm.sweep()
                await bus.publish(subjects.node_report(cfg.node_id), tm.report())
                try:
                    await asyncio.wait_for(stop.wait(), cfg.report_interval)
                except TimeoutError:
                    pass
        finally:
            if tm.prefetcher is not None:
                log.info("prefetch_stats", node=cfg.node_id, **tm._prefetch_stats())  # the experiments read these
            await transport.close()
            region.close()
            region.unlink()

    return run_service("traffic-manager", bus_cfg, serve)
