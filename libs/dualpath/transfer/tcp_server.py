"""The serving side of the tcp transport: answers one peer connection's batches.

Requests on a connection are handled in order; the peer pipelines them, so the socket
buffers keep the link busy while one is being answered. Every entry is checked before any
byte moves: a bad batch gets an error reply (a write's payload is read and dropped), and the
connection keeps serving.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import numpy as np

from dualpath.transfer.errors import OutOfBoundsError, TransferError, UnknownRegionError
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
    encode_error,
    recv_exactly,
    recv_into,
    send_buffers,
)

__all__ = ["serve_connection"]

_log = logging.getLogger(__name__)
_DRAIN_CHUNK = 1 << 20

Lookup = Callable[[str], "MemoryRegion | None"]


async def serve_connection(sock: socket.socket, lookup: Lookup, node_id: str) -> None:
    """Answer batches on ``sock`` until the peer closes it; closes ``sock`` at the end.

    ``lookup`` maps a region id to the registered, open region (or ``None``).
    """
    try:
        while True:
            try:
                head = await recv_exactly(sock, REQUEST.size)
            except ConnectionError:
                return  # the peer closed between batches: the normal end
            magic, op, _cls, n_regions, n_entries, table_len, batch_id, payload_len = (
                REQUEST.unpack(head)
            )
            if (
                magic != REQUEST_MAGIC
                or op not in (Op.READ, Op.WRITE)
                or n_entries > MAX_ENTRIES
                or table_len > MAX_TABLE_BYTES
            ):
                # A stream we cannot parse cannot be resynchronised: drop the connection.
                _log.warning("tcp transport %s: malformed request, closing connection", node_id)
                return
            tables = await recv_exactly(sock, table_len + n_entries * ENTRY.size)
            table, rows = bytes(tables[:table_len]), memoryview(tables)[table_len:]
            await _answer(
                sock, lookup, node_id, Op(op), batch_id, table, n_regions, rows, payload_len
            )
    except (ConnectionError, OSError):
        return  # the peer vanished mid-batch; its side reports the failure
    finally:
        sock.close()


async def _answer(
    sock: socket.socket,
    lookup: Lookup,
    node_id: str,
    op: Op,
    batch_id: int,
    table: bytes,
    n_regions: int,
    rows: memoryview,
    payload_len: int,
) -> None:
    scatters: list[tuple[np.ndarray, memoryview]] = []
    try:
        views = _resolve(lookup, node_id, table, n_regions, rows, op, scatters)
        total = sum(v.nbytes for v in views)
        if op is Op.WRITE and payload_len != total:
            raise TransferError(f"write payload of {payload_len} B for {total} B of entries")
    except TransferError as exc:
        if op is Op.WRITE:
            await _drain(sock, payload_len)
        body = encode_error(exc)
        head = REPLY.pack(REPLY_MAGIC, Status.ERROR, op, 0, len(body), batch_id, 0)
        await send_buffers(sock, [head, body])
        return
    try:
        if op is Op.WRITE:
            await recv_into(sock, views)
            for target, scratch in scatters:  # strided pieces: received together, placed at C speed
                target[...] = np.frombuffer(scratch, dtype=np.uint8).reshape(target.shape)
            await send_buffers(sock, [REPLY.pack(REPLY_MAGIC, Status.OK, op, 0, 0, batch_id, 0)])
        else:
            head = REPLY.pack(REPLY_MAGIC, Status.OK, op, 0, 0, batch_id, total)
            await send_buffers(sock, [head, *views])
    finally:
        scatters.clear()  # region.close() must not find arrays or slices of it still alive
        for view in views:
            view.release()


def _resolve(
    lookup: Lookup,
    node_id: str,
    table: bytes,
    n_regions: int,
    rows: memoryview,
    op: Op,
    scatters: list[tuple[np.ndarray, memoryview]],
) -> list[memoryview]:
    """Check every entry and return the memoryviews its bytes go from (read) or to (write),
    in order. A strided entry whose pieces are apart is gathered into one new buffer for a
    read; for a write it is received into a scratch buffer and ``(strided view, scratch)``
    is appended to ``scatters`` for the caller to place.

    Raises:
        UnknownRegionError: a named region is not registered here.
        OutOfBoundsError: an entry reaches outside its region.
        TransferError: the tables do not match each other.
    """
    names = table.decode().split("\0") if table else []
    if len(names) != n_regions:
        raise TransferError(f"region table holds {len(names)} ids, header says {n_regions}")
    regions: list[MemoryRegion] = []
    for name in names:
        region = lookup(name)
        if region is None:
            raise UnknownRegionError(name, f"not registered at node {node_id!r}")
        regions.append(region)
    bufs = [r.buf for r in regions]
    arrays: dict[int, np.ndarray] = {}
    views: list[memoryview] = []
    arr = strided = None
    try:
        for slot, offset, length, count, stride in ENTRY.iter_unpack(rows):
            if slot >= n_regions:
                raise TransferError("an entry names a region outside the region table")
            if count < 1 or (count > 1 and stride < length):
                raise TransferError(f"bad strided entry: count {count}, stride {stride}, length {length}")
            size = regions[slot].size
            span = (count - 1) * stride + length
            if offset > size or span > size - offset:
                raise OutOfBoundsError(regions[slot].region_id, offset, span, size)
            if not length:
                continue
            if count == 1 or stride == length:
                views.append(bufs[slot][offset : offset + length * count])
                continue
            arr = arrays.get(slot)
            if arr is None:
                arr = arrays[slot] = np.frombuffer(bufs[slot], dtype=np.uint8)
            strided = np.lib.stride_tricks.as_strided(arr[offset:], shape=(count, length), strides=(stride, 1))
            if op is Op.READ:
                views.append(memoryview(np.ascontiguousarray(strided)).cast("B"))
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


async def _drain(sock: socket.socket, nbytes: int) -> None:
    """Read and drop ``nbytes`` (a rejected write's payload) to stay in sync."""
    scratch = memoryview(bytearray(min(nbytes, _DRAIN_CHUNK)))
    while nbytes:
        take = min(nbytes, len(scratch))
        await recv_into(sock, [scratch[:take]])
        nbytes -= take
