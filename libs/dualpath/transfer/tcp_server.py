"""The serving side of the tcp transport: answers one peer connection's batches.

Requests on a connection are handled in order; the peer pipelines them, so the socket
buffers keep the link busy while one is being answered. Every entry is checked before any
byte moves: a bad batch gets an error reply (a write's payload is read and dropped), and the
connection keeps serving. The first check is the key: every region a request names must come
with the key its descriptor handed out (compared in constant time, once per region per frame);
a refusal is logged with the peer's address, and a connection that presents
``_MAX_REFUSALS`` wrong keys is closed (an honest peer with a stale descriptor gets its error
replies; a prober does not get to fill the log). A stream that cannot be parsed closes its
connection only; the other connections keep serving.

The connection is a state machine driven by the event loop's reader callback (registered
once, not per receive): a wake-up reads whatever arrived — request headers and entry tables
land in a staging buffer, several pipelined requests at a time; a write's payload goes
straight into the region — and answers every complete request with one ``sendmsg`` (a
read's reply and its payload together). That is one loop wake-up and two or three syscalls
per batch, the floor of an event-loop server; only a reply the socket cannot take at once
waits for the writer callback (and reading pauses meanwhile, so replies stay in order).

A wake-up does not hand the connection back to the event loop as soon as it would block:
it polls the socket (the next request, the rest of a write's payload, room for a reply)
until nothing has moved for a short, learned while (``BusyPoll``), so a back-to-back
stream of batches is answered without the wake-up a sleeping process pays, and a large
reply streams without one per socket buffer; one callback keeps the loop at most
``_MAX_CALLBACK_S`` however busy the connection is.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dualpath.telemetry.logs import get_logger
from dualpath.transfer.busy_poll import DEFAULT_BUSY_POLL_US, BusyPoll, yield_cpu
from dualpath.transfer.errors import AccessDeniedError, OutOfBoundsError, TransferError, UnknownRegionError
from dualpath.transfer.region import MemoryRegion
from dualpath.transfer.tcp_wire import (
    ENTRY,
    MAX_ENTRIES,
    MAX_TABLE_BYTES,
    REPLY,
    REPLY_MAGIC,
    REQUEST,
    REQUEST_MAGIC,
    Op,
    Status,
    decode_table,
    encode_error,
    io_window,
)
from dualpath.transfer.tcp_wire import (
    advance as _advance,
)
from dualpath.transfer.tls import TlsStream

__all__ = ["serve_connection"]

_log = get_logger("transfer.tcp")
_STAGE = 1 << 16  # staging buffer for headers and tables (grows for a larger table)
_DRAIN_CHUNK = 1 << 20
_MAX_CALLBACK_S = 0.002  # one reader callback (its polls included) holds the loop at most this long
_MAX_REFUSALS = 8  # wrong keys one connection may present before it is closed
MAX_STAGING_BYTES = 1 << 30  # gather/scatter copies of strided entries one request may need

Lookup = Callable[[str], "MemoryRegion | None"]


class _Malformed(Exception):
    """A request stream that cannot be parsed (nor resynchronised), or a peer that keeps
    presenting wrong keys: the connection is closed."""


@dataclass(slots=True)
class _Write:
    """A write whose payload is being received (into the region, or dropped after an error)."""

    batch_id: int
    todo: list[memoryview]  # destinations still to fill, in order
    views: list[memoryview]  # every destination (released at the end)
    scatters: list[tuple[np.ndarray, memoryview]] = field(default_factory=list)
    error: TransferError | None = None
    drain: int = 0  # bytes still to drop (error case)


async def serve_connection(
    sock: socket.socket | TlsStream,
    lookup: Lookup,
    node_id: str,
    busy_poll_us: float = DEFAULT_BUSY_POLL_US,
    *,
    peer: str = "",
) -> None:
    """Answer batches on ``sock`` (a plain socket, or a TLS stream past its handshake) until
    the peer closes it; closes ``sock`` at the end.

    ``lookup`` maps a region id to the registered, open region (or ``None``);
    ``busy_poll_us`` is the longest poll for the next request (0: none); ``peer`` is the
    peer's address, for the log.
    """
    conn = _Connection(sock, lookup, node_id, asyncio.get_running_loop(), BusyPoll(busy_poll_us), peer=peer)
    try:
        conn.start()
        await conn.done
    finally:
        conn.close()


class _Connection:
    """One served connection (see the module docstring)."""

    def __init__(
        self,
        sock: socket.socket | TlsStream,
        lookup: Lookup,
        node_id: str,
        loop: asyncio.AbstractEventLoop,
        poll: BusyPoll,
        *,
        peer: str = "",
    ) -> None:
        self.sock, self.fd, self.lookup, self.node_id, self.loop = sock, sock.fileno(), lookup, node_id, loop
        self.poll = poll
        self.peer = peer
        self.refusals = 0  # requests refused for a wrong or missing key
        # TLS keeps decrypted bytes the kernel no longer reports as readable: read until the
        # stream says it would block instead of trusting epoll to wake us for them.
        self.buffered = isinstance(sock, TlsStream)
        self.moved = 0  # bytes received and sent: how a spin sees progress
        self.done: asyncio.Future[None] = loop.create_future()
        self.stage = bytearray(_STAGE)
        self.lo = self.hi = 0  # staged, unparsed bytes: stage[lo:hi]
        self.write: _Write | None = None
        self.out: list[memoryview] = []  # reply bytes the socket has not taken yet
        self.out_release: list[memoryview] = []  # region views to release once ``out`` is sent
        self.reading = False

    def start(self) -> None:
        self.loop.add_reader(self.fd, self._on_readable)
        self.reading = True
        if self.buffered:  # the first request may have come with the handshake's last flight
            self.loop.call_soon(self._on_readable)

    def close(self) -> None:
        if self.reading:
            self.loop.remove_reader(self.fd)
            self.reading = False
        if self.out:
            self.loop.remove_writer(self.fd)
        self._release(self.out_release)
        self.out.clear()
        if self.write is not None:
            self.write.scatters.clear()
            self._release(self.write.views)
            self.write = None
        self.sock.close()

    def _end(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    # ---- reading -------------------------------------------------------------------------
    def _on_readable(self) -> None:
        try:
            began = time.perf_counter()
            self.poll.woke(began)
            self._pump()
            self._spin(began)
        except _Malformed as exc:
            self._drop(exc)
        except (ConnectionError, OSError):
            self._end()  # the peer vanished (mid-batch or between batches); its side reports it
        except Exception:  # a bug must cost this connection, not the server's event loop
            _log.exception("tcp_connection_failed", node=self.node_id, peer=self.peer)
            self._end()

    def _pump(self) -> None:
        """Handle everything that can be handled without waiting."""
        while not self.out and not self.done.done():
            if self.write is not None:
                if not self._receive_payload():
                    return
                continue
            if self._parse_one():
                if self.lo == self.hi and self.write is None and not self.buffered:
                    return  # answered all that came; epoll wakes us for more (saves an EAGAIN recv)
                continue
            if not self._receive_stage():
                return

    def _spin(self, began: float) -> None:
        """Go on without the event loop while the peer keeps the connection moving: poll
        (the next request, a write's payload, room for a reply) until nothing has moved
        for the learned window, or ``_MAX_CALLBACK_S`` after ``began`` (the callback's start)."""
        poll = self.poll
        cap = began + _MAX_CALLBACK_S
        last = now = time.perf_counter()
        moved = self.moved
        while now - last < poll.window_s and now < cap and not self.done.done():
            if self.out and self._flush():
                self._resume_reading()
            self._pump()
            now = time.perf_counter()
            if self.moved != moved:
                moved, last = self.moved, now
            else:
                yield_cpu()
        if not self.done.done():
            poll.missed(last)  # waiting since the last byte moved; the next wake-up teaches the window

    def _receive_stage(self) -> bool:
        """Read into the staging buffer; False when nothing is there yet."""
        if self.lo:
            n = self.hi - self.lo
            self.stage[:n] = self.stage[self.lo : self.hi]
            self.lo, self.hi = 0, n
        if self.hi == len(self.stage):
            self.stage.extend(bytes(len(self.stage)))  # a request larger than the stage: grow
        try:
            got = self.sock.recv_into(memoryview(self.stage)[self.hi :])
        except (BlockingIOError, InterruptedError):
            return False
        if got == 0:
            raise ConnectionResetError("connection closed by peer")
        self.hi += got
        self.moved += got
        return True

    def _parse_one(self) -> bool:
        """Answer (or start) the first staged request if it is complete."""
        have = self.hi - self.lo
        if have < REQUEST.size:
            return False
        magic, op, _cls, n_regions, n_entries, table_len, batch_id, payload_len = REQUEST.unpack_from(self.stage, self.lo)
        if magic != REQUEST_MAGIC or op not in (Op.READ, Op.WRITE) or n_entries > MAX_ENTRIES or table_len > MAX_TABLE_BYTES:
            raise _Malformed("malformed request")
        need = REQUEST.size + table_len + n_entries * ENTRY.size
        if have < need:
            if need > len(self.stage):
                self.stage.extend(bytes(need - len(self.stage)))
            return False
        start = self.lo + REQUEST.size
        table = bytes(self.stage[start : start + table_len])
        rows = bytes(self.stage[start + table_len : self.lo + need])
        self.lo += need
        self._start(Op(op), batch_id, table, n_regions, rows, payload_len)
        return True

    def _start(self, op: Op, batch_id: int, table: bytes, n_regions: int, rows: bytes, payload_len: int) -> None:
        scatters: list[tuple[np.ndarray, memoryview]] = []
        try:
            views = _resolve(self.lookup, self.node_id, table, n_regions, memoryview(rows), op, scatters)
            total = sum(v.nbytes for v in views)
            if op is Op.WRITE and payload_len != total:
                scatters.clear()
                self._release(views)
                raise TransferError(f"write payload of {payload_len} B for {total} B of entries")
        except TransferError as exc:
            if isinstance(exc, AccessDeniedError):
                self._refused(op, exc)
            if op is Op.WRITE and payload_len:
                self.write = _Write(batch_id, [], [], error=exc, drain=payload_len)
            else:
                self._send_error(op, batch_id, exc)
            return
        if op is Op.WRITE:
            self.write = _Write(batch_id, list(views), views, scatters)
        else:
            self._send([memoryview(REPLY.pack(REPLY_MAGIC, Status.OK, op, 0, 0, batch_id, total)), *views], views)

    def _refused(self, op: Op, exc: AccessDeniedError) -> None:
        """Log a request refused for its key; close the connection after too many.

        Raises:
            _Malformed: this connection has presented ``_MAX_REFUSALS`` wrong keys.
        """
        self.refusals += 1
        _log.warning("tcp_key_refused", node=self.node_id, peer=self.peer, region=exc.region_id, op=op.name, refusals=self.refusals)
        if self.refusals >= _MAX_REFUSALS:
            raise _Malformed(f"{self.refusals} requests with wrong keys")

    def _drop(self, exc: _Malformed) -> None:
        _log.warning("tcp_connection_dropped", node=self.node_id, peer=self.peer, reason=str(exc))
        self._end()

    def _receive_payload(self) -> bool:
        """Fill the current write's destinations (staged bytes first); answer it when full.
        False when the socket has nothing more yet."""
        w = self.write
        assert w is not None
        if w.error is not None:
            return self._drain(w)
        while w.todo and self.lo < self.hi:  # bytes that arrived with the header
            dst = w.todo[0]
            take = min(dst.nbytes, self.hi - self.lo)
            dst[:take] = self.stage[self.lo : self.lo + take]
            self.lo += take
            if take == dst.nbytes:
                w.todo.pop(0)
            else:
                w.todo[0] = dst[take:]
        while w.todo:
            try:
                got = self.sock.recvmsg_into(io_window(w.todo))[0]
            except (BlockingIOError, InterruptedError):
                return False
            if got == 0:
                raise ConnectionResetError("connection closed by peer")
            _advance(w.todo, got)
            self.moved += got
        for target, scratch in w.scatters:  # strided pieces: received together, placed at C speed
            target[...] = np.frombuffer(scratch, dtype=np.uint8).reshape(target.shape)
        w.scatters.clear()
        self.write = None
        self._send([memoryview(REPLY.pack(REPLY_MAGIC, Status.OK, Op.WRITE, 0, 0, w.batch_id, 0))], w.views)
        return True

    def _drain(self, w: _Write) -> bool:
        """Drop a rejected write's payload to stay in sync, then send its error."""
        staged = min(w.drain, self.hi - self.lo)
        self.lo += staged
        w.drain -= staged
        scratch = memoryview(bytearray(min(w.drain, _DRAIN_CHUNK))) if w.drain else None
        while w.drain:
            assert scratch is not None
            try:
                got = self.sock.recv_into(scratch[: min(w.drain, scratch.nbytes)])
            except (BlockingIOError, InterruptedError):
                return False
            if got == 0:
                raise ConnectionResetError("connection closed by peer")
            w.drain -= got
            self.moved += got
        self.write = None
        assert w.error is not None
        self._send_error(Op.WRITE, w.batch_id, w.error)
        return True

    # ---- writing -------------------------------------------------------------------------
    def _send_error(self, op: Op, batch_id: int, exc: TransferError) -> None:
        body = encode_error(exc)
        self._send([memoryview(REPLY.pack(REPLY_MAGIC, Status.ERROR, op, 0, len(body), batch_id, 0)), memoryview(body)], [])

    def _send(self, bufs: list[memoryview], release: list[memoryview]) -> None:
        """Send ``bufs`` now as far as the socket takes them; the rest from the writer
        callback (or a spin), with reading paused (replies go out in request order)."""
        self.out = [b.cast("B") if b.format != "B" else b for b in bufs if b.nbytes]
        self.out_release = release
        if self._flush():
            return
        if self.reading:
            self.loop.remove_reader(self.fd)
            self.reading = False
        self.loop.add_writer(self.fd, self._on_writable)

    def _flush(self) -> bool:
        """Send what the socket takes of ``out``; True (views released) once all is sent.

        Raises:
            OSError: the connection broke.
        """
        out = self.out
        while out:
            try:
                sent = self.sock.sendmsg(io_window(out))
            except (BlockingIOError, InterruptedError):
                return False
            _advance(out, sent)
            self.moved += sent
        self._release(self.out_release)
        return True

    def _resume_reading(self) -> None:
        """The reply that paused reading is out: stop waiting for room, read again."""
        self.loop.remove_writer(self.fd)
        if not self.reading:
            self.loop.add_reader(self.fd, self._on_readable)
            self.reading = True

    def _on_writable(self) -> None:
        try:
            began = time.perf_counter()
            self.poll.woke(began)
            if not self._flush():
                self._spin(began)
                return
            self._resume_reading()
            self._pump()  # requests staged meanwhile
            self._spin(began)
        except _Malformed as exc:
            self._drop(exc)
        except (ConnectionError, OSError):
            self._end()
        except Exception:  # as in _on_readable
            _log.exception("tcp_connection_failed", node=self.node_id, peer=self.peer)
            self._end()

    @staticmethod
    def _release(views: list[memoryview]) -> None:
        for view in views:
            view.release()
        views.clear()


def _resolve(
    lookup: Lookup,
    node_id: str,
    table: bytes,
    n_regions: int,
    rows: memoryview,
    op: Op,
    scatters: list[tuple[np.ndarray, memoryview]],
) -> list[memoryview]:
    """Check every region's key and every entry, and return the memoryviews the entries'
    bytes go from (read) or to (write), in order. A strided entry whose pieces are apart is
    gathered into one new buffer for a read; for a write it is received into a scratch buffer
    and ``(strided view, scratch)`` is appended to ``scatters`` for the caller to place.

    Raises:
        UnknownRegionError: a named region is not registered here.
        AccessDeniedError: a region's key in the table is not the region's (checked for every
            region before any view of any region is made).
        OutOfBoundsError: an entry reaches outside its region.
        TransferError: the tables do not match each other, or strided entries would need more
            than ``MAX_STAGING_BYTES`` of copies.
    """
    regions: list[MemoryRegion] = []
    for name, key in decode_table(table, n_regions):
        region = lookup(name)
        if region is None:
            raise UnknownRegionError(name, f"not registered at node {node_id!r}")
        if not region.accepts(key):
            raise AccessDeniedError(name, f"at node {node_id!r}")
        regions.append(region)
    bufs = [r.buf for r in regions]
    sizes = [r.size for r in regions]
    arrays: dict[int, np.ndarray] = {}
    views: list[memoryview] = []
    append = views.append
    arr = strided = None
    staged = 0  # bytes of gather/scatter copies so far
    try:
        for slot, offset, length, count, stride in ENTRY.iter_unpack(rows):
            if slot >= n_regions:
                raise TransferError("an entry names a region outside the region table")
            if count == 1:  # the common entry, checked without the strided arithmetic
                if offset > sizes[slot] or length > sizes[slot] - offset:
                    raise OutOfBoundsError(regions[slot].region_id, offset, length, sizes[slot])
                if length:
                    append(bufs[slot][offset : offset + length])
                continue
            if count < 1 or stride < length:
                raise TransferError(f"bad strided entry: count {count}, stride {stride}, length {length}")
            size = sizes[slot]
            span = (count - 1) * stride + length
            if offset > size or span > size - offset:
                raise OutOfBoundsError(regions[slot].region_id, offset, span, size)
            if not length:
                continue
            if stride == length:
                views.append(bufs[slot][offset : offset + length * count])
                continue
            staged += length * count
            if staged > MAX_STAGING_BYTES:
                raise TransferError(f"strided entries need over {MAX_STAGING_BYTES} B of staging copies")
            arr = arrays.get(slot)
            if arr is None:
                arr = arrays[slot] = np.frombuffer(bufs[slot], dtype=np.uint8)
            strided = np.lib.stride_tricks.as_strided(arr[offset:], shape=(count, length), strides=(stride, 1))
            if op is Op.READ:
                views.append(memoryview(np.ascontiguousarray(strided)).cast("B"))  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+
            else:
                scratch = memoryview(bytearray(length * count))
                scatters.append((strided, scratch))
                views.append(scratch)
    except BaseException:
        scatters.clear()
        for view in views:
            view.release()
        raise
    finally:
        # No array over a region may outlive this call in a frame (a traceback keeps frames):
        # region.close() must not find the buffer still exported.
        arrays.clear()
        arr = strided = None
    return views
