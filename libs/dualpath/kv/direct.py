"""``O_DIRECT`` reads and writes of Full Block files, through page-aligned bounce buffers.

Direct I/O needs the file offset, the length and the memory address aligned to the device's
logical block size. A block file's payload starts at byte ``HEADER_BYTES`` and lands at
``i * block_bytes`` in the caller's buffer, so neither side is aligned in general: each
thread owns one page-aligned anonymous mapping, as large as the largest file it has moved (up
to ``CHUNK_BYTES``), and the file moves through it chunk by chunk (aligned offsets, lengths
rounded up to ``ALIGN``; a read past the end of the file returns short, a write's padding is
cut off with ``ftruncate``). The copy between the bounce buffer and the caller's buffer is the
price (made with the GIL released, so other threads' reads go on meanwhile); the page cache is
bypassed both ways.

Filesystems without ``O_DIRECT`` (tmpfs) refuse the open with ``EINVAL``; ``open_direct``
returns None then and callers fall back to buffered I/O.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable

import numpy as np

__all__ = ["ALIGN", "CHUNK_BYTES", "PIECE_BYTES", "open_direct", "read_direct", "write_direct"]

ALIGN = 4096  # a page: a multiple of every logical block size in use (512, 4096)
# The largest single I/O, and the most a thread's bounce buffer grows to: a Full Block file of
# the bundled targets (16 MiB of payload at most) moves in one request, which the kernel splits into device
# requests that are in flight together (fio reads a file so, one I/O for the whole file).
CHUNK_BYTES = (16 << 20) + ALIGN  # a 16 MiB payload with its header
# What a read lands and hands on at a time: small enough that a piece is still in the CPU's
# cache (L2) when it is checksummed, rather than read back from memory after the whole block.
PIECE_BYTES = 256 << 10
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class _Bounce(threading.local):
    """One page-aligned bounce buffer per thread (mmap memory is page aligned), grown to the
    largest chunk asked for (a thread moving small blocks keeps a small one)."""

    def __init__(self) -> None:
        self.view: memoryview | None = None

    def get(self, nbytes: int) -> memoryview:
        """A view of at least ``min(nbytes, CHUNK_BYTES)`` bytes (rounded up to ``ALIGN``)."""
        need = _round_up(min(max(nbytes, 1), CHUNK_BYTES))
        if self.view is None or len(self.view) < need:
            self.view = memoryview(mmap.mmap(-1, need))
        return self.view


_bounce = _Bounce()


_GIL_FREE_COPY_BYTES = 64 << 10  # from this size on a copy releases the GIL (numpy does)


def _copy(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src``; a large copy runs with the GIL released (a memoryview copy holds it)."""
    if len(src) < _GIL_FREE_COPY_BYTES:
        dst[:] = src
    else:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def open_direct(path: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int | None:
    """``os.open`` with ``O_DIRECT`` added; None where the filesystem refuses direct I/O. A file
    it creates gets ``mode`` (the owner's alone by default: block files hold prompts' KV).

    Raises:
        OSError: any other failure of the open (``FileNotFoundError`` included).
    """
    if not _O_DIRECT:
        return None
    try:
        return os.open(path, flags | _O_DIRECT, mode)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise


def read_direct(fd: int, total: int, dest: memoryview, on_head: Callable[[memoryview], None], on_data: Callable[[memoryview], None]) -> int:
    """Read a ``total``-byte file opened with ``O_DIRECT``: its first ``head`` bytes go to
    ``on_head`` (once, before any payload is copied), the rest into ``dest`` in order.

    ``on_head`` gets the first chunk's leading bytes and may raise to stop the read (a header
    that is not the expected one). The payload is copied out of the bounce buffer ``PIECE_BYTES``
    at a time and each piece of ``dest`` goes to ``on_data`` just after it landed, while it is
    still in the CPU's cache (the caller's checksum). Returns the payload bytes copied, short if
    the file ended early (the caller reports a torn file).
    """
    bounce = _bounce.get(total)
    head = total - len(dest)
    off = copied = 0
    while off < total:
        want = min(len(bounce), _round_up(total - off))
        got = os.preadv(fd, [bounce[:want]], off)
        if off == 0:
            if got < head:
                return 0
            on_head(bounce[:head])
            start = head
        else:
            start = 0
        end = min(got, total - off)
        while start < end:
            n = min(PIECE_BYTES, end - start)
            piece = dest[copied : copied + n]
            _copy(piece, bounce[start : start + n])
            on_data(piece)
            copied += n
            start += n
        off += got
        if got < want:
            break
    return copied


def write_direct(fd: int, head_bytes: int, payload: memoryview, on_data: Callable[[memoryview], None], head: Callable[[], bytes]) -> None:
    """Write a ``head_bytes`` header then ``payload`` to an empty file opened with ``O_DIRECT``,
    in aligned chunks (the last one zero-padded), then cut the file to its true size.

    Every piece of ``payload`` goes to ``on_data`` (the caller's checksum) before ``head()`` is
    called for the header. A file that fits one chunk is copied into the bounce buffer piece by
    piece, each piece handed on while it is still in the CPU's cache, and the header goes in
    front of it last; a larger one is handed on from ``payload`` first, since its header leaves
    with the first chunk.

    Raises:
        OSError: the filesystem refused a write or the truncate.
    """
    total = head_bytes + len(payload)
    bounce = _bounce.get(total)
    if total <= len(bounce):
        for taken in range(0, len(payload), PIECE_BYTES):
            piece = bounce[head_bytes + taken : head_bytes + min(taken + PIECE_BYTES, len(payload))]
            _copy(piece, payload[taken : taken + len(piece)])
            on_data(piece)
        bounce[:head_bytes] = head()
        _write_padded(fd, bounce, total, 0)
    else:
        for taken in range(0, len(payload), PIECE_BYTES):
            on_data(payload[taken : taken + PIECE_BYTES])
        bounce[:head_bytes] = head()
        fill, taken, off = head_bytes, 0, 0
        while off < total:
            n = min(len(bounce) - fill, len(payload) - taken)
            _copy(bounce[fill : fill + n], payload[taken : taken + n])
            taken += n
            _write_padded(fd, bounce, fill + n, off)
            off += fill + n
            fill = 0
    os.ftruncate(fd, total)


def _write_padded(fd: int, bounce: memoryview, used: int, off: int) -> None:
    """Write ``bounce[:used]`` at file offset ``off``, zero-padded to ``ALIGN``."""
    padded = _round_up(used)
    bounce[used:padded] = bytes(padded - used)
    done = 0
    while done < padded:
        done += os.pwritev(fd, [bounce[done:padded]], off + done)
