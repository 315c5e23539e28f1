"""``StorageIO``: a node's storage reads and writes through its storage NIC, with the read queue.

``read_q`` (the paper's per-node storage read queue) is the tokens (and bytes) of Full Blocks
that were asked for and not yet read: the scheduler compares it across nodes to pick the read
side. File I/O runs in worker threads (it blocks); when an emulated SNIC is attached (testbed),
every byte is paced through it, so the queue it builds up is the real one the scheduler sees. A
read or write returns when its last byte has crossed the SNIC (completion, not start).

Each request slot (``max_parallel``) gets ``fanout`` worker threads of StorageIO's own pool, and a
request keeps up to ``fanout`` groups of blocks in flight: while one thread verifies a block
(its checksum) or waits for the GIL, another has its next file read in flight, so the storage
is not left idle between a request's reads. So up to ``max_parallel * fanout`` files are read (or written) at once; ``dualpath bench
storage`` compares that with fio at a queue depth of ``max_parallel``, the requested one.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from dualpath.kv import BlockMissingError, BlockStore, CorruptBlockError
from dualpath.kv.storage import BlockShape
from dualpath.transfer.nic import sleep_until, withdraw
from dualpath.transfer.types import TrafficClass

__all__ = ["FANOUT", "READ_GROUP_BYTES", "WRITE_GROUP_BLOCKS", "WRITE_GROUP_BYTES", "BlockFormat", "ReadResult", "StorageIO"]

_T = TypeVar("_T")

# Groups of one request in flight at once (worker threads per request slot): two keep a file
# read in flight while the other thread spends CPU on the previous block (measured with
# ``dualpath bench storage``: 4 threads reach 0.5-0.8 of fio's 4 jobs, 8 reach it).
FANOUT = 2

# A read group without an SNIC: its blocks share one worker thread hop (a hop is a wake-up of
# the event loop and of a worker, which a loaded host makes slow next to a block's read).
READ_GROUP_BYTES = 8 << 20
# A write group without an SNIC: up to this many blocks or bytes share a thread hop and the
# directory fsyncs (one journal commit each), so small blocks do not pay a commit apiece.
WRITE_GROUP_BLOCKS = 16
WRITE_GROUP_BYTES = 64 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockFormat:
    """Shape of one Full Block: ``[layers, block_tokens, bytes_per_token_layer]`` of ``dtype``,
    a token's bytes laid out as ``kv_layout`` says (``dualpath.kv.block.KV_LAYOUTS``)."""

    layers: int
    block_tokens: int
    bytes_per_token_layer: int
    dtype: str
    kv_layout: int = 0

    @property
    def block_bytes(self) -> int:
        return self.layers * self.block_tokens * self.bytes_per_token_layer


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadResult:
    loaded: int  # leading blocks that are valid in the buffer
    bytes_read: int
    queue_wait_s: float
    read_s: float
    bad: list[int]  # hashes found missing or corrupt (drop them from the index)


