"""Errors raised by the KV package.

Hierarchy::

    KVError
    ├── BlockMissingError     a block file is not in storage
    ├── CorruptBlockError     a block file exists but cannot be trusted
    ├── IndexCorruptError     the trie index log cannot be replayed
    └── IndexLockedError      another process holds the trie index log

A missing or corrupt block is a cache miss for the caller, never data: readers catch
``BlockMissingError`` and ``CorruptBlockError``, recompute, and drop the block from the index.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "BlockMissingError",
    "CorruptBlockError",
    "IndexCorruptError",
    "IndexLockedError",
    "KVError",
]


class KVError(Exception):
    """Base class of every error raised by ``dualpath.kv``."""


class BlockMissingError(KVError):
    """Raised by ``BlockStore.read_into`` when the block's file does not exist.

    A block evicted (or never written) is missing; so is one whose writer crashed before the
    atomic rename, because a temp file is never read as a block.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        super().__init__(f"block file missing: {path}")


class CorruptBlockError(KVError):
    """Raised when a block file or header cannot be trusted.

    Raised by ``decode_header`` (short header, bad magic, unknown format version, header CRC
    mismatch, impossible field values) and by ``BlockStore.read_into`` (truncated or oversized
    file, header fields different from what the reader expects, payload checksum mismatch).
    ``path`` is ``None`` when the bytes did not come from a file.
    """

    def __init__(self, path: Path | None, reason: str) -> None:
        self.path = path
        self.reason = reason
        where = str(path) if path is not None else "<bytes>"
        super().__init__(f"corrupt block {where}: {reason}")


class IndexCorruptError(KVError):
    """Raised by ``BlockIndex`` on start when its log cannot be replayed.

    A torn *last* record (a crash mid-append) is not corruption and is dropped silently; this
    is raised for a bad file magic, a damaged record followed by more data, or records that
    contradict each other (a block whose parent is not indexed).
    """

    def __init__(self, path: Path, offset: int, reason: str) -> None:
        self.path = path
        self.offset = offset
        self.reason = reason
        super().__init__(f"corrupt index log {path} at byte {offset}: {reason}")


class IndexLockedError(KVError):
    """Raised by ``BlockIndex`` on start when another process already holds its log.

    Two writers appending to one log would interleave records; each index shard has one owner.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        super().__init__(f"index log {path} is held by another process")
