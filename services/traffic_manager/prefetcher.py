"""The traffic manager's prefetch worker (``--prefetch-mb``): stages sessions' blocks while idle.

``stage`` queues a ``PrefetchRequest`` (bounded: when full, the oldest hint is dropped); one
worker opens a run in the node buffer for the hint's blocks that are not staged yet
(``PrefetchCache.open_run``: leading blocks first, within the budget) and fills it one block
at a time, at the lowest priority of the node:

- on the storage read queue: a block is started only while no request's read is queued or
  running (``StorageIO.read_q_tokens == 0``), and the prefetch is never counted in
  ``read_q``, so the scheduler sees only real reads;
- on the storage NIC: the block's bytes are asked for chunk by chunk, each only while the
  link has nothing queued in either class, so a real read waits behind at most the prefetch
  chunk being sent and one more (about 2 ms of link time each), never behind a whole block.

Each block is read and checksummed like any read (``BlockStore.read_into``: header fields
and payload checksum) into a one-block scratch buffer, then copied into its run if the run
was not given up meanwhile (so dropping a run never waits for a read). A missing or corrupt
block ends that hint.
"""

from __future__ import annotations

import asyncio
from collections import deque

from dualpath.kv.block import HEADER_BYTES, decode_header
from dualpath.kv.errors import BlockMissingError, CorruptBlockError
from dualpath.node.prefetch import MAX_PENDING_HINTS, PrefetchCache, Run
from dualpath.node.storage_io import BlockFormat, StorageIO
from dualpath.protocol import messages as m
from dualpath.runtime import wait_any
from dualpath.telemetry.logs import get_logger
from dualpath.transfer.nic import sleep_until
from dualpath.transfer.types import TrafficClass

__all__ = ["Prefetcher"]

log = get_logger("traffic-manager")
_IDLE_POLL_S = 0.005  # how often a waiting prefetch looks at the read queue and the NIC again


class Prefetcher:
    def __init__(self, io: StorageIO, cache: PrefetchCache) -> None:
        self.io, self.cache = io, cache
        self._pending: deque[m.PrefetchRequest] = deque(maxlen=MAX_PENDING_HINTS)
        self._wake = asyncio.Event()
        self.hints = self.blocks_read = 0
        self.bytes_read = 0  # storage bytes the prefetch moved over the SNIC (not in StorageIO.bytes_read)
        self.fmt: BlockFormat | None = None  # the block layout of this node's last load or persist

    def stage(self, req: m.PrefetchRequest) -> None:
        self.hints += 1
        self._pending.append(req)
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """The worker, until ``stop``."""
        while not stop.is_set():
            if not self._pending:
                self._wake.clear()
                await wait_any(self._wake, stop)
                continue
            req = self._pending.popleft()
            try:
                await self._one(req, stop)
            except Exception as exc:  # noqa: BLE001 - a hint that fails is only a hint
                log.warning("prefetch_failed", session=req.session, error=f"{type(exc).__name__}: {exc}")

    def _format_of(self, digest: int, block_hash: int) -> BlockFormat | None:
        """The block layout: the node's last load or persist, else the block file's own header
        (its CRC is checked; the payload checksum still is, by the read itself)."""
        if self.fmt is None:
            try:
                with open(self.io.store.path_for(digest, block_hash), "rb") as f:
                    h = decode_header(f.read(HEADER_BYTES))
            except (OSError, CorruptBlockError):
                return None
            self.fmt = BlockFormat(
                layers=h.layers, block_tokens=h.tokens, bytes_per_token_layer=h.bytes_per_token_layer, dtype=h.dtype, kv_layout=h.kv_layout
            )
        return self.fmt

    async def _one(self, req: m.PrefetchRequest, stop: asyncio.Event) -> None:
        if self.io.oracle or not req.hashes:
            return
        fmt = self._format_of(req.model_digest, req.hashes[0])
        if fmt is None:  # the first block is not in storage
            return
        todo = [h for h in req.hashes if (req.model_digest, h) not in self.cache]
        if not todo:
            return
        await self._idle(stop)  # no buffer room is taken before the node is idle
        run = self.cache.open_run(req.model_digest, todo, fmt.block_bytes) if not stop.is_set() else None
        if run is None:
            return
        scratch = memoryview(bytearray(fmt.block_bytes))  # [layers, block_tokens, bytes]
        for i, h in enumerate(run.hashes):
            await self._idle(stop)
            if stop.is_set() or not run.live:
                return
            if not await self._read(run, i, h, fmt, scratch, stop):
                return

    async def _read(self, run: Run, i: int, h: int, fmt: BlockFormat, scratch: memoryview, stop: asyncio.Event) -> bool:
        """Block ``i`` of ``run``: paced on the SNIC at the lowest priority, read, verified, kept."""
        bb = fmt.block_bytes
        nic = self.io.nic
        if nic is not None:
            end = 0.0
            for start in range(0, bb, nic.chunk_bytes):
                await self._idle(stop)
                if stop.is_set() or not run.live:
                    return False
                end = await nic.acquire(min(nic.chunk_bytes, bb - start), TrafficClass.KV)
            await sleep_until(end)
        try:
            await asyncio.to_thread(
                self.io.store.read_into,
                model_digest=run.digest,
                block_hash=h,
                layers=fmt.layers,
                tokens=fmt.block_tokens,
                bytes_per_token_layer=fmt.bytes_per_token_layer,
                dtype=fmt.dtype,
                dest=scratch,
                kv_layout=fmt.kv_layout,
            )
        except (BlockMissingError, CorruptBlockError):
            return False  # the rest of the chain is a miss for the next turn too
        self.blocks_read += 1
        self.bytes_read += bb
        return self.cache.fill(run, i, scratch)

    async def _idle(self, stop: asyncio.Event) -> None:
        """Until no request's read is queued or running and the storage NIC is idle."""
        io = self.io
        while not stop.is_set():
            nic = io.nic
            if io.read_q_tokens == 0 and (nic is None or nic.queued_bytes(TrafficClass.KV) + nic.queued_bytes(TrafficClass.MODEL) == 0):
                return
            await asyncio.sleep(_IDLE_POLL_S)
