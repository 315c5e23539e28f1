"""A node's storage side: the read queue in front of its storage NIC and its DRAM buffer.

Reads are served FIFO, at most ``storage_parallel`` at once (the traffic manager's
``StorageIO`` runs that many), each a flow on the node's SNIC read link (a ``SharedLink``:
only reads cross it), so concurrent reads share the NIC equally. ``read_q`` (what the node
reports to the scheduler) is the hit tokens queued or in flight.

The DRAM buffer is the traffic manager's own core, ``dualpath.node.slots.NodeBuffer``, over
a ``BufferPool`` of the buffer's bytes (no bytes behind it): slots placed first fit, the
prefetch cache's runs beside the requests' room. On a decode node, a slot per request,
reserved by the scheduler (``ReserveSlot``) for the prompt's KV and freed once that KV is in
the decode engine's HBM: the DE read path's hits and the prefill engine's stores land there.
On a prefill node, a slot per request on the PE read path, taken when its read starts (a
read waits while the buffer has no room: back-pressure holds the queue) and freed at the end
of its prefill. A slot larger than the whole request buffer is cut to the buffer (it goes
alone rather than never). Writes (block persistence) are flows on the SNIC's write
direction, which a full-duplex NIC does not share with reads.

With agent-aware prefetch (mode ``prefetch``) the buffer has a ``PrefetchCache`` beside it,
the traffic manager's too: a read first takes the leading hit blocks staged or retained on
this node (a DRAM copy, free here) and reads only the rest; a freed slot whose blocks a read
verified (or whose prompt blocks were persisted from it) stays as a run of the cache.
``sim.prefetch`` stages runs while the node's storage NIC is idle.

The node reports (``changed``, then the scheduler's report tick) when its read queue or its
slots change: ``read_q`` and ``buffer_report()``, the free bytes a slot could take, as a
traffic manager does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, TypeVar

from dualpath.node.buffer import BufferFullError, BufferPool
from dualpath.node.prefetch import PREFETCH_OWNER, PrefetchCache
from dualpath.node.slots import NodeBuffer, slot_key
from dualpath.policy import ReadSide
from dualpath.sim.clock import EventLoop
from dualpath.sim.request import SimRequest
from dualpath.sim.sharedlink import SharedLink

if TYPE_CHECKING:
    from dualpath.sim.prefetch import NodeStaging

T = TypeVar("T")

__all__ = ["DIGEST", "NodeStorage", "block_hashes"]

DIGEST: Final = 0  # the model digest of every simulated block (one model per simulation)
_PAGE: Final = 4096  # BufferPool's slot granularity


def block_hashes(agent: int, blocks: int) -> list[int]:
    """The hashes of an agent's first ``blocks`` context blocks: a context only grows, so
    block ``i`` of an agent is the same block in every turn (the chain's prefix property)."""
    base = agent << 32
    return list(range(base, base + blocks))


class NodeStorage:
    """Storage read queue, SNIC links and DRAM buffer (``NodeBuffer``) of one node."""

    __slots__ = (
        "_changed",
        "_on_read",
        "active",
        "block_bytes",
        "block_tokens",
        "buffer_bytes",
        "bytes_read",
        "bytes_written",
        "cache",
        "hit_tokens_read",
        "loop",
        "name",
        "node",
        "node_id",
        "parallel",
        "prefetch",
        "queue",
        "read_link",
        "read_q",
        "write_link",
    )

    def __init__(
        self,
        node_id: int,
        name: str,
        loop: EventLoop,
        read_link: SharedLink,
        write_link: SharedLink,
        *,
        buffer_bytes: float,
        parallel: int,
        block_tokens: int,
        kv_bytes_per_token: int,
        on_read: Callable[[SimRequest], None],
        changed: Callable[[NodeStorage], None],
        prefetch_bytes: float = 0.0,
        prefetch_ttl_s: float = 60.0,
    ) -> None:
        self.node_id, self.name, self.loop = node_id, name, loop
        self.read_link, self.write_link = read_link, write_link
        room = max(_PAGE, int(buffer_bytes) // _PAGE * _PAGE)
        budget = int(prefetch_bytes) // _PAGE * _PAGE
        pool = BufferPool(room + budget)
        self.cache: PrefetchCache | None = PrefetchCache(pool, None, budget, prefetch_ttl_s, self._now) if budget > 0 else None
        self.node = NodeBuffer(pool, room, self.cache)
        self.buffer_bytes = room
        self.block_tokens = block_tokens
        self.block_bytes = block_tokens * kv_bytes_per_token
        self.parallel = parallel
        self.queue: deque[tuple[SimRequest, float, bool, int, bool]] = deque()  # request, bytes, into buffer, tokens, staged
        self.active = 0
        self.read_q = 0  # hit tokens queued or being read
        self.bytes_read = 0.0  # over the SNIC (not what a read took from the prefetch cache)
        self.bytes_written = 0.0
        self.hit_tokens_read = 0  # hit tokens that reached a buffer, from storage or the cache
        self._on_read = on_read
        self._changed = changed
        self.prefetch: NodeStaging | None = None  # agent-aware prefetch (sim.prefetch): stages runs into ``cache``

    def _now(self) -> float:
        return self.loop.now

    # -- the buffer ----------------------------------------------------------------------
    @property
    def buffer_used(self) -> int:
        """Bytes of the request buffer held by requests' slots."""
        return self.node.request_bytes()

    @property
    def slots(self) -> list[str]:
        """The requests holding a slot here."""
        return [k for k in self.node.pool.owners() if not k.startswith(PREFETCH_OWNER)]

    def _fit(self, nbytes: float) -> int:
        return max(1, min(int(nbytes), self.buffer_bytes))  # an oversized slot takes the whole buffer

    def reserve(self, rid: str, nbytes: float) -> bool:
        """Reserve a request's slot on this (decode) node; False when the buffer has no room
        for it now."""
        try:
            self.node.alloc(rid, 0, self._fit(nbytes))
        except BufferFullError:
            return False
        self._changed(self)
        return True

    def free_slot(self, rid: str) -> None:
        """The request is done with its slot here (a verified run stays in the cache)."""
        if self.node.free(rid, 0) != "no slot":
            self._changed(self)
            if self.queue:
                self._pump()

    def free_read(self, req: SimRequest) -> None:
        """The PE read path's prefill ended: its hits leave this (prefill) node's slot."""
        req.buffer = None
        self.free_slot(req.key)

    def keep_prompt(self, req: SimRequest) -> None:
        """The DE read path's KV is in HBM and its new prompt blocks were persisted from the
        slot: the slot (hits, then the new blocks) stays as a run once freed."""
        if self.cache is None or req.read_side != ReadSide.DE or req.split_de or not req.hit:
            return
        slot = self.node.slot(req.key, 0)
        if slot is None:
            return
        bt, bb = self.block_tokens, self.block_bytes
        hit, prompt = req.hit // bt, req.prompt // bt
        chain = block_hashes(req.agent.index, prompt)
        self.node.keep_prompt(slot_key(req.key, 0), DIGEST, chain[:hit], chain[hit:], slot.offset + hit * bb, bb)

    def buffer_report(self) -> tuple[int, int]:
        """(free, total) bytes of the request buffer as the node reports them."""
        return self.node.room(), self.buffer_bytes

    # -- reads ---------------------------------------------------------------------------
    def read(self, req: SimRequest, nbytes: float, *, into_buffer: bool, tokens: int = -1, staged: bool = False) -> None:
        """Queue the read of ``req``'s hit KV (``nbytes``, ``tokens``: all its hits unless a
        split read's share); ``into_buffer``: it needs a slot in this node's buffer (PE read
        path) rather than the one the scheduler reserved; ``staged``: take the leading blocks
        the prefetch cache holds instead of reading them."""
        tokens = req.hit if tokens < 0 else tokens
        self.queue.append((req, nbytes, into_buffer, tokens, staged))
        self.read_q += tokens
        self._changed(self)
        self._pump()

    def _pump(self) -> None:
        q = self.queue
        while q and self.active < self.parallel:
            req, nbytes, into_buffer, tokens, staged = q[0]
            if into_buffer:
                try:
                    self.node.alloc(req.key, 0, self._fit(nbytes))
                except BufferFullError:
                    return  # back-pressure: wait for the buffer
                req.buffer = self
            q.popleft()
            self.active += 1
            rest = nbytes
            # the blocks' hashes, for the prefetch cache only: runs are found and kept by hash
            hashes = block_hashes(req.agent.index, tokens // self.block_tokens) if self.cache is not None else []
            if staged and self.cache is not None:
                rest = max(0.0, nbytes - self.cache.take_prefix(DIGEST, hashes, self.block_bytes, None) * self.block_bytes)
            token = (req, rest, tokens, into_buffer, hashes)
            if rest > 0:
                self.read_link.start(rest, self._done, token)
            else:
                self.loop.at(self.loop.now, self._done, token)

    def _done(self, token: tuple[SimRequest, float, int, bool, list[int]]) -> None:
        req, nbytes, tokens, into_buffer, hashes = token
        self.active -= 1
        self.bytes_read += nbytes
        self.hit_tokens_read += tokens
        self.read_q -= tokens
        if self.cache is not None and (into_buffer or not req.split_de):  # the slot's leading blocks are verified
            self.node.loaded(slot_key(req.key, 0), DIGEST, hashes, self.block_bytes)
        self._changed(self)
        self._pump()
        if self.prefetch is not None and not self.active:
            self.prefetch.pump()  # the storage NIC is idle: staging may go on
        self._on_read(req)

    # -- writes --------------------------------------------------------------------------
    def write(self, nbytes: float, on_done: Callable[[T], None], arg: T) -> None:
        """Persist ``nbytes`` of Full Blocks through the SNIC's write direction."""
        self.bytes_written += nbytes
        self.write_link.start(nbytes, on_done, arg)
