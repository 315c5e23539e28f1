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
commit messages a second, see ``dualpath bench index``), so they are served from plain NATS
subscriptions in their delivery tasks, not as one bus task per message: a lookup is answered
from memory inline; a replicated commit is queued for the next group-committed stream record
(``ReplicatedIndex.submit_commit``) and its reply is published when that record is durable and
applied here. Garbage gets an ``ErrorReply`` (400) as on every other subject, a full queue a
``BUSY`` one. Commits that need the storage (``--capacity-blocks``) or an fsync'ed local log run
in a task of the service's task group.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import cast

from anyio.abc import TaskGroup
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import context as otel_context
from opentelemetry import propagate
from opentelemetry.context import Context

from dualpath.bus import BUSY, DEFAULT_MAX_IN_FLIGHT, Bus
from dualpath.config import (
    BusConfig,
    KvPersistenceConfig,
    NodeConfig,
    add_arguments,
    from_args,
)
from dualpath.ha.replicated_index import IndexBusyError, ReplicatedIndex, ReplicationError
from dualpath.kv import BlockIndex, BlockStore
from dualpath.protocol import ProtocolError, decode, encode
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from dualpath.runtime import periodic, run_service
from dualpath.telemetry.logs import get_logger
from dualpath.telemetry.metrics import observe
from dualpath.telemetry.tracing import get_tracer, tracing_enabled

log = get_logger("kv-persistence")
tracer = get_tracer("dualpath.kv_persistence")
Publish = Callable[[str, bytes], Awaitable[None]]
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
        self._publish: Publish | None = None  # set by ``attach``: how raw handlers reply
        self._tasks: TaskGroup | None = None  # where raw commits that touch storage run
        self._slow = 0  # such commits running now (bounded like a bus subscription)

    def attach(self, publish: Publish, tasks: TaskGroup) -> None:
        """Give the raw handlers (``on_lookup``, ``on_commit``) their reply path and task group."""
        self._publish, self._tasks = publish, tasks

    # ---- hot paths: raw NATS messages, handled in the subscription's delivery task ----------
    async def on_lookup(self, msg: Msg) -> None:
        """Answer a ``LookupRequest`` from memory (no task, no await but the reply's publish)."""
        try:
            req = decode(msg.data, m.LookupRequest)
            if tracing_enabled():
                with tracer.start_as_current_span("index.lookup", context=_parent(msg)) as span:
                    hit = self.index.longest_prefix(req.model_digest, req.hashes)
                    span.set_attributes({"blocks": len(req.hashes), "hit_blocks": hit})
            else:  # no span at all: even a no-op one costs a few microseconds per lookup
                hit = self.index.longest_prefix(req.model_digest, req.hashes)
            self.looked_up += len(req.hashes)
            self.hits += hit
            answer = self._hit_replies.get(hit)
            if answer is None:
                answer = encode(m.LookupReply(hit_blocks=hit))
                if len(self._hit_replies) < 65_536:
                    self._hit_replies[hit] = answer
        except (ProtocolError, TypeError, ValueError) as exc:  # garbage, or hashes that are not ints
            answer = _error(400, exc.reason if isinstance(exc, ProtocolError) else str(exc), msg.subject)
        await self._reply(msg, answer)

    async def on_commit(self, msg: Msg) -> None:
        """Queue a ``CommitRequest`` for the next stream record; the reply goes out once it is
        durable and applied (``ReplicatedIndex.submit_commit``). Commits that must check files
        (a capacity) or append to the local log run in a task instead."""
        try:
            req = decode(msg.data, m.CommitRequest)
        except ProtocolError as exc:
            await self._reply(msg, _error(400, exc.reason, msg.subject))
            return
        if self.store is not None or not isinstance(self.index, ReplicatedIndex):
            assert self._tasks is not None, "attach() first"
            if self._slow >= DEFAULT_MAX_IN_FLIGHT:
                await self._reply(msg, _error(BUSY, f"{self._slow} commits already in flight", msg.subject))
                return
            self._slow += 1
            self._tasks.start_soon(self._commit_and_reply, msg, req, name="kvp:commit")
            return
        span = (
            tracer.start_span("index.commit", context=_parent(msg), attributes={"blocks": len(req.hashes) - req.start})
            if tracing_enabled()
            else None
        )

        async def done(error: BaseException | None) -> None:
            if span is not None:
                span.end()
            await self._reply(msg, _OK if error is None else _error(BUSY, str(error), msg.subject))

        try:
            self.index.submit_commit(req.model_digest, req.hashes, done, start=req.start)  # no store: evictions leave files
        except (TypeError, ValueError, IndexBusyError) as exc:
            if span is not None:
                span.end()
            await self._reply(msg, _error(BUSY if isinstance(exc, IndexBusyError) else 400, str(exc), msg.subject))

    async def _commit_and_reply(self, msg: Msg, req: m.CommitRequest) -> None:
        try:
            token = otel_context.attach(propagate.extract(msg.headers)) if msg.headers else None
            try:
                await self.commit(req)
                answer = _OK
            except (TypeError, ValueError) as exc:
                answer = _error(400, str(exc), msg.subject)
            except Exception as exc:  # noqa: BLE001 - the client is told; the service goes on
                code = BUSY if isinstance(exc, ReplicationError) else 500  # not stored (or queue full): the client may retry
                answer = _error(code, f"{type(exc).__name__}: {exc}", msg.subject)
            finally:
                if token is not None:
                    otel_context.detach(token)
            await self._reply(msg, answer)
        finally:
            self._slow -= 1

    async def _reply(self, msg: Msg, data: bytes) -> None:
        if msg.reply and self._publish is not None:
            try:
                await self._publish(msg.reply, data)
            except Exception as exc:  # noqa: BLE001 - the connection is going; the client times out and retries
                log.warning("reply_failed", error=str(exc))

    # ---- commits and removals as coroutines (the bus path, the raw path's slow commits, tests) ----

    async def commit(self, req: m.CommitRequest) -> m.Ok:
        with tracer.start_as_current_span("index.commit", attributes={"blocks": len(req.hashes) - req.start}):
            if isinstance(self.index, ReplicatedIndex):
                gone = await self._commit_replicated(req)
            else:  # the log append is fsync'ed: run it off the event loop
                gone = await asyncio.to_thread(self._commit, req)
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


