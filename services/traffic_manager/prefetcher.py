"""The traffic manager's prefetch worker (``--prefetch-mb``): stages sessions' blocks while idle.

``stage`` queues a ``PrefetchRequest`` (bounded: when full, the oldest hint is dropped); one
worker reads its blocks that are not cached yet, one block per storage read and only while
the node's storage read queue is empty (so a real read waits at most one block behind it),
through ``StorageIO.read_blocks`` like any read (checksums verified, paced on the storage
NIC), into ``PrefetchCache``. A missing or corrupt block ends that hint.
"""

from __future__ import annotations

import asyncio
from collections import deque

from dualpath.kv.block import HEADER_BYTES, decode_header
from dualpath.kv.errors import CorruptBlockError
from dualpath.node.prefetch import PrefetchCache
from dualpath.node.storage_io import BlockFormat, StorageIO
from dualpath.protocol import messages as m
from dualpath.runtime import wait_any
from dualpath.telemetry.logs import get_logger

__all__ = ["Prefetcher"]

log = get_logger("traffic-manager")
_MAX_PENDING = 64  # hints queued; older ones are dropped first
_IDLE_POLL_S = 0.005  # how often a waiting prefetch looks at the read queue again


class Prefetcher:
    def __init__(self, io: StorageIO, cache: PrefetchCache) -> None:
        self.io, self.cache = io, cache
        self._pending: deque[m.PrefetchRequest] = deque(maxlen=_MAX_PENDING)
        self._wake = asyncio.Event()
        self.hints = self.blocks_read = 0
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
            self.fmt = BlockFormat(layers=h.layers, block_tokens=h.tokens, bytes_per_token_layer=h.bytes_per_token_layer, dtype=h.dtype)
        return self.fmt

    async def _one(self, req: m.PrefetchRequest, stop: asyncio.Event) -> None:
        fmt = self._format_of(req.model_digest, req.hashes[0]) if req.hashes else None
        if fmt is None:  # nothing to stage, or the first block is not in storage
            return
        bb = fmt.block_bytes
        if bb * len(req.hashes) > self.cache.budget:  # stage the tail that fits: the prefix is the likeliest evicted anyway
            req_hashes = req.hashes[-(self.cache.budget // bb) :] if self.cache.budget >= bb else []
        else:
            req_hashes = req.hashes
        for h in req_hashes:
            if (req.model_digest, h) in self.cache:
                continue
            while self.io.read_q_tokens > 0 and not stop.is_set():  # lowest priority: only an idle storage NIC
                await asyncio.sleep(_IDLE_POLL_S)
            if stop.is_set():
                return
            buf = bytearray(bb)
            res = await self.io.read_blocks(req.model_digest, [h], fmt, memoryview(buf))
            if res.loaded != 1:
                return
            self.blocks_read += 1
            self.cache.put(req.model_digest, h, bytes(buf))
