"""kv-persistence service: wires the ``BlockIndex`` to its NATS subjects.

The index only records which blocks are durable; block files are written and read by the
traffic managers. Commits arrive after the file was fsync'ed and renamed, so an index entry
always names a complete file (a file that is later found corrupt is removed on report).
With ``--capacity-blocks`` set, blocks leaving the index (evicted, or removed as corrupt) have
their files deleted here, after the index no longer names them, so storage stays bounded; this
service must then see the storage root. Deletion and commits are serialised, and a commit
indexes a block only if its file exists: a block evicted while a traffic manager was rewriting
it is simply not indexed (a later miss recomputes it), never indexed without a file.

``--replication jetstream`` runs one of several replicas: the index is replicated through a
JetStream stream (``dualpath.ha.replicated_index``), every replica answers lookups from its
own copy, and a replica that restarts replays the stream before it serves.

Lookups and commits are the index's hot paths (at 1,152 GPUs about 1,400 lookups and 5,200
commit messages a second, see ``dualpath bench index``), so they are served ``inline``
(``Bus.serve``): in the subscription's delivery task, not as one task per message. A lookup is
answered from memory at once; a replicated commit is queued for the next group-committed stream
record (``ReplicatedIndex.submit_commit``) and answered when that record is durable and applied
here. Garbage gets an ``ErrorReply`` (400) as on every other subject, a full queue a ``BUSY`` one.
Commits that need the storage (``--capacity-blocks``) or an fsync'ed local log run as bus tasks
(bounded, ``BUSY`` past the bound).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
from pathlib import Path
from typing import cast

from anyio.abc import TaskGroup

from dualpath.bus import BUSY, Bus, HandlerError, Respond
from dualpath.config import (
    BusConfig,
    KvPersistenceConfig,
    NodeConfig,
    add_arguments,
    from_args,
)
from dualpath.ha.replicated_index import IndexBusyError, ReplicatedIndex, ReplicationError
from dualpath.kv import BlockIndex, BlockStore, unpack_hashes
from dualpath.protocol import encode
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from dualpath.runtime import periodic, run_service
from dualpath.telemetry.logs import get_logger
from dualpath.telemetry.metrics import observe
from dualpath.telemetry.tracing import get_tracer, tracing_enabled

log = get_logger("kv-persistence")
tracer = get_tracer("dualpath.kv_persistence")
_OK = encode(m.Ok())


class KvPersistence:
    """Request handlers over one ``BlockIndex`` (local log) or ``ReplicatedIndex`` (lookups are in-loop)."""

    def __init__(self, index: BlockIndex | ReplicatedIndex, store: BlockStore | None = None) -> None:
        self.index = index
        self.store = store  # where evicted and removed blocks' files are deleted (None: leave them)
        self.deleted = 0  # block files deleted
        self._files = threading.Lock()  # commits vs deletions (both run in worker threads)
        self.looked_up = 0  # blocks asked about (the hit rate's denominator)
        self.hits = 0  # of which persisted
        self._hit_replies: dict[int, bytes] = {}  # encoded LookupReply by hit length (few distinct values)

    @property
    def commits_inline(self) -> bool:
        """Whether commits can be served inline: replicated, and no files to check or delete."""
        return self.store is None and isinstance(self.index, ReplicatedIndex)

    async def serve(self, bus: Bus, subjects: Subjects) -> None:
        """Subscribe the handlers (one NATS queue group for every replica); returns once served."""
        await bus.serve(subjects.kv_lookup, self.lookup, m.LookupRequest, queue="kvp", inline=True)
        if self.commits_inline:
            await bus.serve(subjects.kv_commit, self.commit_inline, m.CommitRequest, queue="kvp", inline=True)
        else:
            await bus.serve(subjects.kv_commit, self.commit, m.CommitRequest, queue="kvp")
        await bus.serve(subjects.kv_remove, self.remove, m.RemoveRequest, queue="kvp")

    # ---- hot paths: inline handlers, run in the subscription's delivery task ----------------
    async def lookup(self, req: m.LookupRequest, _respond: Respond) -> bytes:
        """The persisted prefix of ``req.hashes``, answered from memory (no await).

        Raises:
            HandlerError: 400 when a hash the bisection probes cannot be one (e.g. a list), or
                packed hashes are not a whole number of u64s.
        """
        try:
            chain = unpack_hashes(req.hashes) if isinstance(req.hashes, bytes) else req.hashes
            if tracing_enabled():
                with tracer.start_as_current_span("index.lookup") as span:
                    hit = self.index.longest_prefix(req.model_digest, chain)
                    span.set_attributes({"blocks": len(chain), "hit_blocks": hit})
            else:  # no span at all: even a no-op one costs a few microseconds per lookup
                hit = self.index.longest_prefix(req.model_digest, chain)
        except (TypeError, ValueError) as exc:  # an unhashable element, or packed bytes cut mid-hash
            raise HandlerError(400, str(exc)) from None
        self.looked_up += len(chain)
        self.hits += hit
        answer = self._hit_replies.get(hit)
        if answer is None:
            answer = encode(m.LookupReply(hit_blocks=hit))
            if len(self._hit_replies) < 65_536:
                self._hit_replies[hit] = answer
        return answer

    async def commit_inline(self, req: m.CommitRequest, respond: Respond) -> None:
        """Queue a commit for the next stream record; ``respond`` gets ``Ok`` once it is durable
        and applied here (``ReplicatedIndex.submit_commit``), ``BUSY`` if it was not stored.

        Raises:
            HandlerError: 400 for bad hashes or ``start``; ``BUSY`` when the queue is full.
        """
        assert isinstance(self.index, ReplicatedIndex)
        span = tracer.start_span("index.commit", attributes={"blocks": len(req.hashes) - req.start}) if tracing_enabled() else None

        async def done(error: BaseException | None) -> None:
            if span is not None:
                span.end()
            await respond(_OK if error is None else m.ErrorReply(code=BUSY, message=str(error)))

        try:
            self.index.submit_commit(req.model_digest, req.hashes, done, start=req.start)  # no store: evictions leave files
        except (TypeError, ValueError, IndexBusyError) as exc:
            if span is not None:
                span.end()
            raise HandlerError(BUSY if isinstance(exc, IndexBusyError) else 400, str(exc)) from None

    # ---- bus tasks: commits that check files or append to the local log, removals ----------

    async def commit(self, req: m.CommitRequest) -> m.Ok:
        """Index the blocks (checking their files first when there is a store); durable when it returns.

        Raises:
            HandlerError: 400 for bad hashes or ``start``; ``BUSY`` when the change was not
                replicated (the client may retry); 500 when the local log could not be written.
        """
        try:
            with tracer.start_as_current_span("index.commit", attributes={"blocks": len(req.hashes) - req.start}):
                if isinstance(self.index, ReplicatedIndex):
                    gone = await self._commit_replicated(req)
                else:  # the log append is fsync'ed: run it off the event loop
                    gone = await asyncio.to_thread(self._commit, req)
        except (TypeError, ValueError) as exc:
            raise HandlerError(400, str(exc)) from None
        except ReplicationError as exc:  # not stored (or queue full): the client may retry
            raise HandlerError(BUSY, f"{type(exc).__name__}: {exc}") from None
        except OSError as exc:
            raise HandlerError(500, f"{type(exc).__name__}: {exc}") from None
        await self._delete(req.model_digest, gone)
        return m.Ok()

    async def _commit_replicated(self, req: m.CommitRequest) -> list[int]:
        assert isinstance(self.index, ReplicatedIndex)
        end = len(req.hashes)
        if self.store is not None:  # index only blocks whose files exist (see the module docstring)
            end = await asyncio.to_thread(self._existing_end, req)
        gone = await self.index.commit(req.model_digest, req.hashes[:end], start=req.start) if end > req.start else []
        return gone + list(req.hashes[end:])

    def _existing_end(self, req: m.CommitRequest) -> int:
        assert self.store is not None
        end = req.start
        while end < len(req.hashes) and self.store.exists(req.model_digest, req.hashes[end]):
            end += 1
        return end

    def _commit(self, req: m.CommitRequest) -> list[int]:
        assert isinstance(self.index, BlockIndex)
        if self.store is None:
            return self.index.commit(req.model_digest, req.hashes, start=req.start)
        with self._files:
            end = self._existing_end(req)
            gone = self.index.commit(req.model_digest, req.hashes[:end], start=req.start) if end > req.start else []
            return gone + list(req.hashes[end:])  # blocks after a missing file are unreachable: their files go too

    async def remove(self, req: m.RemoveRequest) -> m.Ok:
        if isinstance(self.index, ReplicatedIndex):
            gone = await self.index.remove(req.model_digest, req.hashes)
        else:
            gone = await asyncio.to_thread(self.index.remove, req.model_digest, req.hashes)
        log.warning("blocks_removed", count=len(gone))
        await self._delete(req.model_digest, gone)
        return m.Ok()

    async def _delete(self, model_digest: int, hashes: list[int]) -> None:
        if self.store is None or not hashes:
            return

        def delete() -> int:
            with self._files:
                return cast(BlockStore, self.store).delete_many(model_digest, self.index.unindexed(model_digest, hashes))

        try:
            self.deleted += await asyncio.to_thread(delete)
        except OSError as exc:  # the index is right either way; a left-over file only costs space
            log.warning("block_delete_failed", error=str(exc), blocks=len(hashes))


async def _compact(index: ReplicatedIndex, holder: str) -> None:
    await index.maybe_compact(holder)


def register_metrics(svc: KvPersistence) -> None:
    """Index size and the lookup hit rate in blocks (read at scrape time)."""
    observe("dualpath.index.blocks", "blocks recorded as persisted", lambda: [(len(svc.index), {})])
    observe(
        "dualpath.index.lookup_blocks",
        "blocks looked up, and how many were hits",
        lambda: [(svc.looked_up, {"result": "asked"}), (svc.hits, {"result": "hit"})],
        kind="counter",
    )
    observe(
        "dualpath.index.hit_rate",
        "persisted fraction of the blocks looked up",
        lambda: [(svc.hits / svc.looked_up if svc.looked_up else 0.0, {})],
        unit="1",
    )
    observe("dualpath.index.deleted_blocks", "block files deleted after eviction or removal", lambda: [(svc.deleted, {})], kind="counter")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpath service kv-persistence", description=__doc__)
    add_arguments(p, BusConfig)
    add_arguments(p, KvPersistenceConfig)
    p.add_argument("--storage", default=None, help="storage root (the index lives in it unless --index-path) [env DUALPATH_STORAGE]")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    bus_cfg = from_args(BusConfig, ns)
    cfg = from_args(KvPersistenceConfig, ns)
    storage = from_args(NodeConfig, None, storage=ns.storage).storage
    index_path = cfg.index_path or os.path.join(storage, "index.log")
    if cfg.replication == "none":
        Path(index_path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the index names every block: the owner's alone
    subjects = Subjects(bus_cfg.namespace)

    if cfg.replication not in ("none", "jetstream"):
        print(f"kv-persistence: --replication must be none or jetstream, not {cfg.replication!r}")
        return 2

    async def open_index(bus: Bus) -> BlockIndex | ReplicatedIndex:
        if cfg.replication == "jetstream":
            index = ReplicatedIndex(bus.nc.jetstream(), bus_cfg.namespace, subjects.kv_log, capacity_blocks=cfg.capacity_blocks or None)
            await index.start(replicas=cfg.stream_replicas)
            return index
        return BlockIndex(index_path, capacity_blocks=cfg.capacity_blocks or None)

    async def serve(bus: Bus, stop: asyncio.Event, _tasks: TaskGroup) -> None:
        index = await open_index(bus)
        svc = KvPersistence(index, BlockStore(storage) if cfg.capacity_blocks else None)
        register_metrics(svc)
        await svc.serve(bus, subjects)
        log.info(  # serving from here on: the bench and the fault tests wait for this line
            "index_loaded",
            blocks=len(index),
            replication=cfg.replication,
            replica=cfg.replica_id,
            path=index_path if cfg.replication == "none" else subjects.kv_log,
        )
        try:
            if isinstance(index, ReplicatedIndex):  # keep the stream short: snapshot and purge (one replica at a time)
                await periodic(stop, 30.0, lambda: _compact(index, f"{bus_cfg.namespace}-kvp{cfg.replica_id}-{os.getpid()}"))
            else:
                await stop.wait()
        finally:
            await bus.stop_serving()  # no new requests; those queued for the stream still get their answer
            if isinstance(index, ReplicatedIndex):
                await index.drain(5.0)
                await index.close()
            else:
                index.close()

    return run_service("kv-persistence", bus_cfg, serve)
