"""Full Block files under a storage root (a local directory or a shared mount).

Paths are derived from hashes only (``root/<model digest hex>/<hh>/<hh>/<hash hex>.kvb``),
so no request-supplied string (nor a tenant's name) ever reaches the filesystem. Blocks hold
what prompts computed to, so they are the storage owner's alone: the root and every directory
made under it are created 0700, block files 0600 (a root that already exists keeps its mode:
a shared mount's is its administrator's to set). Writes are atomic (temp file in
the same directory, fsync, rename, fsync the directory): a reader sees either no file or a
whole one, and a crashed writer leaves only a ``.tmp`` file that is never read as a block.
Reads land directly in the caller's buffer and are verified before they are reported.
``direct=True`` moves the bytes with ``O_DIRECT``, bypassing the page cache, on filesystems
that support it (``dualpath.kv.direct``): a version 2 file's payload starts at 4 KiB, so it
lands in an aligned destination by DMA (from ``IN_PLACE_MIN_BYTES`` on) and is written from an
aligned source so; other buffers, smaller reads and version 1 files go through a per-thread
aligned bounce buffer.
"""

from __future__ import annotations

import errno
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NoReturn

import xxhash

from dualpath.kv.block import (
    FORMAT_VERSION,
    HEADER_BYTES,
    PAYLOAD_OFFSET,
    BlockHeader,
    decode_header,
    encode_header,
    header_template,
    match_header,
    payload_offset,
)
from dualpath.kv.direct import PIECE_BYTES, dio_alignment, open_direct, read_aligned, read_direct, write_aligned, write_direct
from dualpath.kv.errors import BlockMissingError, CorruptBlockError
from dualpath.kv.hashing import hash_hex

__all__ = ["BLOCK_SUFFIX", "DIR_MODE", "FILE_MODE", "IN_PLACE_MIN_BYTES", "TEMP_SUFFIX", "BlockShape", "BlockStore"]

BLOCK_SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
DIR_MODE = 0o700  # directories this store creates: only the owner may list or enter them
FILE_MODE = 0o600  # block files (temp files included): only the owner may read them
_VERSION_BY_EXTRA = {payload_offset(v): v for v in (1, 2)}  # a file's bytes beyond its payload -> its format
_PADDING = bytes(PAYLOAD_OFFSET - HEADER_BYTES)  # between a version 2 header and its payload
# Direct reads of smaller payloads bounce even into an aligned slot: where the disk is a copy
# on the host (our VM), a small reused buffer takes it faster than a slot, and copying 256 KiB
# out costs little (docs/results.md, "Storage against fio"). Writes leave in place at any size.
IN_PLACE_MIN_BYTES = 1 << 20


