"""The initiating side of one tcp transport connection: pipelined batches to one peer.

``submit`` sends a batch's request (and a write's payload) and returns a future;
``read_replies`` registers the connection's reader callback, which resolves futures as
replies arrive (in request order: the server answers a connection's batches in turn),
receiving a read's payload straight into the local region. When the connection breaks, every batch
in flight fails with the same error and the connection is marked dead (the transport dials
a new one for the next batch). ``spin`` polls for one batch's reply before its caller
awaits it, and every wake-up goes on polling while a reply is still coming, until nothing
has arrived for a short, learned while (``BusyPoll``), at most ``_MAX_SPIN_S`` per call: a
small batch completes without the event loop's sleep and wake-up, and a large reply streams
without one per socket buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from dualpath.transfer.busy_poll import DEFAULT_BUSY_POLL_US, BusyPoll, yield_cpu
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
    io_window,
    send_buffers,
)
from dualpath.transfer.tcp_wire import (
    advance as _advance,
)
from dualpath.transfer.tls import TlsStream
from dualpath.transfer.types import TransferEntry

__all__ = ["PeerConnection"]

_SCRATCH = 1 << 20
_CLOSE_GRACE_S = 1.0
_MAX_SPIN_S = 0.002  # one spin (a wait for a reply, or a wake-up's polling) holds the loop at most this long


@dataclass(slots=True)
class _Pending:
    op: Op
    future: asyncio.Future[int]
    views: list[memoryview]  # a read's destinations in the local region; empty for a write
    nbytes: int
    todo: list[memoryview] = field(default_factory=list)  # what the reply's body still has to fill
    error_body: memoryview | None = None  # set when the reply is an error


class PeerConnection:
    """One TCP connection (plain, or a TLS stream past its handshake) to a peer's tcp
    transport, carrying pipelined batches."""

    def __init__(self, sock: socket.socket | TlsStream, peer: str, busy_poll_us: float = DEFAULT_BUSY_POLL_US) -> None:
        self.sock = sock
        self.peer = peer
        self.poll = BusyPoll(busy_poll_us)
        self.received = 0  # bytes received: how a spin sees progress
        self.on_close: Callable[[], None] | None = None  # called once the socket is closed
        self._send_lock = asyncio.Lock()
        self._pending: dict[int, _Pending] = {}
        self._dead: TransferError | None = None
        self._fd = sock.fileno()
        self._head = bytearray(REPLY.size)
        self._head_view = memoryview(self._head)
        self._head_got = 0
        self._cur: _Pending | None = None  # the batch whose reply is being received
        self._ended: asyncio.Future[None] | None = None

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
        keys: Mapping[str, bytes],
    ) -> asyncio.Future[int]:
        """Send one batch (``keys``: each remote region's key, from its descriptor); the
        returned future resolves to its byte count once the reply arrives (for a read: once
        the bytes are in ``local``).

        Raises:
            PeerLostError: the connection is dead or broke while sending.
        """
        if self._dead is not None:
            raise PeerLostError(self.peer, f"connection is down ({self._dead})")
        views = local_views(local.buf, entries)
        nbytes = sum(v.nbytes for v in views)
        payload = nbytes if op is Op.WRITE else 0
        frame = encode_request(op, traffic_class, batch_id, entries, payload, keys)
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pending[batch_id] = _Pending(op, future, views if op is Op.READ else [], nbytes)
        started = False
        try:
            if op is Op.READ and not self._send_lock.locked():
                # The common small frame: one send, no lock round trip when the socket takes it.
                try:
                    sent = self.sock.send(frame)
                except BlockingIOError:  # the socket is full of earlier batches: wait below
                    sent = 0
                if sent == len(frame):
                    return future
                started = True
                async with self._send_lock:
                    await send_buffers(self.sock, [memoryview(frame)[sent:]])
                return future
            async with self._send_lock:
                started = True
                await send_buffers(self.sock, [frame, *views] if op is Op.WRITE else [frame])
        except OSError as exc:
            error = PeerLostError(self.peer, f"send failed: {exc!r}")
            self.abort(error)
            _forget(future)  # failed by abort; the caller gets ``error`` instead
            raise error from exc
        except BaseException:
            if (item := self._pending.pop(batch_id, None)) is not None:
                _release(item.views)
            if started:  # cancelled mid-frame: the stream cannot be resynchronised
                self.abort(PeerLostError(self.peer, "a batch was cancelled while being sent"))
            _forget(future)  # nobody awaits it
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
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes any blocked sender
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)

    async def read_replies(self) -> None:
        """The connection's reader: resolve batches until the connection ends.

        Replies are read by a reader callback registered once with the event loop (not a
        receive per await): a wake-up reads the reply header and a read's payload straight
        into the local region and resolves the batch's future, so the caller is the only task
        that runs per batch."""
        loop = asyncio.get_running_loop()
        self._ended = loop.create_future()
        if self._dead is not None:
            self._ended.set_result(None)
        else:
            loop.add_reader(self._fd, self._on_loop_readable)
        try:
            await self._ended
        except asyncio.CancelledError:
            self.abort(PeerLostError(self.peer, "transport closed"))
            raise
        finally:
            with contextlib.suppress(ValueError, OSError):  # already closed
                loop.remove_reader(self._fd)
            # A sender woken by the shutdown fails fast and frees the lock; then close.
            acquired = False
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                acquired = await asyncio.wait_for(self._send_lock.acquire(), _CLOSE_GRACE_S)
            self.close_socket()
            if acquired:  # queued senders now fail on the closed socket instead of waiting
                self._send_lock.release()

    def close_socket(self) -> None:
        """Close the socket (idempotent) and call ``on_close`` once. The reader does it when
        it ends; the transport again on close, for a connection whose reader never ran (a
        connection whose batches all completed while polling never yields to the loop)."""
        if self.sock.fileno() < 0:
            return
        self.sock.close()
        if self.on_close is not None:
            self.on_close()

    def spin(self, future: asyncio.Future[int]) -> None:
        """Poll for ``future``'s reply instead of sleeping (see the module docstring);
        returns once it is done, or nothing has arrived for the learned window, or after
        ``_MAX_SPIN_S``. What is not done by then, the event loop delivers."""
        self._spin(time.perf_counter(), future)

    def _on_loop_readable(self) -> None:
        began = time.perf_counter()
        self.poll.woke(began)
        self._on_readable()
        self._spin(began, None)

    def _spin(self, began: float, future: asyncio.Future[int] | None) -> None:
        poll = self.poll
        cap = began + _MAX_SPIN_S
        last = now = time.perf_counter()
        got = self.received
        while now - last < poll.window_s and now < cap and self._dead is None:
            if future is not None and future.done():
                poll.caught()
                return
            if future is None and not self._pending and self._cur is None:
                return  # nothing in flight: nothing to wait for
            self._on_readable()
            now = time.perf_counter()
            if self.received != got:
                got, last = self.received, now
            else:
                yield_cpu()
        if future is not None and future.done():
            poll.caught()
        elif self._dead is None:
            poll.missed(last)  # waiting since the last byte came; the next wake-up teaches the window

    def _on_readable(self) -> None:
        try:
            while self._dead is None and self._receive():
                pass
        except (OSError, ConnectionError) as exc:
            self.abort(PeerLostError(self.peer, f"connection lost: {exc!r}"))
        except TransferError as exc:
            self.abort(exc)

    def _receive(self) -> bool:
        """One step of the reply state machine; False when the socket has nothing more yet.

        Raises:
            ConnectionResetError: the peer closed the connection.
            TransferError: a malformed reply (the stream cannot be resynchronised).
        """
        cur = self._cur
        if cur is None:  # a reply header
            got = _recv(self.sock, [self._head_view[self._head_got :]])
            if got is None:
                return False
            self.received += got
            self._head_got += got
            if self._head_got < REPLY.size:
                return True
            self._head_got = 0
            magic, status, _op, _, error_len, batch_id, payload_len = REPLY.unpack(self._head)
            pending = self._pending.pop(batch_id, None)
            if magic != REPLY_MAGIC or pending is None or error_len > MAX_ERROR_BYTES:
                raise TransferError(f"{self.peer}: malformed reply (batch {batch_id})")
            self._cur = pending
            if status != Status.OK:
                pending.todo = [memoryview(bytearray(error_len))] if error_len else []
                pending.error_body = pending.todo[0] if error_len else memoryview(b"")
            elif pending.op is Op.READ:
                if payload_len != pending.nbytes:
                    raise TransferError(f"{self.peer}: read reply of {payload_len} B for {pending.nbytes} B")
                # a read whose caller gave up drains its reply into scratch
                pending.todo = [b for b in pending.views if b.nbytes] if not pending.future.done() else _scratch(payload_len)
            else:
                pending.todo = []
            return True
        if cur.todo:  # the reply's body: an error, or a read's payload into the region
            got = _recv(self.sock, io_window(cur.todo))
            if got is None:
                return False
            self.received += got
            _advance(cur.todo, got)
            if cur.todo:
                return True
        self._cur = None
        _release(cur.views)
        if not cur.future.done():
            if cur.error_body is not None:
                cur.future.set_exception(decode_error(bytes(cur.error_body), self.peer))
            else:
                cur.future.set_result(cur.nbytes)
        return bool(self._pending)  # nothing else awaited: epoll wakes us if more comes

    def _fail_all(self, error: TransferError) -> None:
        pending, self._pending = self._pending, {}
        if self._cur is not None:
            pending[-1] = self._cur
            self._cur = None
        for item in pending.values():
            _release(item.views)
            if not item.future.done():
                item.future.set_exception(error)


def _recv(sock: socket.socket | TlsStream, bufs: list[memoryview]) -> int | None:
    """Receive into ``bufs``; the byte count, or None when nothing is there yet.

    Raises:
        ConnectionResetError: the peer closed the connection.
    """
    try:
        got = sock.recvmsg_into(bufs)[0] if len(bufs) > 1 else sock.recv_into(bufs[0])
    except (BlockingIOError, InterruptedError):
        return None
    if got == 0:
        raise ConnectionResetError("connection closed by peer")
    return got


def _forget(future: asyncio.Future[int]) -> None:
    """Settle a future nobody will await, without a 'never retrieved' report."""
    if not future.done():
        future.cancel()
    elif not future.cancelled():
        future.exception()


def _scratch(nbytes: int) -> list[memoryview]:
    """Throw-away buffers for ``nbytes`` of a reply nobody waits for any more."""
    out = []
    while nbytes:
        take = min(nbytes, _SCRATCH)
        out.append(memoryview(bytearray(take)))
        nbytes -= take
    return out


def local_views(buf: memoryview, entries: Sequence[TransferEntry]) -> list[memoryview]:
    """The local ranges of ``entries`` in order, as few views as possible: entries (or
    pieces) that follow each other in local memory share one view; empty ranges are left out.

    Per entry it reads the fields, not the properties: a batch of small blocks has hundreds
    of entries and this runs for every one of them."""
    starts: list[int] = []
    ends: list[int] = []
    end = -1  # where the last view ends (-1: no view yet)
    for e in entries:
        length, count = e.length, e.count
        if not length:
            continue
        stride = e.local_stride
        if count == 1 or stride == length:  # one contiguous range
            lo = e.local_offset
            if lo == end:
                end = ends[-1] = lo + length * count
            else:
                starts.append(lo)
                end = lo + length * count
                ends.append(end)
            continue
        for lo in range(e.local_offset, e.local_offset + count * stride, stride):
            if lo == end:
                end = ends[-1] = lo + length
            else:
                starts.append(lo)
                end = lo + length
                ends.append(end)
    return [buf[lo:hi] for lo, hi in zip(starts, ends, strict=True)]


def _release(views: list[memoryview]) -> None:
    for view in views:
        view.release()
    views.clear()
