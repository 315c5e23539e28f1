"""The persisted-block index replicated through a NATS JetStream stream.

Every kv-persistence replica holds the whole index in memory and serves lookups from it (the
replicas share one NATS queue group, so any of them answers). Changes are not applied where
they arrive: the replica that receives a commit or a removal appends a *record* to one
JetStream stream, and every replica, itself included, applies the stream's records in stream
order. The sets of indexed blocks are therefore the same on every replica; only LRU recency
(touched by lookups) is local::

    traffic manager --CommitRequest--> any replica --record--> JetStream stream (R3 on a cluster)
                                                                   |  ordered consumers
                                                    replica A <----+----> replica B ...

A commit is answered only after its record is stored by JetStream (acknowledged, on a
majority of the cluster's servers) *and* applied by the replica that answers, so a block the
client was told is committed survives the loss of any one process or server: a restarted
replica replays the stream before it serves. Changes are group-committed: ``submit_commit`` (or
``submit_remove``) queues an op with a completion callback and returns at once; a flusher packs
every queued op (up to ``max_batch_ops``) into one stream message and keeps up to
``publish_window`` of them awaiting JetStream's acknowledgement at a time, so the stream's
message rate stays far below the commit rate and no task or future exists per commit. When the record is acknowledged and applied
here, the callbacks of all its ops run (the service publishes the replies from them). Queued
ops are bounded (``max_pending_ops``); past the bound a submit raises ``IndexBusyError``.
With a capacity, the replica that takes a commit chooses the blocks to evict (its own least
recently used leaves) and writes them into the record, so eviction is also identical
everywhere.

Background work (flushing, publishing, resynchronising) runs in tasks this object tracks;
``close`` cancels them and fails the ops still waiting.

Compaction: when the stream holds more than ``compact_after`` records, one replica at a time
(a JetStream KV lease) writes a snapshot of its index, taken at the stream sequence it has
applied, to a JetStream object store, then purges the records up to that sequence. A replica
starts from the snapshot and follows the stream from the next sequence; one that finds a gap
(records purged before it applied them, e.g. after a long pause) reloads the snapshot.

Record (msgpack map): ``{"v": 1, "ops": [op, ...]}``; an op is ``["c", digest, parent, [new
hashes...], [evicted...]]`` (commit ``new`` under ``parent``, 0 for the root) or ``["r",
digest, [hashes...]]`` (remove them and their descendants).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import msgpack
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError, ObjectNotFoundError

from dualpath.ha.lease import LeaderLease
from dualpath.kv import BlockIndex
from dualpath.kv.hashing import U64_MAX, check_u64
from dualpath.kv.trie import check_chain
from dualpath.protocol.subjects import Subjects
from dualpath.telemetry.logs import get_logger

__all__ = ["RECORD_VERSION", "Done", "IndexBusyError", "ReplicatedIndex", "ReplicationError", "stream_name"]

log = get_logger("kv-index")
RECORD_VERSION = 1
SNAPSHOT = "index"  # the object holding the latest snapshot


class ReplicationError(RuntimeError):
    """Raised when the stream cannot be created or read, or a change was not acknowledged in time."""


class IndexBusyError(ReplicationError):
    """Raised by ``submit`` when ``limit`` ops already wait to be replicated (back-pressure)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"index busy: {limit} changes already wait to be replicated")
        self.limit = limit


Done = Callable[[BaseException | None], Awaitable[None]]  # an op's completion: None once durable and applied here
_Batch = list[tuple[list[Any], Done]]


def stream_name(namespace: str) -> str:
    """The JetStream stream of one deployment's index (named in ``dualpath.protocol.subjects.STORES``)."""
    return Subjects(namespace).kv_index