def _fsync_dir(path: Path) -> None:
    """Flush a directory's entries so a rename or mkdir inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, *parts: memoryview) -> None:
    """Write ``parts`` in order, in one ``writev`` when the filesystem takes it all (a write
    may be partial on some filesystems: the rest follows)."""
    bufs = [p for p in parts if len(p)]
    while bufs:
        n = os.writev(fd, bufs)
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        if bufs and n:
            bufs[0] = bufs[0][n:]


def _as_bytes_view(buf: object, *, writable: bool) -> memoryview:
    """A flat byte view of ``buf``. Raises ValueError if it is not contiguous (or read-only)."""
    view = memoryview(buf)  # type: ignore[arg-type]
    if not view.contiguous:
        raise ValueError("buffer must be contiguous")
    if writable and view.readonly:
        raise ValueError("destination buffer is read-only")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _read_buffered(
    fd: int, head_bytes: int, target: memoryview, on_head: Callable[[memoryview], None], on_data: Callable[[memoryview], None]
) -> int:
    """Read the file's first ``head_bytes`` (the header, padded in version 2) and the payload
    after them straight into ``target``, ``PIECE_BYTES`` at a time:
    the header goes to ``on_head`` (which may raise) after the first request, and each piece of
    ``target`` to ``on_data`` just after it landed, while it is still in the CPU's cache (a
    checksum of the whole block afterwards would read it back from memory). Returns the
    payload bytes read (short if the file ended early).

    Sequential requests keep the kernel's readahead going ahead of them (measured on 16 MiB
    blocks, 8 threads: 1.5-1.7 GB/s in 256 KiB pieces against 1.2 for one request and a
    checksum after it).
    """
    head = bytearray(head_bytes)
    size = len(target)
    got = os.preadv(fd, [head, target[: PIECE_BYTES - head_bytes]], 0)
    if got < head_bytes:
        return 0
    on_head(memoryview(head))
    got -= head_bytes
    done = 0  # bytes handed to on_data
    while True:
        if got > done:
            on_data(target[done:got])
            done = got
        if got >= size:
            return got
        n = os.preadv(fd, [target[got : got + PIECE_BYTES]], head_bytes + got)
        if not n:
            return got  # the file ended early (torn or truncated)
        got += n


def _check_header(path: str, raw: memoryview, expected: tuple[object, ...], version: int | None) -> BlockHeader:
    """Header ``raw``, decoded in full, if its fields are ``expected`` (``model_digest,
    block_hash, layers, tokens, bytes_per_token_layer, dtype, kv_layout``) and its format is
    ``version`` (any readable one if None).

    Raises:
        CorruptBlockError: the header does not decode, its fields are not the expected ones,
            or its version is not the one the file's size says.
    """
    try:
        header = decode_header(raw)
    except CorruptBlockError as exc:
        raise CorruptBlockError(Path(path), exc.reason) from None
    got = (header.model_digest, header.block_hash, header.layers, header.tokens,
           header.bytes_per_token_layer, header.dtype, header.kv_layout)  # fmt: skip
    if got != expected:
        raise CorruptBlockError(Path(path), f"header fields {got} != expected {expected}")
    if version is not None and header.version != version:
        raise CorruptBlockError(Path(path), f"a version {header.version} header in a file of version {version}'s size")
    return header


def _raise_bad_size(path: str, file_size: int, size: int, expected: tuple[object, ...]) -> NoReturn:
    """Raise for a file whose size is no format's for a ``size``-byte payload (torn,
    truncated, or another block's): a header that is not the expected one says so, else the
    size is the fault. Only failed reads come here, so the header is read again, buffered."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError:
        raw = b""
    version = _check_header(path, memoryview(raw), expected, None).version if len(raw) == HEADER_BYTES else FORMAT_VERSION
    raise CorruptBlockError(Path(path), f"file is {file_size} bytes, want {payload_offset(version) + size}")


@dataclass(frozen=True, slots=True)
class BlockShape:
    """What every block of a ``write_many`` shares: the model and the payload's shape."""

    model_digest: int
    layers: int
    tokens: int
    bytes_per_token_layer: int
    dtype: str
    kv_layout: int = 0

    @property
    def payload_bytes(self) -> int:
        return self.layers * self.tokens * self.bytes_per_token_layer


