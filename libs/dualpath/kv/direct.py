"""``O_DIRECT`` reads and writes of Full Block files, through page-aligned bounce buffers.

Direct I/O needs the file offset, the length and the memory address aligned to the device's
logical block size. A block file's payload starts at byte ``HEADER_BYTES`` and lands at
``i * block_bytes`` in the caller's buffer, so neither side is aligned in general: each
thread owns one page-aligned anonymous mapping of ``CHUNK_BYTES`` and the file moves through
it chunk by chunk (aligned offsets, lengths rounded up to ``ALIGN``; a read past the end of
the file returns short, a write's padding is cut off with ``ftruncate``). The copy between
the bounce buffer and the caller's buffer is the price; the page cache is bypassed both ways.

Filesystems without ``O_DIRECT`` (tmpfs) refuse the open with ``EINVAL``; ``open_direct``
returns None then and callers fall back to buffered I/O.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable

__all__ = ["ALIGN", "CHUNK_BYTES", "open_direct", "read_direct", "write_direct"]

ALIGN = 4096  # a page: a multiple of every logical block size in use (512, 4096)
CHUNK_BYTES = 4 << 20  # per-thread bounce buffer; also the largest single I/O
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class _Bounce(threading.local):
    """One page-aligned bounce buffer per thread (mmap memory is page aligned)."""

    def __init__(self) -> None:
        self.view: memoryview | None = None

    def get(self) -> memoryview:
        if self.view is None:
            self.view = memoryview(mmap.mmap(-1, CHUNK_BYTES))
        return self.view


_bounce = _Bounce()


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


def read_direct(fd: int, total: int, dest: memoryview, on_head: Callable[[memoryview], None]) -> int:
    """Read a ``total``-byte file opened with ``O_DIRECT``: its first ``head`` bytes go to
    ``on_head`` (once, before any payload is copied), the rest into ``dest`` in order.

    ``on_head`` gets the first chunk's leading bytes and may raise to stop the read (a header
    that is not the expected one). Returns the payload bytes copied, short if the file ended
    early (the caller reports a torn file).
    """
    bounce = _bounce.get()
    head = total - len(dest)
    off = copied = 0
    while off < total:
        want = min(CHUNK_BYTES, _round_up(total - off))
        got = os.preadv(fd, [bounce[:want]], off)
        if off == 0:
            if got < head:
                return 0
            on_head(bounce[:head])
            start = head
        else:
            start = 0
        n = min(got, total - off) - start
        dest[copied : copied + n] = bounce[start : start + n]
        copied += n
        off += got
        if got < want:
            break
    return copied


def write_direct(fd: int, head: bytes, payload: memoryview) -> None:
    """Write ``head`` then ``payload`` to an empty file opened with ``O_DIRECT``, in aligned
    chunks (the last one zero-padded), then cut the file to its true size.

    Raises:
        OSError: the filesystem refused a write or the truncate.
    """
    bounce = _bounce.get()
    total = len(head) + len(payload)
    bounce[: len(head)] = head
    fill, taken, off = len(head), 0, 0
    while off < total:
        n = min(CHUNK_BYTES - fill, len(payload) - taken)
        bounce[fill : fill + n] = payload[taken : taken + n]
        taken += n
        used = fill + n
        padded = _round_up(used)
        bounce[used:padded] = bytes(padded - used)
        done = 0
        while done < padded:
            done += os.pwritev(fd, [bounce[done:padded]], off + done)
        off += used
        fill = 0
    os.ftruncate(fd, total)