class ReplicatedIndex:
    """One replica's copy of the index, kept in step with the stream."""

    def __init__(
        self,
        js: JetStreamContext,
        namespace: str,
        subject: str,
        *,
        capacity_blocks: int | None = None,
        max_batch_ops: int = 512,
        publish_window: int = 4,
        max_pending_ops: int = 16_384,
        ack_timeout: float = 10.0,
        compact_after: int = 100_000,
    ) -> None:
        self.js = js
        self._subjects = Subjects(namespace)
        self.stream = self._subjects.kv_index
        self.snapshots = self._subjects.kv_index_snapshots  # object store bucket of the snapshot
        self.compact_after = compact_after
        self.subject = subject
        self.capacity = capacity_blocks
        # unbounded here: evictions come only from records; recency is kept only to choose them
        self.index = BlockIndex(None, track_recency=capacity_blocks is not None)
        self.applied = 0  # stream sequence of the last record applied
        self.records = 0  # stream messages published by this replica
        self.ops = 0  # changes those records carried (ops / records: how well commits are grouped)
        self._max_batch = max_batch_ops
        self._max_pending = max_pending_ops
        self._ack_timeout = ack_timeout
        self._pending: _Batch = []  # ops queued for the next record
        self._waiting = 0  # ops published (or being published) whose record is not applied here yet
        self._in_flight: dict[int, _Batch] = {}  # those ops, by record: ``close`` fails what is left
        self._flushing = False
        self._publish_window = publish_window
        self._window = asyncio.Semaphore(publish_window)  # records awaiting JetStream's ack at once
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []  # heap of (seq, tie, future)
        self._tie = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()  # flusher, publishes, resyncs: cancelled by ``close``
        self._sub: JetStreamContext.PushSubscription | None = None
        self._resyncing = False
        self.resyncs = 0  # snapshot reloads after a gap

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``coro`` as a task this replica owns until it ends or ``close`` cancels it."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- start-up ------------------------------------------------------------------------------
    async def start(self, *, replicas: int = 3, timeout: float = 60.0) -> None:
        """Create the stream if needed, replay it, and follow it.

        ``replicas`` copies of the stream are asked for (fewer on a smaller cluster). Returns
        once every record present at start is applied.

        Raises:
            ReplicationError: JetStream did not answer within ``timeout``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        await self._ensure_stream(replicas, deadline)
        self._replicas = replicas
        while True:
            try:
                last = await self._follow()
                break
            except NotFoundError as exc:
                # A stream just created on a cluster can be "not found" for a moment (seen when
                # two replicas start at once: one created it, the other's next request failed)
                if loop.time() >= deadline:
                    raise ReplicationError(f"stream {self.stream}: not found after it was created: {exc}") from exc
                await asyncio.sleep(0.2)
        if last > self.applied:
            await asyncio.wait_for(self.wait_applied(last), max(1.0, deadline - loop.time()))
        log.info("index_replayed", blocks=len(self.index), applied=self.applied, stream=self.stream)

    async def _follow(self) -> int:
        """Load the snapshot, subscribe from the record after it; returns the stream's last sequence."""
        for attempt in range(100):
            base = await self._load_snapshot()
            info = await self.js.stream_info(self.stream)
            if info.state.messages == 0 or info.state.first_seq <= base + 1:
                break
            if attempt == 99:  # the snapshot is gone: follow what is left rather than never serve
                log.error("index_snapshot_missing", snapshot_seq=base, first_seq=info.state.first_seq)
            await asyncio.sleep(0.1)  # purged past this snapshot: a newer one is being written
        policy: dict[str, Any]
        if base:
            policy = {"deliver_policy": api.DeliverPolicy.BY_START_SEQUENCE, "config": api.ConsumerConfig(opt_start_seq=base + 1)}
        else:
            policy = {"deliver_policy": api.DeliverPolicy.ALL}
        self._sub = await self.js.subscribe(self.subject, stream=self.stream, ordered_consumer=True, cb=self._on_record, **policy)
        return info.state.last_seq

    async def _load_snapshot(self) -> int:
        """Replace the index with the stored snapshot; returns its stream sequence (0: none)."""
        try:
            store = await self.js.object_store(self.snapshots)
            result = await store.get(SNAPSHOT)
        except (NotFoundError, ObjectNotFoundError, BucketNotFoundError):
            self.index.restore({})
            self.applied = 0
            return 0
        snap = msgpack.unpackb(result.data, raw=False, strict_map_key=False)
        self.index.restore({int(d): flat for d, flat in snap["models"].items()})
        self.applied = snap["seq"]
        log.info("index_snapshot_loaded", seq=self.applied, blocks=len(self.index))
        return self.applied

    async def maybe_compact(self, holder: str) -> bool:
        """Snapshot and purge when the stream is longer than ``compact_after`` records and no
        other replica is compacting. Returns True when this replica compacted."""
        info = await self.js.stream_info(self.stream)
        if info.state.messages < self.compact_after or self.applied < info.state.first_seq:
            return False  # short enough, or this replica lags behind a newer snapshot
        lease = LeaderLease(self.js, self._subjects.kv_index_compact, holder, ttl=60.0, margin=5.0)
        if not await lease.try_acquire():
            return False
        try:
            seq, models = self.applied, self.index.snapshot()  # no await in between: consistent at ``seq``
            data = msgpack.packb({"v": RECORD_VERSION, "seq": seq, "models": models}, use_bin_type=True)
            try:
                store = await self.js.object_store(self.snapshots)
            except (NotFoundError, BucketNotFoundError):
                store = await self.js.create_object_store(
                    self.snapshots,
                    config=api.ObjectStoreConfig(bucket=self.snapshots, replicas=min(self._replicas, info.config.num_replicas or 1)),
                )
            await store.put(SNAPSHOT, data)
            await self.js.purge_stream(self.stream, seq=seq + 1)  # records up to ``seq`` are in the snapshot
            log.info("index_compacted", seq=seq, blocks=len(self.index), bytes=len(data))
            return True
        finally:
            await lease.release()

    async def _ensure_stream(self, replicas: int, deadline: float) -> int:
        loop = asyncio.get_running_loop()
        last_error: Exception | None = None
        while loop.time() < deadline:
            try:
                try:
                    info = await self.js.stream_info(self.stream)
                    return info.state.last_seq
                except NotFoundError:
                    pass
                for r in sorted({replicas, 1}, reverse=True):  # R3 on a cluster, R1 on a single server
                    try:
                        await self.js.add_stream(
                            name=self.stream,
                            subjects=[self.subject],
                            storage=api.StorageType.FILE,
                            num_replicas=r,
                            retention=api.RetentionPolicy.LIMITS,
                        )
                        return 0
                    except APIError as exc:
                        last_error = exc
                        if "already in use" in str(exc):
                            break  # another replica created it meanwhile
            except Exception as exc:  # noqa: BLE001 - JetStream may still be electing its leader
                last_error = exc
            await asyncio.sleep(0.5)
        raise ReplicationError(f"stream {self.stream}: JetStream not ready: {last_error}")

    async def _resync(self, seen: int) -> None:
        log.warning("index_gap", applied=self.applied, seen=seen)
        try:
            await self._unfollow()
            await self._follow()
            self.resyncs += 1
        except Exception as exc:  # noqa: BLE001 - keep serving the old copy; the next record retries
            log.error("index_resync_failed", error=str(exc))
        finally:
            self._resyncing = False
            self._wake()

    async def _unfollow(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception as exc:  # noqa: BLE001 - the connection may be gone
                log.debug("index_unsubscribe_failed", error=str(exc))

    async def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every queued change to be answered; True if all were."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self._pending or self._in_flight:
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def close(self) -> None:
        """Stop following the stream, cancel the background tasks, fail the ops still waiting.

        Ops already published may still be applied by the other replicas: a client told
        "failed" retries, and a commit is idempotent."""
        log.info("index_closed", records=self.records, ops=self.ops, applied=self.applied, blocks=len(self.index))
        await self._unfollow()
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        left = [*self._in_flight.values(), self._pending]  # records whose task was cancelled before it started
        self._in_flight, self._pending, self._waiting = {}, [], 0
        self._flushing, self._window = False, asyncio.Semaphore(self._publish_window)  # as new: tasks may have died unstarted
        for batch in left:
            await self._finish(batch, ReplicationError("index replica closed"))
        for _seq, _tie, fut in self._waiters:
            if not fut.done():
                fut.set_exception(ReplicationError("index replica closed"))
        self._waiters = []

    # ---- applying the stream -------------------------------------------------------------------
    async def _on_record(self, msg) -> None:
        seq = msg.metadata.sequence.stream
        if seq <= self.applied or self._resyncing:
            return  # a redelivery after the ordered consumer was reset, or a reload is under way
        if seq > self.applied + 1:  # records were purged before we applied them: reload the snapshot
            self._resyncing = True
            self._spawn(self._resync(seq), "index-resync")  # ends the old subscription, follows from the snapshot
            return
        try:
            record = msgpack.unpackb(msg.data, raw=False, strict_map_key=True)
            if not isinstance(record, dict) or record.get("v") != RECORD_VERSION:
                raise ValueError(f"unknown record {type(record).__name__} version {getattr(record, 'get', lambda _k: None)('v')}")
            for op in record["ops"]:
                self._apply(op)
        except (ValueError, KeyError, TypeError, IndexError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            log.error("index_record_skipped", seq=seq, error=str(exc))  # never written by us: skip, keep following
        self.applied = seq
        self._wake()

    def _apply(self, op: list[Any]) -> None:
        """Apply one op of a record (checked where it was submitted; checked again cheaply here,
        since anything that can publish on the subject can write a record). Raises ValueError,
        TypeError, KeyError or IndexError for a malformed op."""
        kind, digest = op[0], op[1]
        if type(digest) is not int:
            raise TypeError(f"model digest {digest!r}")
        if kind == "c":
            parent, new, evicted = op[2], op[3], op[4]
            if new:
                if type(parent) is not int or not 0 <= parent <= U64_MAX:
                    raise ValueError(f"parent {parent!r}")
                self.index.extend(digest, parent, check_chain(new))
            if evicted:
                self.index.remove(digest, evicted)
        elif kind == "r":
            self.index.remove(digest, op[2])
        else:
            raise ValueError(f"unknown op {kind!r}")

    def _wake(self) -> None:
        waiters, applied = self._waiters, self.applied
        while waiters and waiters[0][0] <= applied:
            fut = heapq.heappop(waiters)[2]
            if not fut.done():
                fut.set_result(None)

    async def wait_applied(self, seq: int) -> None:
        """Return once this replica has applied the stream up to ``seq``."""
        if seq <= self.applied:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (seq, next(self._tie), fut))
        await fut

    # ---- changes ---------------------------------------------------------------------------------
    def submit_commit(self, model_digest: int, chain: Sequence[int], done: Done, *, start: int = 0) -> list[int]:
        """Queue the commit of ``chain[start:]`` under ``chain[start-1]`` (the root if 0); ``done``
        runs once it is durable and applied here (or with the error that stopped it). Only
        ``chain[start-1:]`` is used: a client need not send the ancestors. Returns the blocks
        this replica chose to evict (their files may go once ``done`` ran without error).

        Raises:
            ValueError: bad hashes or ``start`` (TypeError: not ints); ``done`` will not run.
            IndexBusyError: ``max_pending_ops`` changes already wait; ``done`` will not run.
        """
        check_u64("model_digest", model_digest)
        if not 0 <= start <= len(chain):
            raise ValueError(f"start {start} out of range for a chain of {len(chain)}")
        used = check_chain(chain[start - 1 :] if start else chain)  # the parent and the new blocks are all a record carries
        parent, new = (used[0], used[1:]) if start else (0, used)
        evicted = self._victims(model_digest, parent, new) if self.capacity is not None else []
        self._submit(["c", model_digest, parent, new, evicted], done)
        return evicted

    def submit_remove(self, model_digest: int, hashes: Sequence[int], done: Done) -> list[int]:
        """Queue the removal of ``hashes`` and their descendants everywhere; returns what this
        replica had indexed. Raises like ``submit_commit``."""
        hashes = check_chain(hashes)
        missing = set(self.index.unindexed(model_digest, hashes))
        self._submit(["r", model_digest, hashes], done)
        return [h for h in hashes if h not in missing]

    async def commit(self, model_digest: int, chain: Sequence[int], *, start: int = 0) -> list[int]:
        """``submit_commit`` and wait: durable and applied here when this returns.

        Raises:
            ValueError, IndexBusyError: as ``submit_commit``.
            ReplicationError: JetStream did not acknowledge the record in time.
        """
        fut = asyncio.get_running_loop().create_future()
        evicted = self.submit_commit(model_digest, chain, _resolver(fut), start=start)
        await fut
        return evicted

    async def remove(self, model_digest: int, hashes: Sequence[int]) -> list[int]:
        """``submit_remove`` and wait; returns what this replica had indexed.

        Raises:
            ReplicationError: JetStream did not acknowledge the record in time.
        """
        fut = asyncio.get_running_loop().create_future()
        present = self.submit_remove(model_digest, hashes, _resolver(fut))
        await fut
        return present

    def _victims(self, digest: int, parent: int, new: Sequence[int]) -> list[int]:
        excess = self.index.count(digest) + len(new) - (self.capacity or 0)
        if excess <= 0:
            return []
        keep = set(new)
        keep.update(self.index.lineage(digest, parent))  # the parent's path from the root stays
        return self.index.lru_victims(digest, excess, keep=keep)

    def _submit(self, op: list[Any], done: Done) -> None:
        if len(self._pending) + self._waiting >= self._max_pending:
            raise IndexBusyError(self._max_pending)
        self._pending.append((op, done))
        if not self._flushing:
            self._flushing = True
            self._spawn(self._flush(), "index-flush")

    async def _flush(self) -> None:
        """Hand queued ops to publishers, many per stream message (group commit), while fewer
        than ``publish_window`` records await their acknowledgement."""
        try:
            while self._pending:
                await self._window.acquire()  # meanwhile more ops queue up: the next record carries them all
                batch, self._pending = self._pending[: self._max_batch], self._pending[self._max_batch :]
                key = next(self._tie)
                self._in_flight[key] = batch
                self._waiting += len(batch)
                self._spawn(self._publish(key), "index-publish")
        finally:
            self._flushing = False

    async def _publish(self, key: int) -> None:
        """Store one record, wait until it is applied here, then complete its ops."""
        batch = self._in_flight[key]
        error: BaseException | None = None
        try:
            try:
                payload = msgpack.packb({"v": RECORD_VERSION, "ops": [op for op, _ in batch]}, use_bin_type=True)
                ack = await self.js.publish(self.subject, payload, stream=self.stream, timeout=self._ack_timeout)
                self.records += 1
                self.ops += len(batch)
            finally:
                self._window.release()
            await asyncio.wait_for(self.wait_applied(ack.seq), self._ack_timeout)
        except asyncio.CancelledError:
            error = ReplicationError("index replica closed")
            raise
        except Exception as exc:  # noqa: BLE001 - every op of the record gets the failure
            error = ReplicationError(f"index record not stored or not applied: {type(exc).__name__}: {exc}")
        finally:
            if self._in_flight.pop(key, None) is not None:
                self._waiting -= len(batch)
                await self._finish(batch, error)

    @staticmethod
    async def _finish(batch: _Batch, error: BaseException | None) -> None:
        for _, done in batch:
            try:
                await done(error)
            except Exception as exc:  # noqa: BLE001 - one client's reply must not fail the others
                log.warning("index_done_failed", error=str(exc))

    # ---- reads -----------------------------------------------------------------------------------
    def longest_prefix(self, model_digest: int, chain: Sequence[int]) -> int:
        return self.index.longest_prefix(model_digest, chain)

    def unindexed(self, model_digest: int, hashes: Sequence[int]) -> list[int]:
        return self.index.unindexed(model_digest, hashes)

    def __len__(self) -> int:
        return len(self.index)


def _resolver(fut: asyncio.Future[None]) -> Done:
    """A ``Done`` that settles ``fut``."""

    async def done(error: BaseException | None) -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)

    return done