class BlockStore:
    """Full Block files under a storage root.

    Paths are derived from hashes only: ``root/<model digest hex>/<hh>/<hh>/<hash hex>.kvb``
    where ``hh`` are the first two byte pairs of the hash hex (to keep directories small).
    Safe to share between processes and nodes: every write is an atomic rename, so
    concurrent writers of one block (same content) are harmless.
    """

    def __init__(self, root: str | Path, *, fsync: bool = True, direct: bool = False) -> None:
        """Use ``root`` as the storage root, creating it if needed. ``fsync=False`` skips the
        file and directory fsyncs (writes stay atomic by rename, not durable on power loss).
        ``direct=True`` reads and writes with ``O_DIRECT`` where the filesystem allows it
        (buffered elsewhere); the format and its guarantees are the same either way.

        Raises:
            OSError: ``root`` cannot be created.
        """
        self.fsync = fsync
        self.direct = direct
        self.root = Path(root)
        self._root_str = str(self.root)
        self.root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        # What O_DIRECT asks of addresses and lengths: None until the first direct read or write
        # asks the filesystem, 0 once it refused an aligned request (all bounce from then on).
        self._dio_align: int | None = None

    def path_for(self, model_digest: int, block_hash: int) -> Path:
        """The file path of a block. Raises TypeError/ValueError if either is not a u64."""
        return Path(self._path_str(model_digest, block_hash))

    def _path_str(self, model_digest: int, block_hash: int) -> str:
        """``path_for`` as a string: joining ``Path`` parts costs more than the read of a small block."""
        hexed = hash_hex(block_hash)
        return f"{self._root_str}/{hash_hex(model_digest)}/{hexed[0:2]}/{hexed[2:4]}/{hexed}{BLOCK_SUFFIX}"

    def write(
        self,
        *,
        model_digest: int,
        block_hash: int,
        layers: int,
        tokens: int,
        bytes_per_token_layer: int,
        dtype: str,
        payload: bytes | bytearray | memoryview,
        kv_layout: int = 0,
    ) -> int:
        """Atomically write one Full Block; return the bytes written (the padded header and
        the payload: ``PAYLOAD_OFFSET + layers * tokens * bytes_per_token_layer``).

        ``payload`` is ``[layers, tokens, bytes_per_token_layer]`` bytes, layer-major;
        ``kv_layout`` says what a token's bytes are (``KV_LAYOUTS``).
        Re-writing an existing block replaces it atomically (idempotent for equal content).

        Raises:
            ValueError: ``payload`` size differs from ``layers * tokens * bytes_per_token_layer``
                or a header field is out of range.
            OSError: the filesystem refused the write; no temp file is left behind.
        """
        shape = BlockShape(model_digest, layers, tokens, bytes_per_token_layer, dtype, kv_layout)
        return self.write_many(shape, [block_hash], [payload])

    def write_many(self, shape: BlockShape, hashes: Sequence[int], payloads: Sequence[bytes | bytearray | memoryview]) -> int:
        """Atomically write blocks of one shape (``hashes[i]`` holds ``payloads[i]``); return
        the bytes written.

        Each block goes to its own temp file (fsynced), then all are renamed into place and
        every directory that received one is fsynced once: a directory fsync is a journal
        commit on most filesystems, so a group shares them. Every block is durable when this
        returns; an error leaves the blocks renamed so far in place (each whole) and no temp file.

        Raises:
            ValueError: a payload's size differs from the shape's, a header field is out of
                range, or ``hashes`` and ``payloads`` differ in length.
            OSError: the filesystem refused a write.
        """
        if len(hashes) != len(payloads):
            raise ValueError(f"{len(hashes)} hashes for {len(payloads)} payloads")
        staged: list[tuple[Path, Path]] = []
        try:
            for block_hash, payload in zip(hashes, payloads, strict=True):
                staged.append(self._write_temp(shape, block_hash, _as_bytes_view(payload, writable=False)))
            while staged:
                tmp, final = staged[0]
                os.replace(tmp, final)
                staged.pop(0)
        except BaseException:
            for tmp, _final in staged:
                tmp.unlink(missing_ok=True)
            raise
        if self.fsync:
            for directory in dict.fromkeys(self.path_for(shape.model_digest, h).parent for h in hashes):
                _fsync_dir(directory)
        return len(hashes) * (PAYLOAD_OFFSET + shape.payload_bytes)

    def _write_temp(self, shape: BlockShape, block_hash: int, data: memoryview) -> tuple[Path, Path]:
        """Write one block to a fresh temp file beside its final path (fsynced if asked);
        return both paths. Raises as ``write_many``; a failed temp file is removed."""
        header = BlockHeader(  # its fields checked before any file is made; the checksum comes later
            version=FORMAT_VERSION,
            model_digest=shape.model_digest,
            block_hash=block_hash,
            layers=shape.layers,
            tokens=shape.tokens,
            bytes_per_token_layer=shape.bytes_per_token_layer,
            dtype=shape.dtype,
            checksum=0,
            kv_layout=shape.kv_layout,
        )
        if len(data) != header.payload_bytes:
            raise ValueError(f"payload is {len(data)} bytes, header says {header.payload_bytes}")
        final = self.path_for(shape.model_digest, block_hash)
        self._ensure_dir(final.parent)
        tmp = final.parent / f".{final.stem}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        fd = open_direct(tmp, flags, FILE_MODE) if self.direct else None
        direct = fd is not None
        if fd is None:
            fd = os.open(tmp, flags, FILE_MODE)
        try:
            try:
                if direct:  # the checksum is taken as the payload goes out
                    digest = xxhash.xxh3_64()

                    def head() -> bytes:
                        return encode_header(replace(header, checksum=digest.intdigest())) + _PADDING

                    self._write_payload(fd, data, digest, head)
                else:
                    checksummed = replace(header, checksum=xxhash.xxh3_64_intdigest(data))
                    _write_all(fd, memoryview(encode_header(checksummed)), memoryview(_PADDING), data)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp, final

    def _write_payload(self, fd: int, data: memoryview, digest: xxhash.xxh3_64, head: Callable[[], bytes]) -> None:
        """Write a version 2 file's padded header and payload to the empty ``O_DIRECT`` file
        ``fd``, feeding the payload to ``digest`` on the way: straight from ``data`` where it
        is aligned, else through a bounce buffer."""
        if self._dio_align is None:
            self._dio_align = dio_alignment(fd)
        if self._dio_align:
            try:
                if write_aligned(fd, PAYLOAD_OFFSET, data, self._dio_align, digest.update, head):
                    return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._dio_align = 0  # the filesystem wants more than it said: bounce from now on
                digest.reset()  # nothing was written; the bounce path feeds it again
        write_direct(fd, PAYLOAD_OFFSET, data, digest.update, head)

    def delete_many(self, model_digest: int, hashes: Sequence[int]) -> int:
        """Delete the files of ``hashes`` (missing ones are skipped); returns how many went.

        A reader that opened a file first keeps reading it (POSIX unlink); one that comes
        later finds it missing, which the read path treats as a miss.
        """
        deleted = 0
        for h in hashes:
            if self.exists(model_digest, h):
                self.delete(model_digest, h)
                deleted += 1
        return deleted

    def read_into(
        self,
        *,
        model_digest: int,
        block_hash: int,
        layers: int,
        tokens: int,
        bytes_per_token_layer: int,
        dtype: str,
        dest: bytearray | memoryview,
        kv_layout: int = 0,
    ) -> int:
        """Read a block's payload straight into ``dest``; return the payload size.

        The payload goes from the file into ``dest[:payload_bytes]`` (by DMA with ``direct``,
        a version 2 file and at least ``IN_PLACE_MIN_BYTES``, where ``dest`` is aligned; else
        copied from the page cache or a bounce buffer), then is verified: the file's size must be its format's, the header
        fields the expected ones and the payload checksum must match. Version 1 files are read
        too. On any error the contents of ``dest`` are unspecified and must not be used.

        Raises:
            BlockMissingError: the block file does not exist.
            CorruptBlockError: bad header, field mismatch, wrong file size (torn/truncated),
                or checksum mismatch.
            ValueError: ``dest`` is read-only, not contiguous, or smaller than the payload.
        """
        view = _as_bytes_view(dest, writable=True)
        path = self._path_str(model_digest, block_hash)
        if min(layers, tokens, bytes_per_token_layer) < 1:
            raise ValueError("layers, tokens and bytes_per_token_layer must be >= 1")
        size = layers * tokens * bytes_per_token_layer
        if len(view) < size:
            raise ValueError(f"dest is {len(view)} bytes, block payload is {size}")
        target = view[:size]
        expected = (model_digest, block_hash, layers, tokens, bytes_per_token_layer, dtype, kv_layout)
        fd, direct = self._open_read(path)
        try:
            file_size = os.fstat(fd).st_size
            version = _VERSION_BY_EXTRA.get(file_size - size)
            if version is None:  # torn or truncated (or not this shape): a miss, before any payload is read
                _raise_bad_size(path, file_size, size, expected)
            head_bytes = payload_offset(version)
            template = header_template(
                model_digest=model_digest, block_hash=block_hash, layers=layers, tokens=tokens,
                bytes_per_token_layer=bytes_per_token_layer, dtype=dtype, kv_layout=kv_layout, version=version,
            )  # fmt: skip
            checksums: list[int] = []

            def check(raw: memoryview) -> None:
                checksum = match_header(raw, template) if template is not None else None
                if checksum is None:  # not the expected header: decode it to say why
                    checksum = _check_header(path, raw, expected, version).checksum
                if len(raw) > HEADER_BYTES and raw[HEADER_BYTES:].tobytes() != _PADDING:  # so damage anywhere is seen
                    raise CorruptBlockError(Path(path), "header padding is not zeros")
                checksums.append(checksum)

            digest = xxhash.xxh3_64()  # fed as the payload lands; equals xxh3_64 of it all
            copied = self._read_payload(fd, direct, head_bytes, target, check, digest.update)
            if not checksums:
                raise CorruptBlockError(Path(path), "header truncated")
            if copied < size:
                raise CorruptBlockError(Path(path), f"payload truncated at {copied} of {size} bytes")
        finally:
            os.close(fd)
        if digest.intdigest() != checksums[0]:
            raise CorruptBlockError(Path(path), "payload checksum mismatch")
        return size

    def _read_payload(
        self,
        fd: int,
        direct: bool,
        head_bytes: int,
        target: memoryview,
        on_head: Callable[[memoryview], None],
        on_data: Callable[[memoryview], None],
    ) -> int:
        """Read a file's head and payload by the fastest path open to it (see ``read_into``);
        return the payload bytes landed."""
        if not direct:
            return _read_buffered(fd, head_bytes, target, on_head, on_data)
        if self._dio_align is None:
            self._dio_align = dio_alignment(fd)
        if self._dio_align and len(target) >= IN_PLACE_MIN_BYTES:
            try:
                landed = read_aligned(fd, head_bytes, target, self._dio_align, on_head, on_data)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._dio_align = 0  # the filesystem wants more than it said: bounce from now on
                landed = None
            if landed is not None:
                return landed
        return read_direct(fd, head_bytes + len(target), target, on_head, on_data)

    def _open_read(self, path: str) -> tuple[int, bool]:
        """A read-only descriptor of ``path``, and whether it is ``O_DIRECT`` (when asked for
        and the filesystem allows it).

        Raises:
            BlockMissingError: the file does not exist.
        """
        try:
            fd = open_direct(path, os.O_RDONLY) if self.direct else None
            return (fd, True) if fd is not None else (os.open(path, os.O_RDONLY), False)
        except FileNotFoundError:
            raise BlockMissingError(Path(path)) from None

    def exists(self, model_digest: int, block_hash: int) -> bool:
        """Whether the block's file exists (it is not verified; ``read_into`` does that)."""
        return self.path_for(model_digest, block_hash).is_file()

    def delete(self, model_digest: int, block_hash: int) -> None:
        """Delete the block's file; a block that is already gone is not an error.

        Raises:
            OSError: the file exists but cannot be removed.
        """
        self.path_for(model_digest, block_hash).unlink(missing_ok=True)

    def usage_bytes(self) -> int:
        """Total size of the block files under the root (temp files are not counted)."""
        return sum(size for _path, size in self._walk(BLOCK_SUFFIX))

    def sweep_temp_files(self, *, older_than_s: float = 3600.0) -> int:
        """Delete temp files left by crashed writers; return how many were deleted.

        Only temp files older than ``older_than_s`` go, so that writers still running on
        other nodes of a shared mount are not disturbed.
        """
        cutoff = time.time() - older_than_s
        removed = 0
        for path, _size in self._walk(TEMP_SUFFIX):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                continue  # its writer finished (renamed) or another sweeper got there first
        return removed

    def _walk(self, suffix: str) -> list[tuple[Path, int]]:
        """Every file under the root whose name ends with ``suffix``, with its size."""
        found: list[tuple[Path, int]] = []
        stack = [self.root]
        while stack:
            try:
                entries = list(os.scandir(stack.pop()))
            except FileNotFoundError:
                continue
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                elif entry.name.endswith(suffix):
                    try:
                        found.append((Path(entry.path), entry.stat(follow_symlinks=False).st_size))
                    except FileNotFoundError:
                        continue  # deleted while we walked
        return found

    def _ensure_dir(self, directory: Path) -> None:
        """Create ``directory`` and missing parents, fsyncing each new entry's parent."""
        if directory.is_dir():
            return
        missing: list[Path] = []
        probe = directory
        while not probe.is_dir():
            missing.append(probe)
            probe = probe.parent
        for new_dir in reversed(missing):
            try:
                new_dir.mkdir(mode=DIR_MODE)
            except FileExistsError:
                pass  # a concurrent writer created it
            _fsync_dir(new_dir.parent)
