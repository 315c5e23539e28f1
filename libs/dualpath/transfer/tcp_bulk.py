"""The tcp transport's bulk lane: large payloads move in worker threads, large batches in stripes.

On one connection the event loop moves a payload as fast as one core copies it through the
kernel, and no faster: a sender and a receiver each make one copy, and one stream keeps one
core of each busy at best (loopback measured ~0.15-0.2 CPU-seconds per GB each side). Two
things lift that ceiling, both used only where a batch is large enough to pay for them:

- **Worker threads.** A payload of at least ``BULK_BYTES`` is sent or received by a
  ``BulkWorker`` thread with ``sendmsg``/``recvmsg_into`` over the region's memoryviews
  (the GIL is released in the syscall and in ``poll``), so the copy leaves the event loop
  free and several connections copy on several cores at once.
- **Stripes.** A batch to one peer of at least ``2 * BULK_BYTES`` is cut into up to
  ``streams`` stripes of whole pieces (``split_stripes``), each sent as its own batch on its
  own connection to that peer; the batch completes when every stripe has.

A worker thread never outlives its connection: ``abort`` shuts the socket down, which wakes
``poll`` at once (and ``poll`` wakes every ``_POLL_MS`` to check ``stopping`` besides), and
the connection waits for its workers before closing the socket, so a descriptor is never
closed under a thread that still uses it, nor a region view held past the connection.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import select
import socket
from collections.abc import Callable, Sequence
from dataclasses import replace

from dualpath.transfer.tcp_wire import IOV_MAX, advance
from dualpath.transfer.types import TransferEntry

__all__ = ["BULK_BYTES", "BulkWorker", "move_blocking", "split_stripes"]

BULK_BYTES = 2 << 20  # a payload at least this large moves in a worker thread
_POLL_MS = 100
_SETTLE_S = 5.0  # the longest a closing connection waits for its threads (they take milliseconds)


def move_blocking(sock: socket.socket, bufs: list[memoryview], send: bool, stopping: Callable[[], bool]) -> None:
    """Send (``send``) or receive every byte of ``bufs`` on the non-blocking ``sock``; runs in
    a worker thread. ``bufs`` (byte-format views) is consumed.

    Raises:
        ConnectionResetError: the peer closed the connection before every byte arrived.
        ConnectionAbortedError: ``stopping()`` turned true (the connection is being closed).
        OSError: the connection broke (``BrokenPipeError``, ``ConnectionResetError``...).
    """
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT if send else select.POLLIN)
    try:
        while bufs:
            try:
                n = sock.sendmsg(bufs[:IOV_MAX]) if send else sock.recvmsg_into(bufs[:IOV_MAX])[0]
            except (BlockingIOError, InterruptedError):
                poller.poll(_POLL_MS)  # data or room, a shutdown (POLLHUP), or a timeout to check on
                if stopping():
                    raise ConnectionAbortedError("connection closing") from None
                continue
            if n == 0 and not send:
                raise ConnectionResetError("connection closed by peer")
            advance(bufs, n)
    finally:
        bufs.clear()  # a traceback keeps this frame: it must not keep region views alive


class BulkWorker:
    """One thread, started on first use, that runs one connection's bulk moves in order."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._jobs: set[asyncio.Future[None]] = set()
        self.stopping = False

    def run(self, sock: socket.socket, bufs: Sequence[memoryview], *, send: bool) -> asyncio.Future[None]:
        """Move ``bufs`` in the worker thread; the future resolves on the event loop.

        Raises:
            ConnectionAbortedError: the worker is closed (its connection is closing).
        """
        if self.stopping:
            raise ConnectionAbortedError(f"{self._name}: connection closing")
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
        views = [b.cast("B") for b in bufs if b.nbytes]  # the worker's own views: the caller may release its
        job = asyncio.get_running_loop().run_in_executor(self._pool, move_blocking, sock, views, send, self._is_stopping)
        del views  # the thread holds the only references: they die with the move
        self._jobs.add(job)
        job.add_done_callback(self._reap)
        return job

    def _reap(self, job: asyncio.Future[None]) -> None:
        self._jobs.discard(job)
        if not job.cancelled():
            job.exception()  # the owner reports failures its own way; retrieved here once

    async def settle(self, timeout_s: float = _SETTLE_S) -> None:
        """Wait until no move is under way (at most ``timeout_s``), then re-raise a
        cancellation that came meanwhile: a caller that gives up must not return while a
        thread still uses its memory. The owner has shut the socket down, so moves end
        promptly. (Cancellation is absorbed by hand: a batch's stripes run as plain asyncio
        tasks, which an anyio shield does not cover.)"""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        cancelled = False
        while self._jobs and (left := deadline - loop.time()) > 0:
            try:
                await asyncio.wait(set(self._jobs), timeout=left)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError

    @property
    def busy(self) -> bool:
        """Whether a move is queued or running."""
        return bool(self._jobs)

    def _is_stopping(self) -> bool:
        return self.stopping

    async def aclose(self, grace_s: float) -> None:
        """Stop taking moves and wait (up to ``grace_s``) for those under way; the caller has
        shut the socket down so they end promptly. Idempotent."""
        self.stopping = True
        await self.settle(grace_s)
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def split_stripes(entries: Sequence[TransferEntry], total: int, streams: int) -> list[list[TransferEntry]]:
    """Cut a batch of ``total`` bytes into at most ``streams`` stripes of about equal bytes,
    in order; an entry is cut between pieces (a contiguous one anywhere), never inside a
    piece. One stripe when the batch is under ``2 * BULK_BYTES`` or ``streams`` is 1."""
    n = min(streams, total // BULK_BYTES)
    if n < 2:
        return [list(entries)]
    target = -(-total // n)
    out: list[list[TransferEntry]] = [[]]
    room = target
    for entry in entries:
        while entry.nbytes:
            if room <= 0 and len(out) < n:
                out.append([])
                room = target
            if entry.nbytes <= room or len(out) == n:
                out[-1].append(entry)
                room -= entry.nbytes
                break
            head, entry = _cut(entry, room)
            if head is not None:
                out[-1].append(head)
                room -= head.nbytes
            else:
                room = 0  # a piece larger than the room left: it opens the next stripe
    return [s for s in out if s]


def _cut(entry: TransferEntry, room: int) -> tuple[TransferEntry | None, TransferEntry]:
    """``entry`` cut into a head of at most ``room`` bytes and the rest (head None if no
    whole piece fits); a contiguous entry is cut at ``room`` bytes exactly."""
    if entry.local_contiguous and entry.remote_contiguous:
        n = entry.nbytes
        head = TransferEntry(entry.local_offset, entry.remote_region, entry.remote_offset, room)
        rest = TransferEntry(entry.local_offset + room, entry.remote_region, entry.remote_offset + room, n - room)
        return head, rest
    k = room // entry.length
    if k == 0:
        return None, entry
    head = replace(entry, count=k)
    rest = replace(
        entry,
        local_offset=entry.local_offset + k * entry.local_stride,
        remote_offset=entry.remote_offset + k * entry.remote_stride,
        count=entry.count - k,
    )
    return head, rest
