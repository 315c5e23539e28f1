"""The initiating side of one tcp transport connection: pipelined batches to one peer.

``submit`` sends a batch's request (and a write's payload) and returns a future;
``read_replies``, the connection's reader task, resolves futures as replies arrive, receiving
a read's payload straight into the local region. When the connection breaks, every batch
in flight fails with the same error and the connection is marked dead (the transport dials
a new one for the next batch).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from dualpath.transfer.errors import PeerLostError, TransferError
from dualpath.transfer.region import MemoryRegion
from dualpath.transfer.tcp_wire import (
    MAX_ERROR_BYTES,
    REPLY,
    REPLY_MAGIC,
    Op,
    Status,
    decode_error,
    encode_request,
    recv_exactly,
    recv_into,
    send_buffers,
)
from dualpath.transfer.types import TransferEntry

__all__ = ["PeerConnection"]

_SCRATCH = 1 << 20
_CLOSE_GRACE_S = 1.0


@dataclass(slots=True)
class _Pending:
    op: Op
    future: asyncio.Future[int]
    views: list[memoryview]  # a read's destinations in the local region; empty for a write
    nbytes: int


class PeerConnection:
    """One TCP connection to a peer's tcp transport, carrying pipelined batches."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self._send_lock = asyncio.Lock()
        self._pending: dict[int, _Pending] = {}
        self._dead: TransferError | None = None

    @property
    def alive(self) -> bool:
        """False once the connection broke or was aborted."""
        return self._dead is None

    async def submit(
        self,
        op: Op,
        traffic_class: int,
        batch_id: int,
        local: MemoryRegion,
        entries: Sequence[TransferEntry],
    ) -> asyncio.Future[int]:
        """Send one batch; the returned future resolves to its byte count once the reply
        arrives (for a read: once the bytes are in ``local``).

        Raises:
            PeerLostError: the connection is dead or broke while sending.
        """
        if self._dead is not None:
            raise PeerLostError(self.peer, f"connection is down ({self._dead})")
        views = local_views(local.buf, entries)
        nbytes = sum(v.nbytes for v in views)
        payload = nbytes if op is Op.WRITE else 0
        frame = encode_request(op, traffic_class, batch_id, entries, payload)
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pending[batch_id] = _Pending(op, future, views if op is Op.READ else [], nbytes)
        started = False
        try:
            async with self._send_lock:
                started = True
                await send_buffers(self.sock, [frame, *views] if op is Op.WRITE else [frame])
        except OSError as exc:
            error = PeerLostError(self.peer, f"send failed: {exc!r}")
            self.abort(error)
            raise error from exc
        except BaseException:
            if started:  # cancelled mid-frame: the stream cannot be resynchronised
                self.abort(PeerLostError(self.peer, "a batch was cancelled while being sent"))
            elif (item := self._pending.pop(batch_id, None)) is not None:
                _release(item.views)
            raise
        finally:
            if op is Op.WRITE:
                _release(views)
        return future

    def abort(self, error: TransferError) -> None:
        """Fail every batch in flight with ``error`` and shut the connection down."""
        if self._dead is None:
            self._dead = error
        self._fail_all(self._dead)
        with contextlib.suppress(OSError):  # OSError: already closed
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader and any blocked sender

    async def read_replies(self) -> None:
        """The connection's reader task: resolve batches until the connection ends."""
        try:
            while True:
                await self._read_one()
        except asyncio.CancelledError:
            self.abort(PeerLostError(self.peer, "transport closed"))
            raise
        except (OSError, ConnectionError) as exc:
            self.abort(PeerLostError(self.peer, f"connection lost: {exc!r}"))
        except TransferError as exc:
            self.abort(exc)
        finally:
            # A sender woken by the shutdown fails fast and frees the lock; then close.
            acquired = False
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                acquired = await asyncio.wait_for(self._send_lock.acquire(), _CLOSE_GRACE_S)
            self.sock.close()
            if acquired:  # queued senders now fail on the closed socket instead of waiting
                self._send_lock.release()

    async def _read_one(self) -> None:
        head = await recv_exactly(self.sock, REPLY.size)
        magic, status, _op, _, error_len, batch_id, payload_len = REPLY.unpack(head)
        pending = self._pending.pop(batch_id, None)
        if magic != REPLY_MAGIC or pending is None or error_len > MAX_ERROR_BYTES:
            raise TransferError(f"{self.peer}: malformed reply (batch {batch_id})")
        try:
            if status != Status.OK:
                error = decode_error(bytes(await recv_exactly(self.sock, error_len)), self.peer)
                if not pending.future.done():
                    pending.future.set_exception(error)
                return
            if pending.op is Op.READ:
                if payload_len != pending.nbytes:
                    raise TransferError(
                        f"{self.peer}: read reply of {payload_len} B for {pending.nbytes} B"
                    )
                if pending.future.done():
                    await _discard(self.sock, payload_len)  # its caller gave up
                else:
                    await recv_into(self.sock, pending.views)
            if not pending.future.done():
                pending.future.set_result(pending.nbytes)
        except BaseException as exc:
            # This batch left the pending table when its reply header arrived: fail it here.
            if not pending.future.done():
                if isinstance(exc, TransferError):
                    pending.future.set_exception(exc)
                else:
                    closed = isinstance(exc, asyncio.CancelledError)
                    detail = "transport closed" if closed else f"connection lost: {exc!r}"
                    pending.future.set_exception(PeerLostError(self.peer, detail))
            raise
        finally:
            _release(pending.views)

    def _fail_all(self, error: TransferError) -> None:
        pending, self._pending = self._pending, {}
        for item in pending.values():
            _release(item.views)
            if not item.future.done():
                item.future.set_exception(error)


def local_views(buf: memoryview, entries: Sequence[TransferEntry]) -> list[memoryview]:
    """The local ranges of ``entries`` in order: one view per entry whose local pieces are
    contiguous, one per piece otherwise (empty ranges left out)."""
    views = []
    for e in entries:
        if not e.nbytes:
            continue
        if e.local_contiguous:
            views.append(buf[e.local_offset : e.local_offset + e.nbytes])
        else:
            views.extend(buf[lo : lo + n] for lo, _, n in e.pieces())
    return views


def _release(views: list[memoryview]) -> None:
    for view in views:
        view.release()
    views.clear()


async def _discard(sock: socket.socket, nbytes: int) -> None:
    scratch = memoryview(bytearray(min(nbytes, _SCRATCH)))
    while nbytes:
        take = min(nbytes, scratch.nbytes)
        await recv_into(sock, [scratch[:take]])
        nbytes -= take
