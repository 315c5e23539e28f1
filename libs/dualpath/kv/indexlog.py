"""The durable log behind ``BlockIndex``: CRC-framed msgpack records in one append-only file.

File layout: an 8-byte file header (magic ``b"DPIX"``, u16 version, u16 reserved), then
records, each ``u32 length | u32 crc32(payload) | payload`` where the payload is one msgpack
map. An append is fdatasync'ed before it returns. On open, a torn last record (a crash
mid-append: the frame runs past the end of the file, or the tail is zero-filled) is dropped
and the file truncated to the last good record; damage followed by more data is corruption.
Compaction replaces the whole file atomically (temp file, fsync, rename, fsync directory).
A sidecar ``<name>.lock`` file holds an exclusive ``flock`` so only one process appends.
The log names every persisted block, so like the blocks it is the owner's alone: files are
created 0600, a missing directory 0700.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import struct
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgpack

from dualpath.kv.errors import IndexCorruptError, IndexLockedError
from dualpath.kv.storage import DIR_MODE, FILE_MODE

__all__ = ["LOG_VERSION", "IndexLog"]

LOG_VERSION = 1
_FILE_HEADER = struct.Struct("<4sHH")
_MAGIC = b"DPIX"
_FRAME = struct.Struct("<II")  # payload length, crc32 of payload
_sync = getattr(os, "fdatasync", os.fsync)  # size changes are flushed by fdatasync too


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _frame(record: dict[str, Any]) -> bytes:
    payload: bytes = msgpack.packb(record, use_bin_type=True)  # msgpack is untyped: packb returns bytes here
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def _parse(path: Path, data: bytes) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """Decode the records of ``data``; return ``(offset, record)`` pairs and the good length.

    Raises:
        IndexCorruptError: bad file header, or a damaged record that is not the torn tail.
    """
    if len(data) < _FILE_HEADER.size:
        raise IndexCorruptError(path, 0, f"file is {len(data)} bytes, shorter than its header")
    magic, version, _reserved = _FILE_HEADER.unpack_from(data)
    if magic != _MAGIC or version != LOG_VERSION:
        raise IndexCorruptError(path, 0, f"bad magic {magic!r} or version {version}")
    records: list[tuple[int, dict[str, Any]]] = []
    off = _FILE_HEADER.size
    while off < len(data):
        if len(data) - off < _FRAME.size:
            break  # torn frame header
        length, crc = _FRAME.unpack_from(data, off)
        end = off + _FRAME.size + length
        payload = data[off + _FRAME.size : end]
        if length == 0 or end > len(data) or zlib.crc32(payload) != crc:
            if end >= len(data) or not any(data[off:]):
                break  # the torn tail of a crash mid-append
            raise IndexCorruptError(path, off, "damaged record followed by more records")
        try:
            record = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise IndexCorruptError(path, off, f"undecodable record: {exc}") from exc
        if not isinstance(record, dict):
            raise IndexCorruptError(path, off, "record is not a map")
        records.append((off, record))
        off = end
    return records, off


class IndexLog:
    """One index log file, held exclusively by this process until ``close()``."""

    def __init__(self, path: Path) -> None:
        """Open (or create) the log at ``path``, take its lock and read its records.

        Raises:
            IndexLockedError: another process (or another open ``IndexLog``) holds the lock.
            IndexCorruptError: the existing file cannot be parsed.
            OSError: the file or its directory cannot be created or read.
        """
        self.path = path
        path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        self._lock_fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise IndexLockedError(path) from None
        try:
            self._records = self._load()
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.size = os.fstat(self._fd).st_size

    def take_records(self) -> list[tuple[int, dict[str, Any]]]:
        """The ``(offset, record)`` pairs read on open, once (later calls return [])."""
        records, self._records = self._records, []
        return records

    def _load(self) -> list[tuple[int, dict[str, Any]]]:
        """Read and parse the file, creating it or truncating a torn tail as needed."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            self._replace_with([])  # an atomically created file is never empty, but be kind
            return []
        data = self.path.read_bytes()
        records, good = _parse(self.path, data)
        if good < len(data):
            # Drop the torn tail now so the next append does not land after garbage.
            fd = os.open(self.path, os.O_WRONLY)
            try:
                os.ftruncate(fd, good)
                os.fsync(fd)
            finally:
                os.close(fd)
        return records

    def append(self, record: dict[str, Any]) -> None:
        """Append one record and fdatasync it. Raises OSError if the write or sync fails."""
        framed = _frame(record)
        data = memoryview(framed)
        try:
            while data:
                data = data[os.write(self._fd, data) :]
            _sync(self._fd)
        except OSError:
            # Cut a partial record off (e.g. disk full) so later appends do not follow garbage.
            os.ftruncate(self._fd, self.size)
            raise
        self.size += len(framed)

    def rewrite(self, records: Iterable[dict[str, Any]]) -> None:
        """Atomically replace the whole log with ``records`` (a snapshot). Raises OSError."""
        self._replace_with(records)  # on failure the old file and descriptor stay in use
        old_fd, self._fd = self._fd, os.open(self.path, os.O_WRONLY | os.O_APPEND)
        os.close(old_fd)
        self.size = os.fstat(self._fd).st_size

    def _replace_with(self, records: Iterable[dict[str, Any]]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "wb") as f:
                f.write(_FILE_HEADER.pack(_MAGIC, LOG_VERSION, 0))
                for record in records:
                    f.write(_frame(record))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.path.parent)

    def close(self) -> None:
        """Close the file and release the lock (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._fd = self._lock_fd = -1