class StorageIO:
    """Reads/writes Full Block files for one node.

    ``read_nic``/``write_nic`` are the two directions of its (emulated) storage NIC, or None.
    ``oracle``: no file I/O at all (reads report every block loaded; writes do nothing).
    """

    def __init__(
        self, store: BlockStore, *, read_nic=None, write_nic=None, max_parallel: int = 4, fanout: int = FANOUT, oracle: bool = False
    ) -> None:
        """``max_parallel`` reads run at once (more wait in the read queue); each, and each
        write, keeps up to ``fanout`` groups of blocks in flight in worker threads.

        Raises:
            ValueError: ``max_parallel`` or ``fanout`` is below 1.
        """
        if max_parallel < 1 or fanout < 1:
            raise ValueError(f"max_parallel and fanout must be >= 1, got {max_parallel} and {fanout}")
        self.store = store
        self.nic = read_nic
        self.write_nic = write_nic
        self.oracle = oracle
        self.fanout = fanout
        self._sem = asyncio.Semaphore(max_parallel)
        # threads start on first use and end when the pool is collected (or at close())
        self._pool = ThreadPoolExecutor(max_workers=max_parallel * fanout, thread_name_prefix="storage-io")
        self.read_q_tokens = 0
        self.read_q_bytes = 0
        self.bytes_read = 0
        self.bytes_written = 0

    async def read_blocks(self, model_digest: int, hashes: list[int], fmt: BlockFormat, dest: memoryview) -> ReadResult:
        """Read ``hashes`` in order into ``dest`` (block i at ``i*block_bytes``).

        Stops at the first missing or corrupt block: the hit is the valid prefix (the rest is
        recomputed), so a torn file is never used.
        """
        n = len(hashes)
        bb = fmt.block_bytes
        if self.oracle:
            return ReadResult(loaded=n, bytes_read=0, queue_wait_s=0.0, read_s=0.0, bad=[])
        self.read_q_tokens += n * fmt.block_tokens
        self.read_q_bytes += n * bb
        t_enq = time.perf_counter()
        loaded, bad, wait, read_s = 0, [], 0.0, 0.0
        try:
            async with self._sem:
                wait = time.perf_counter() - t_enq
                t0 = time.perf_counter()
                # Blocks go in groups of about one NIC chunk (without one: READ_GROUP_BYTES, and
                # at least ``fanout`` groups): one pacing grant and one worker thread hop per
                # group rather than per block, ``fanout`` groups in flight.
                if self.nic is not None:
                    group = max(1, self.nic.chunk_bytes // bb)
                else:
                    group = max(1, min(READ_GROUP_BYTES // bb, -(-n // self.fanout)))
                starts = range(0, n, group)
                # Every group is queued on the SNIC at once, so the link's timeline runs on
                # while worker threads are still reading earlier groups' files.
                grants = [self.nic.enqueue(len(hashes[g : g + group]) * bb, TrafficClass.KV) for g in starts] if self.nic else []
                jobs: deque[asyncio.Future[tuple[int, int | None]]] = deque()
                try:
                    end = 0.0
                    failed: int | None = None
                    for i, g in enumerate(starts):
                        if grants:
                            end = await grants[i]  # the group's bytes are on the link from now
                        jobs.append(self._submit(self._read_group, model_digest, hashes[g : g + group], fmt, dest, g))
                        while jobs and (len(jobs) >= self.fanout or i == len(starts) - 1):
                            done, failed = await jobs.popleft()
                            loaded += done
                            self.bytes_read += done * bb  # per group, so utilisation sampled over time is smooth
                            self.read_q_tokens -= (done + (failed is not None)) * fmt.block_tokens
                            self.read_q_bytes -= (done + (failed is not None)) * bb
                            if failed is not None:
                                bad.append(failed)
                                break
                        if failed is not None:
                            break
                    else:
                        await sleep_until(end)  # complete: the last group has crossed the link
                finally:
                    if self.nic is not None:
                        withdraw([self.nic], grants)
                    await _settle(jobs)  # no thread may write into ``dest`` after we return
                read_s = time.perf_counter() - t0
        finally:
            # blocks never attempted leave the queue too
            left = n - loaded - len(bad)
            self.read_q_tokens -= left * fmt.block_tokens
            self.read_q_bytes -= left * bb
        return ReadResult(loaded=loaded, bytes_read=loaded * bb, queue_wait_s=wait, read_s=read_s, bad=bad)

    def _read_group(self, model_digest: int, hashes: list[int], fmt: BlockFormat, dest: memoryview, first: int) -> tuple[int, int | None]:
        """Read ``hashes`` (blocks ``first``, ``first+1``... of the request) in order; returns
        how many landed and the hash that was missing or corrupt (None if all landed)."""
        bb = fmt.block_bytes
        for i, h in enumerate(hashes):
            try:
                self.store.read_into(
                    model_digest=model_digest,
                    block_hash=h,
                    layers=fmt.layers,
                    tokens=fmt.block_tokens,
                    bytes_per_token_layer=fmt.bytes_per_token_layer,
                    dtype=fmt.dtype,
                    dest=dest[(first + i) * bb : (first + i + 1) * bb],
                    kv_layout=fmt.kv_layout,
                )
            except (BlockMissingError, CorruptBlockError):
                return i, h
        return len(hashes), None

    async def write_blocks(self, model_digest: int, hashes: list[int], fmt: BlockFormat, src: memoryview) -> int:
        """Write blocks atomically (temp + fsync + rename, directories fsynced); returns bytes
        written.

        Blocks go to worker threads in groups (``BlockStore.write_many``), so a group shares
        one thread hop and one fsync per directory, ``fanout`` groups in flight. With an SNIC,
        every group's bytes are queued on it at once and each group is written when its grant
        comes, as reads are.

        Raises:
            OSError: the filesystem refused a write (the groups written so far stay in place).
        """
        bb = fmt.block_bytes
        if self.oracle or not hashes:
            return 0
        nic = self.write_nic
        limit = nic.chunk_bytes if nic is not None else WRITE_GROUP_BYTES
        group = max(1, min(WRITE_GROUP_BLOCKS, limit // bb, -(-len(hashes) // self.fanout)))
        starts = range(0, len(hashes), group)
        shape = BlockShape(model_digest, fmt.layers, fmt.block_tokens, fmt.bytes_per_token_layer, fmt.dtype, fmt.kv_layout)
        grants = [nic.enqueue(len(hashes[g : g + group]) * bb, TrafficClass.KV) for g in starts] if nic is not None else []
        jobs: deque[asyncio.Future[int]] = deque()
        written = 0
        try:
            end = 0.0
            for i, g in enumerate(starts):
                if grants:
                    end = await grants[i]
                ids = hashes[g : g + group]
                payloads = [src[(g + j) * bb : (g + j + 1) * bb] for j in range(len(ids))]
                jobs.append(self._submit(self.store.write_many, shape, ids, payloads))
                while jobs and (len(jobs) >= self.fanout or i == len(starts) - 1):
                    written += await jobs.popleft()
            await sleep_until(end)  # the last group has crossed the SNIC
        finally:
            if nic is not None:
                withdraw([nic], grants)
            await _settle(jobs)  # a failed write: the groups still in flight finish first
        self.bytes_written += written
        return written

    def close(self) -> None:
        """Stop the worker threads and wait for them (they also stop when this object is
        collected): a thread may hold a view of a caller's buffer for a moment after its
        read or write has completed. Reads and writes after this raise RuntimeError."""
        self._pool.shutdown(wait=True)

    def _submit(self, fn: Callable[..., _T], *args: object) -> asyncio.Future[_T]:
        """Run ``fn(*args)`` in a worker thread. The pool's work item outlives the call for a
        moment (the caller may already have resumed), so it holds the arguments, views of the
        caller's buffer among them, only until the call starts: the buffer can be closed as
        soon as the read or write returns."""
        box = [args]

        def call() -> _T:
            return fn(*box.pop())

        return asyncio.get_running_loop().run_in_executor(self._pool, call)


async def _settle(jobs: deque[asyncio.Future[_T]]) -> None:
    """Wait until every job in ``jobs`` has finished (their results or errors are dropped),
    even while the caller is being cancelled: a worker thread cannot be stopped, and it must
    not touch the caller's buffer after the caller returns."""
    if not jobs:
        return
    done = asyncio.gather(*jobs, return_exceptions=True)
    cancelled = False
    while not done.done():
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
