"""A node's storage side: the read queue in front of its storage NIC and its DRAM buffer.

Reads are served FIFO, at most ``storage_parallel`` at once (the traffic manager's
``StorageIO`` runs that many), each a flow on the node's SNIC read link (a ``SharedLink``:
only reads cross it), so concurrent reads share the NIC equally. ``read_q`` (what the node reports to the scheduler) is the hit tokens
queued or in flight.

The DRAM buffer holds two kinds of KV. On a decode node, a *slot* per request, reserved by
the scheduler (``ReserveSlot``) for the prompt's KV and released once that KV is in the
decode engine's HBM: the DE read path's hits and the prefill engine's stores land there.
On a prefill node, the hits the PE read path brings in: a read starts only when the buffer
has room (back-pressure holds the queue; a request larger than the whole buffer goes
alone rather than never) and its bytes are released at the end of the request's prefill.
Writes (block persistence) are flows on the SNIC's write direction, which a full-duplex NIC
does not share with reads.

The node reports (``changed``, then the scheduler's report tick) when its read queue or its
slots change: ``read_q`` and ``buffer_report()``, the free bytes a slot could take, as a
traffic manager does. Agent-aware prefetch keeps its copies beside the buffer
(``sim.prefetch``): they never take a request's room.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from dualpath.sim.request import SimRequest
from dualpath.sim.sharedlink import SharedLink

if TYPE_CHECKING:
    from dualpath.sim.prefetch import NodePrefetch

T = TypeVar("T")

__all__ = ["NodeStorage"]


class NodeStorage:
    """Storage read queue, SNIC links and DRAM buffer of one node."""

    __slots__ = (
        "_changed",
        "_on_read",
        "active",
        "buffer_bytes",
        "buffer_used",
        "bytes_read",
        "bytes_written",
        "hit_tokens_read",
        "name",
        "node_id",
        "parallel",
        "prefetch",
        "queue",
        "read_link",
        "read_q",
        "slots",
        "write_link",
    )

    def __init__(
        self,
        node_id: int,
        name: str,
        read_link: SharedLink,
        write_link: SharedLink,
        *,
        buffer_bytes: float,
        parallel: int,
        on_read: Callable[[SimRequest], None],
        changed: Callable[[NodeStorage], None],
    ) -> None:
        self.node_id, self.name = node_id, name
        self.read_link, self.write_link = read_link, write_link
        self.buffer_bytes = buffer_bytes
        self.buffer_used = 0.0
        self.slots: dict[str, float] = {}
        self.parallel = parallel
        self.queue: deque[tuple[SimRequest, float, bool, int]] = deque()  # request, bytes, into buffer, tokens
        self.active = 0
        self.read_q = 0  # hit tokens queued or being read
        self.bytes_read = 0.0
        self.bytes_written = 0.0
        self.hit_tokens_read = 0
        self._on_read = on_read
        self._changed = changed
        self.prefetch: NodePrefetch | None = None  # agent-aware prefetch (sim.prefetch): staged copies beside the buffer

    # -- slots (decode nodes) ------------------------------------------------------------
    def reserve(self, rid: str, nbytes: float) -> bool:
        """Reserve a request's slot; False when the buffer has no room now (an empty buffer
        takes any request, so an oversized one is not refused for ever)."""
        if rid in self.slots:
            return True
        if self.buffer_used + nbytes > self.buffer_bytes and self.buffer_used > 0:
            return False
        self.slots[rid] = nbytes
        self.buffer_used += nbytes
        self._changed(self)
        return True

    def free_slot(self, rid: str) -> None:
        nbytes = self.slots.pop(rid, None)
        if nbytes is not None:
            self.release(nbytes)
            self._changed(self)

    def buffer_report(self) -> tuple[int, int]:
        """(free, total) bytes of the buffer as the node reports them."""
        return int(self.buffer_bytes - self.buffer_used), int(self.buffer_bytes)

    # -- reads ---------------------------------------------------------------------------
    def read(self, req: SimRequest, nbytes: float, *, into_buffer: bool, tokens: int = -1) -> None:
        """Queue the read of ``req``'s hit KV (``nbytes``, ``tokens``: all its hits unless a
        split read's share); ``into_buffer``: it needs room in this node's buffer (PE read
        path) rather than in a slot already reserved."""
        tokens = req.hit if tokens < 0 else tokens
        self.queue.append((req, nbytes, into_buffer, tokens))
        self.read_q += tokens
        self._changed(self)
        self._pump()

    def _pump(self) -> None:
        q = self.queue
        while q and self.active < self.parallel:
            req, nbytes, into_buffer, tokens = q[0]
            if into_buffer:
                if self.buffer_used + nbytes > self.buffer_bytes and self.buffer_used > 0:
                    return  # back-pressure: wait for the buffer
                self.buffer_used += nbytes
                req.buffer, req.buffer_bytes = self, nbytes
            q.popleft()
            self.active += 1
            self.read_link.start(nbytes, self._done, (req, nbytes, tokens))

    def _done(self, token: tuple[SimRequest, float, int]) -> None:
        req, nbytes, tokens = token
        self.active -= 1
        self.bytes_read += nbytes
        self.hit_tokens_read += tokens
        self.read_q -= tokens
        self._changed(self)
        self._pump()
        if self.prefetch is not None and not self.active:
            self.prefetch.pump()  # the storage NIC is idle: staging may go on
        self._on_read(req)

    def release(self, nbytes: float) -> None:
        """KV of ``nbytes`` left the buffer."""
        self.buffer_used -= nbytes
        if self.buffer_used < 1e-6:
            self.buffer_used = 0.0
        if self.queue:
            self._pump()

    # -- writes --------------------------------------------------------------------------
    def write(self, nbytes: float, on_done: Callable[[T], None], arg: T) -> None:
        """Persist ``nbytes`` of Full Blocks through the SNIC's write direction."""
        self.bytes_written += nbytes
        self.write_link.start(nbytes, on_done, arg)
