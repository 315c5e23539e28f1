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
replica replays the stream before it serves. Concurrent commits on one replica share one
stream message (group commit), which keeps JetStream's message rate far below the commit
rate. With a capacity, the replica that takes a commit chooses the blocks to evict (its own
least recently used leaves) and writes them into the record, so eviction is also identical
everywhere.

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
from collections.abc import Sequence
from typing import Any

import msgpack
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError, ObjectNotFoundError

from dualpath.ha.lease import LeaderLease
from dualpath.kv import BlockIndex
from dualpath.kv.hashing import check_u64
from dualpath.kv.trie import check_chain
from dualpath.telemetry.logs import get_logger

__all__ = ["RECORD_VERSION", "ReplicatedIndex", "ReplicationError", "stream_name"]

log = get_logger("kv-index")
RECORD_VERSION = 1
SNAPSHOT = "index"  # the object holding the latest snapshot


class ReplicationError(RuntimeError):
    """Raised when the stream cannot be created or read, or a change was not acknowledged in time."""


def stream_name(namespace: str) -> str:
    """The JetStream stream of one deployment's index (stream names may not contain dots)."""
    return f"{namespace}_kvindex"


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
        ack_timeout: float = 10.0,
        compact_after: int = 100_000,
    ) -> None:
        self.js = js
        self.stream = stream_name(namespace)
        self.snapshots = f"{self.stream}_snap"  # object store bucket of the snapshot
        self.compact_after = compact_after
        self.subject = subject
        self.capacity = capacity_blocks
        # unbounded here: evictions come only from records; recency is kept only to choose them
        self.index = BlockIndex(None, track_recency=capacity_blocks is not None)
        self.applied = 0  # stream sequence of the last record applied
        self.records = 0  # stream messages published by this replica
        self._max_batch = max_batch_ops
        self._ack_timeout = ack_timeout
        self._pending: list[tuple[list[Any], asyncio.Future[int]]] = []
        self._flushing = False
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._sub: JetStreamContext.PushSubscription | None = None
        self._resyncing = False
        self.resyncs = 0  # snapshot reloads after a gap

    # ---- start-up ------------------------------------------------------------------------------
    async def start(self, *, replicas: int = 3, timeout: float = 60.0) -> None:
        """Create the stream if needed, replay it, and follow it.

        ``replicas`` copies of the stream are asked for (fewer on a smaller cluster). Returns
        once every record present at start is applied.

        Raises:
            ReplicationError: JetStream did not answer within ``timeout``.
        """
        deadline = asyncio.get_running_loop().time() + timeout
        await self._ensure_stream(replicas, deadline)
        self._replicas = replicas
        last = await self._follow()
        if last > self.applied:
            await asyncio.wait_for(self.wait_applied(last), max(1.0, deadline - asyncio.get_running_loop().time()))
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
        lease = LeaderLease(self.js, f"{self.stream}_compact", holder, ttl=60.0, margin=5.0)
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
            await self.close()
            await self._follow()
            self.resyncs += 1
        except Exception as exc:  # noqa: BLE001 - keep serving the old copy; the next record retries
            log.error("index_resync_failed", error=str(exc))
        finally:
            self._resyncing = False
            self._wake()

    async def close(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception as exc:  # noqa: BLE001 - the connection may be gone
                log.debug("index_unsubscribe_failed", error=str(exc))

    # ---- applying the stream -------------------------------------------------------------------
    async def _on_record(self, msg) -> None:
        seq = msg.metadata.sequence.stream
        if seq <= self.applied or self._resyncing:
            return  # a redelivery after the ordered consumer was reset, or a reload is under way
        if seq > self.applied + 1:  # records were purged before we applied them: reload the snapshot
            self._resyncing = True
            asyncio.get_running_loop().create_task(self._resync(seq))  # owned by the flag; ends the old subscription
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
        kind, digest = op[0], op[1]
        if kind == "c":
            parent, new, evicted = op[2], op[3], op[4]
            chain = [parent, *new] if parent else list(new)
            if new:
                self.index.commit(digest, chain, start=1 if parent else 0)
            if evicted:
                self.index.remove(digest, evicted)
        elif kind == "r":
            self.index.remove(digest, op[2])
        else:
            raise ValueError(f"unknown op {kind!r}")

    def _wake(self) -> None:
        keep = []
        for seq, fut in self._waiters:
            if seq <= self.applied:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((seq, fut))
        self._waiters = keep

    async def wait_applied(self, seq: int) -> None:
        """Return once this replica has applied the stream up to ``seq``."""
        if seq <= self.applied:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((seq, fut))
        await fut

    # ---- changes ---------------------------------------------------------------------------------
    async def commit(self, model_digest: int, chain: Sequence[int], *, start: int = 0) -> list[int]:
        """Index ``chain[start:]`` under ``chain[start-1]`` on every replica; durable and applied
        here when this returns. Returns blocks this replica chose to evict (their files may go).

        Raises:
            ValueError: bad hashes or ``start``.
            ReplicationError: JetStream did not acknowledge the record in time.
        """
        check_u64("model_digest", model_digest)
        if not 0 <= start <= len(chain):
            raise ValueError(f"start {start} out of range for a chain of {len(chain)}")
        used = check_chain(chain[start - 1 :] if start else chain)  # the parent and the new blocks are all a record carries
        parent, new = (used[0], used[1:]) if start else (0, used)
        evicted = self._victims(model_digest, chain, len(new)) if self.capacity is not None else []
        await self._submit(["c", model_digest, parent, new, evicted])
        return evicted

    async def remove(self, model_digest: int, hashes: Sequence[int]) -> list[int]:
        """Unindex ``hashes`` and their descendants everywhere; returns what this replica had indexed.

        Raises:
            ReplicationError: JetStream did not acknowledge the record in time.
        """
        hashes = check_chain(hashes)
        missing = set(self.index.unindexed(model_digest, hashes))
        present = [h for h in hashes if h not in missing]
        await self._submit(["r", model_digest, hashes])
        return present

    def _victims(self, digest: int, chain: Sequence[int], adding: int) -> list[int]:
        if self.capacity is None:
            return []
        excess = self.index.count(digest) + adding - self.capacity
        return self.index.lru_victims(digest, excess, keep=set(chain)) if excess > 0 else []

    async def _submit(self, op: list[Any]) -> None:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pending.append((op, fut))
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().create_task(self._flush())  # owned by the futures that wait on it
        seq = await fut
        await asyncio.wait_for(self.wait_applied(seq), self._ack_timeout)

    async def _flush(self) -> None:
        """Publish pending ops, many per stream message, until none is left (group commit)."""
        try:
            while self._pending:
                batch, self._pending = self._pending[: self._max_batch], self._pending[self._max_batch :]
                payload = msgpack.packb({"v": RECORD_VERSION, "ops": [op for op, _ in batch]}, use_bin_type=True)
                try:
                    ack = await self.js.publish(self.subject, payload, stream=self.stream, timeout=self._ack_timeout)
                except Exception as exc:  # noqa: BLE001 - every waiter gets the failure
                    err = ReplicationError(f"index record not stored: {type(exc).__name__}: {exc}")
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(err)
                    continue
                self.records += 1
                for _, fut in batch:
                    if not fut.done():
                        fut.set_result(ack.seq)
        finally:
            self._flushing = False

    # ---- reads -----------------------------------------------------------------------------------
    def longest_prefix(self, model_digest: int, chain: Sequence[int]) -> int:
        return self.index.longest_prefix(model_digest, chain)

    def unindexed(self, model_digest: int, hashes: Sequence[int]) -> list[int]:
        return self.index.unindexed(model_digest, hashes)

    def __len__(self) -> int:
        return len(self.index)
