"""``O_DIRECT`` reads and writes of Full Block files.

Direct I/O needs the file offset, the length and the memory address aligned to what the
filesystem asks (``dio_alignment``: 512 bytes or 4 KiB on the devices in use). A version 2
file's payload starts at a 4 KiB offset, so ``read_aligned`` lands it straight in the caller's
buffer whenever that buffer's address is aligned: one request for the whole file (as fio
makes), the header page and the last partial sector going to the thread's bounce buffer
(nothing is written past the end of the caller's buffer). Otherwise (an unaligned buffer, a
version 1 file whose payload starts at byte 64, any write) the file moves through the bounce
buffer: each thread owns one page-aligned anonymous mapping, as large as the largest file it
has moved (up to ``CHUNK_BYTES``), and the file moves through it chunk by chunk (aligned
offsets, lengths rounded up to ``ALIGN``; a read past the end of the file returns short, a
write's padding is cut off with ``ftruncate``). The copy between the bounce buffer and the
caller's buffer is that path's price (made with the GIL released, so other threads' reads go
on meanwhile); the page cache is bypassed both ways.

Filesystems without ``O_DIRECT`` (tmpfs) refuse the open with ``EINVAL``; ``open_direct``
returns None then and callers fall back to buffered I/O.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import struct
import threading
from collections.abc import Callable

import numpy as np

__all__ = [
    "ALIGN",
    "CHUNK_BYTES",
    "PIECE_BYTES",
    "WRITE_CHUNK_BYTES",
    "dio_alignment",
    "open_direct",
    "read_aligned",
    "read_direct",
    "write_aligned",
    "write_direct",
]

ALIGN = 4096  # a page: a multiple of every logical block size in use (512, 4096)
# The largest single I/O, and the most a thread's bounce buffer grows to: a Full Block file of
# the bundled targets (16 MiB of payload at most) moves in one request, which the kernel splits into device
# requests that are in flight together (fio reads a file so, one I/O for the whole file).
CHUNK_BYTES = (16 << 20) + ALIGN  # a 16 MiB payload with its header
# What a read lands and hands on at a time: small enough that a piece is still in the CPU's
# cache (L2) when it is checksummed, rather than read back from memory after the whole block.
PIECE_BYTES = 256 << 10
# What a direct write from the caller's buffer checksums and then writes at a time: the chunk
# is still in the CPU's cache (L2) when it leaves (measured on this VM, 16 MiB blocks: 0.91-0.97
# of fio in 1-4 MiB chunks against 0.87 for a checksum of the whole block before one write).
WRITE_CHUNK_BYTES = 1 << 20
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


_STATX_DIOALIGN = 0x2000  # statx's request bit for stx_dio_mem_align and stx_dio_offset_align
_AT_EMPTY_PATH = 0x1000
_STATX = struct.Struct("<I148xII")  # stx_mask at 0, the two alignments at 152 and 156 of 256 bytes


def _libc_statx() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):  # no glibc statx (before 2.28, or not Linux)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_statx = _libc_statx()


def dio_alignment(fd: int) -> int:
    """The alignment ``O_DIRECT`` asks of memory addresses, file offsets and lengths for the
    file ``fd``: the larger of the two that ``statx`` reports (``STATX_DIOALIGN``, Linux 6.1
    on; 512 on ext4 over a 512-byte-sector disk), ``ALIGN`` where it reports none."""
    if _statx is None:
        return ALIGN
    raw = ctypes.create_string_buffer(256)
    if _statx(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, raw) != 0:
        return ALIGN
    mask, mem, offset = _STATX.unpack_from(raw.raw)
    if not mask & _STATX_DIOALIGN or not mem or not offset:
        return ALIGN
    return int(max(mem, offset))


def _address(view: memoryview) -> int:
    """The memory address of ``view``'s first byte."""
    return int(np.frombuffer(view, np.uint8).__array_interface__["data"][0])


