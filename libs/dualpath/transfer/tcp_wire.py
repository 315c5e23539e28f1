"""Frames of the tcp transport and scatter/gather socket I/O.

One request frame carries a whole batch; one reply frame answers it (one round trip per
batch). Request::

    REQUEST header (32 B) | region table [n_regions records] | entries [n, 32 B] | payload
    region record: key (16 B) | id length (u16) | id (utf-8)
    entry: region slot, remote offset, piece length, piece count, remote stride
    payload: a write's bytes, entries concatenated in order; empty for a read

Each region the batch names appears once in the table, with the key its descriptor handed
out: the server checks one key per region per frame, not one per entry.

Reply::

    REPLY header (32 B) | error body (msgpack, only when status != OK) | payload
    payload: a read's bytes, entries concatenated in order; empty otherwise

Payload bytes go straight between sockets and region memory with ``sendmsg`` /
``recvmsg_into`` over lists of memoryviews: no intermediate copies, one syscall for many
small entries.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import msgpack

from dualpath.transfer.errors import AccessDeniedError, OutOfBoundsError, TransferError, UnknownRegionError
from dualpath.transfer.region import KEY_BYTES
from dualpath.transfer.types import TransferEntry

if TYPE_CHECKING:
    from dualpath.transfer.tls import TlsStream

__all__ = [
    "advance",
    "io_window",
    "ENTRY",
    "IOV_MAX",
    "MAX_ENTRIES",
    "MAX_TABLE_BYTES",
    "REPLY",
    "REQUEST",
    "Op",
    "Status",
    "decode_error",
    "decode_table",
    "encode_error",
    "encode_request",
    "recv_exactly",
    "recv_into",
    "send_buffers",
    "wait_fd",
]

REQUEST = struct.Struct("<4sBBHIIQQ")  # magic, op, class, n_regions, n_entries, table, id, payload
REPLY = struct.Struct("<4sBBHIQQ")  # magic, status, op, reserved, error_len, id, payload
REQUEST_MAGIC = b"DPq3"  # 2: strided entries; 3: a key beside each region id
REPLY_MAGIC = b"DPr1"
ENTRY = struct.Struct("<IQQIQ")  # region slot, offset, length, count, stride: 32 B per entry
_ID_LEN = struct.Struct("<H")  # a region record's id length, after its key
_U64_MAX = (1 << 64) - 1
_NO_KEY = bytes(KEY_BYTES)  # sent for a region whose descriptor has no key: the server refuses it
MAX_ENTRIES = 1 << 20  # bounds the entry table a server will buffer (32 MiB)
MAX_TABLE_BYTES = 1 << 20  # bounds the region-id table
MAX_ERROR_BYTES = 1 << 16
IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 1024  # buffers per sendmsg/recvmsg
_IOV_MAX = IOV_MAX
IO_WINDOW_BYTES = 4 << 20  # one sendmsg/recvmsg is handed buffers for about this much (a socket buffer's worth)


def io_window(bufs: list[memoryview]) -> list[memoryview]:
    """The leading buffers of ``bufs`` one ``sendmsg``/``recvmsg_into`` is handed: about a
    socket buffer's worth (``IO_WINDOW_BYTES``), at most ``IOV_MAX``. The kernel imports every
    buffer it is given on every call, however few bytes move, so a batch of hundreds of large
    blocks is not handed over whole on each call."""
    total = n = 0
    for buf in bufs:
        n += 1
        total += buf.nbytes
        if total >= IO_WINDOW_BYTES or n == _IOV_MAX:
            return bufs[:n] if n < len(bufs) else bufs
    return bufs


class Op(IntEnum):
    """What a request asks for."""

    READ = 1
    WRITE = 2


class Status(IntEnum):
    """How a reply answers."""

    OK = 0
    ERROR = 1


@functools.lru_cache(maxsize=64)
def _entries_struct(n: int) -> struct.Struct:
    return struct.Struct("<" + "IQQIQ" * n)


def encode_request(
    op: Op,
    traffic_class: int,
    batch_id: int,
    entries: Sequence[TransferEntry],
    payload_len: int,
    keys: Mapping[str, bytes],
) -> bytes:
    """Header, region table and entry table of a request (the payload is sent after it);
    ``keys`` maps each region id to the key its descriptor carries (a region without one is
    sent with a key no region has, and refused by the server).

    Raises:
        ValueError: a region id is longer than 65535 bytes, or the batch exceeds the frame limits.
    """
    index: dict[str, int] = {}
    flat: list[int] = []  # [n_entries * 5]
    last, slot = None, 0  # the previous entry's region and its slot: a batch names few regions
    for entry in entries:
        rid = entry.remote_region
        if rid is not last:
            last = rid
            slot = index.setdefault(rid, len(index))
        flat += (slot, entry.remote_offset, entry.length, entry.count, entry.remote_stride)
    records: list[bytes] = []
    for rid in index:
        key, raw = keys.get(rid, _NO_KEY), rid.encode()
        if len(raw) > 0xFFFF:
            raise ValueError(f"region id of {len(raw)} bytes is too long for the tcp frame")
        records += (key if len(key) == KEY_BYTES else _NO_KEY, _ID_LEN.pack(len(raw)), raw)
    table = b"".join(records)
    if len(entries) > MAX_ENTRIES or len(table) > MAX_TABLE_BYTES:
        raise ValueError(f"batch of {len(entries)} entries exceeds the tcp frame limits")
    head = REQUEST.pack(
        REQUEST_MAGIC,
        op,
        traffic_class,
        len(index),
        len(entries),
        len(table),
        batch_id,
        payload_len,
    )
    return head + table + _entries_struct(len(entries)).pack(*flat)


def decode_table(table: bytes, n_regions: int) -> list[tuple[str, bytes]]:
    """``(region id, key)`` of every record of a request's region table, in slot order.

    Raises:
        TransferError: the table is not ``n_regions`` well-formed records, end to end.
    """
    out: list[tuple[str, bytes]] = []
    at, end = 0, len(table)
    while at < end:
        if end - at < KEY_BYTES + _ID_LEN.size:
            raise TransferError("region table ends inside a record")
        key = table[at : at + KEY_BYTES]
        (n,) = _ID_LEN.unpack_from(table, at + KEY_BYTES)
        at += KEY_BYTES + _ID_LEN.size
        if n > end - at:
            raise TransferError("region table ends inside a region id")
        try:
            out.append((table[at : at + n].decode(), key))
        except UnicodeDecodeError:
            raise TransferError("a region id in the region table is not utf-8") from None
        at += n
    if len(out) != n_regions:
        raise TransferError(f"region table holds {len(out)} ids, header says {n_regions}")
    return out


def encode_error(exc: TransferError) -> bytes:
    """The msgpack error body for a reply."""
    body: dict[str, Any] = {"message": str(exc)}
    if isinstance(exc, UnknownRegionError):
        body.update(kind="unknown_region", region_id=exc.region_id, detail=exc.detail)
    elif isinstance(exc, AccessDeniedError):
        body.update(kind="access_denied", region_id=exc.region_id, detail=exc.detail)
    elif isinstance(exc, OutOfBoundsError):
        body.update(
            kind="out_of_bounds",
            region_id=exc.region_id,
            offset=exc.offset,
            length=min(exc.length, _U64_MAX),  # a strided entry's span can pass 2**64 (msgpack's limit)
            size=exc.size,
        )
    else:
        body.update(kind="error")
    return msgpack.packb(body)


def decode_error(raw: bytes, peer: str) -> TransferError:
    """The exception an error body describes."""
    try:
        body = msgpack.unpackb(raw)
        kind = body.get("kind")
        if kind == "unknown_region":
            return UnknownRegionError(body["region_id"], body.get("detail", ""))
        if kind == "access_denied":
            return AccessDeniedError(body["region_id"], body.get("detail", ""))
        if kind == "out_of_bounds":
            return OutOfBoundsError(body["region_id"], body["offset"], body["length"], body["size"])
        return TransferError(f"{peer}: {body.get('message', 'unknown error')}")
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        return TransferError(f"{peer}: undecodable error reply ({exc})")


async def wait_fd(loop: asyncio.AbstractEventLoop, fd: int, *, write: bool) -> None:
    """Return once ``fd`` is writable (``write``) or readable."""
    fut: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    if write:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        await fut
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


async def send_buffers(sock: socket.socket | TlsStream, buffers: Sequence[Any]) -> None:
    """Send every buffer, in order, with as few ``sendmsg`` calls as the kernel allows.

    Raises:
        OSError: the connection broke (``BrokenPipeError``, ``ConnectionResetError``...).
    """
    loop = asyncio.get_running_loop()
    fd = sock.fileno()
    bufs = [memoryview(b).cast("B") for b in buffers if len(b)]
    i = 0
    try:
        while i < len(bufs):
            try:
                sent = sock.sendmsg(bufs[i : i + _IOV_MAX])
            except (BlockingIOError, InterruptedError):
                await wait_fd(loop, fd, write=True)
                continue
            while sent:
                size = bufs[i].nbytes
                if sent >= size:
                    sent -= size
                    i += 1
                else:
                    bufs[i] = bufs[i][sent:]
                    sent = 0
    finally:
        bufs.clear()  # a cancelled send's traceback keeps this frame: not the region's memory


async def recv_into(sock: socket.socket | TlsStream, buffers: Sequence[memoryview]) -> None:
    """Fill every buffer, in order, from the socket (scatter receive).

    Raises:
        ConnectionResetError: the peer closed the connection before all bytes arrived.
        OSError: the connection broke.
    """
    loop = asyncio.get_running_loop()
    fd = sock.fileno()
    bufs = [b for b in buffers if b.nbytes]
    i = 0
    while i < len(bufs):
        try:
            got = sock.recvmsg_into(bufs[i : i + _IOV_MAX])[0]
        except (BlockingIOError, InterruptedError):
            await wait_fd(loop, fd, write=False)
            continue
        if got == 0:
            raise ConnectionResetError("connection closed by peer")
        while got:
            size = bufs[i].nbytes
            if got >= size:
                got -= size
                i += 1
            else:
                bufs[i] = bufs[i][got:]
                got = 0


async def recv_exactly(sock: socket.socket | TlsStream, nbytes: int) -> bytearray:
    """Receive exactly ``nbytes`` into a new buffer.

    Raises:
        ConnectionResetError: the peer closed the connection first.
    """
    out = bytearray(nbytes)
    if nbytes:
        await recv_into(sock, [memoryview(out)])
    return out


def advance(bufs: list[memoryview], n: int) -> None:
    """Drop ``n`` bytes from the front of ``bufs`` (a scatter/gather list), in place."""
    while n:
        size = bufs[0].nbytes
        if n >= size:
            n -= size
            bufs.pop(0)
        else:
            bufs[0] = bufs[0][n:]
            n = 0