def _parent(msg: Msg) -> Context | None:
    """The caller's trace context, carried in the message's headers."""
    return propagate.extract(msg.headers) if msg.headers else None


def _error(code: int, message: str, subject: str) -> bytes:
    if code == 400:
        log.warning("bad_message", subject=subject, error=message)
    return encode(m.ErrorReply(code=code, message=message))


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
        Path(index_path).parent.mkdir(parents=True, exist_ok=True)
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

    async def serve(bus: Bus, stop: asyncio.Event, tasks: TaskGroup) -> None:
        index = await open_index(bus)
        svc = KvPersistence(index, BlockStore(storage) if cfg.capacity_blocks else None)
        svc.attach(bus.nc.publish, tasks)
        register_metrics(svc)
        log.info(
            "index_loaded",
            blocks=len(index),
            replication=cfg.replication,
            replica=cfg.replica_id,
            path=index_path if cfg.replication == "none" else subjects.kv_log,
        )
        raw: list[Subscription] = [
            await bus.nc.subscribe(subjects.kv_lookup, queue="kvp", cb=svc.on_lookup),
            await bus.nc.subscribe(subjects.kv_commit, queue="kvp", cb=svc.on_commit),
        ]
        await bus.serve(subjects.kv_remove, svc.remove, m.RemoveRequest, queue="kvp")
        await bus.nc.flush()  # the server has every subscription before anyone is told we serve
        try:
            if isinstance(index, ReplicatedIndex):  # keep the stream short: snapshot and purge (one replica at a time)
                await periodic(stop, 30.0, lambda: _compact(index, f"{bus_cfg.namespace}-kvp{cfg.replica_id}-{os.getpid()}"))
            else:
                await stop.wait()
        finally:
            for sub in raw:  # no new requests; those queued for the stream still get their answer
                try:
                    await sub.unsubscribe()
                except Exception as exc:  # noqa: BLE001 - the connection may be gone
                    log.debug("unsubscribe_failed", error=str(exc))
            if isinstance(index, ReplicatedIndex):
                await index.drain(5.0)
                await index.close()
            else:
                index.close()

    return run_service("kv-persistence", bus_cfg, serve)