def _preadv_all(fd: int, bufs: list[memoryview], want: int) -> int:
    """``preadv`` from offset 0 into ``bufs`` (``want`` bytes at most) until they hold
    ``want`` bytes or the file ends; return the bytes read. A request may return short (a
    signal, a filesystem's limit): the rest follows, still aligned, since direct reads stop
    only at a sector's end."""
    got = 0
    while got < want:
        n = os.preadv(fd, bufs, got)
        if not n:
            break
        got += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        if bufs and n:
            bufs[0] = bufs[0][n:]
    return got


def read_aligned(
    fd: int, head_bytes: int, dest: memoryview, align: int, on_head: Callable[[memoryview], None], on_data: Callable[[memoryview], None]
) -> int | None:
    """Read a file opened with ``O_DIRECT`` whose ``len(dest)``-byte payload starts at
    ``head_bytes``, in one request: the payload straight into ``dest``, but for its last
    ``len(dest) % align`` bytes, which come through the thread's bounce buffer with the first
    ``head_bytes`` (so nothing is written past ``dest``'s end). Then the head goes to
    ``on_head`` (which may raise), and the payload to ``on_data`` (the caller's checksum).

    Returns the payload bytes landed (short if the file ended early: the caller reports a torn
    file; ``on_head`` is not called if the head itself is short), or None, having read
    nothing, if ``dest``'s address or ``head_bytes`` is not a multiple of ``align`` (the caller
    goes through ``read_direct``).

    Raises:
        OSError: the read failed; ``EINVAL`` (nothing read) if the filesystem asks for a
            larger alignment than ``align``.
    """
    if head_bytes % align or _address(dest) % align:
        return None
    size = len(dest)
    body = size - size % align  # [body, size) is the tail: less than a sector
    bounce = _bounce.get(head_bytes + align)
    tail = bounce[head_bytes : head_bytes + align]
    bufs = [bounce[:head_bytes]] + ([dest[:body]] if body else []) + ([tail] if body < size else [])
    got = _preadv_all(fd, bufs, head_bytes + size)
    if got < head_bytes:
        return 0
    landed = min(got - head_bytes, size)
    if landed > body:
        dest[body:landed] = tail[: landed - body]
    on_head(bounce[:head_bytes])
    on_data(dest[:landed])
    return landed


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


def write_aligned(
    fd: int, head_bytes: int, payload: memoryview, align: int, on_data: Callable[[memoryview], None], head: Callable[[], bytes]
) -> bool:
    """Write a ``head_bytes`` header then ``payload`` to an empty file opened with ``O_DIRECT``,
    the payload straight from the caller's buffer, ``WRITE_CHUNK_BYTES`` at a time, each chunk
    handed to ``on_data`` (the caller's checksum) just before it is written, while it is still
    in the CPU's cache. The last ``len(payload) % align`` bytes go zero-padded through the
    bounce buffer (the file is then cut to its true size), and the header, ``head()``, last.

    Returns False, having written nothing, if ``payload``'s address or ``head_bytes`` is not a
    multiple of ``align`` (the caller goes through ``write_direct``).

    Raises:
        OSError: the filesystem refused a write or the truncate; ``EINVAL`` (from the first
            write, nothing written) if it asks for a larger alignment than ``align``.
    """
    if head_bytes % align or _address(payload) % align:
        return False
    size = len(payload)
    body = size - size % align  # [body, size) is the tail: less than a sector
    for start in range(0, body, WRITE_CHUNK_BYTES):
        chunk = payload[start : min(start + WRITE_CHUNK_BYTES, body)]
        on_data(chunk)
        _pwrite_all(fd, chunk, head_bytes + start)
    bounce = _bounce.get(head_bytes + align)
    if body < size:
        on_data(payload[body:])
        tail = bounce[head_bytes : head_bytes + align]
        tail[: size - body] = payload[body:]
        tail[size - body :] = bytes(align - (size - body))
        _pwrite_all(fd, tail, head_bytes + body)
    bounce[:head_bytes] = head()
    _pwrite_all(fd, bounce[:head_bytes], 0)
    if body < size:
        os.ftruncate(fd, head_bytes + size)
    return True


def _pwrite_all(fd: int, data: memoryview, off: int) -> None:
    """Write all of ``data`` at file offset ``off`` (a write may be partial: the rest follows)."""
    done = 0
    while done < len(data):
        done += os.pwritev(fd, [data[done:]], off + done)


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
