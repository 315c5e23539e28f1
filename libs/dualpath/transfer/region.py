"""Memory regions: named blocks of POSIX shared memory a transport can serve.

Every region lives in shared memory named after its id, so an engine and its node's buffer
(separate processes on one host) can map the same bytes: the owner creates it, same-node
peers ``attach`` to it. Only the creator registers the segment with multiprocessing's
resource tracker (so a crashed owner's segment is still removed) and only the creator
unlinks it; an attacher maps it without telling the tracker, which would otherwise unlink the
owner's memory when the attacher exits (Python < 3.13 registers attachers too).

Every region has a random 128-bit ``key`` (``secrets.token_bytes``), its rkey in RDMA terms:
transports hand it out only inside the region's descriptor, and every request that names the
region must name the key too. The creator keeps it in the segment, after the region's bytes
(outside ``buf``, so no transfer reaches it), which is how a same-node peer that maps the
segment checks a descriptor against it. Segments are created mode 0600: other users cannot
open them; a process of the same user can (it could read ``/proc/PID/mem`` as well), so the
key guards against peers that only know a region's id, not against code running as the owner.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import ctypes
import hashlib
import hmac
import mmap
import os
import secrets
from multiprocessing import resource_tracker
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from dualpath.transfer.errors import (
    OutOfBoundsError,
    RegionExistsError,
    RegionInUseError,
    UnknownRegionError,
)

if TYPE_CHECKING:
    import torch

__all__ = ["KEY_BYTES", "MemoryRegion", "shm_name_for"]

_RT_TYPE = "shared_memory"
KEY_BYTES = 16  # a region's key; the segment holds it right after the region's bytes


def shm_name_for(region_id: str) -> str:
    """The shared-memory segment name of ``region_id`` (short, portable, no slashes)."""
    digest = hashlib.blake2b(region_id.encode(), digest_size=10).hexdigest()
    return f"dp-{digest}"


class MemoryRegion:
    """A named, fixed-size block of shared memory.

    ``MemoryRegion(region_id, size)`` creates it (zero-filled, with a new random ``key``);
    ``MemoryRegion.attach`` maps an existing one (and reads its key). ``buf`` is a writable
    memoryview of ``size`` bytes.
    """

    def __init__(self, region_id: str, size: int) -> None:
        """Create the region's shared memory.

        Raises:
            ValueError: ``size`` is not positive.
            RegionExistsError: shared memory for ``region_id`` already exists on this host.
        """
        if size <= 0:
            raise ValueError(f"region size must be positive, got {size}")
        name = shm_name_for(region_id)
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        except FileExistsError:
            raise RegionExistsError(region_id, name) from None
        key = secrets.token_bytes(KEY_BYTES)
        try:
            os.ftruncate(fd, size + KEY_BYTES)
            mapping = mmap.mmap(fd, size + KEY_BYTES)
            mapping[size:] = key
            inode = os.fstat(fd).st_ino
        except OSError:
            _posixshmem.shm_unlink("/" + name)
            raise
        finally:
            os.close(fd)
        resource_tracker.register("/" + name, _RT_TYPE)
        self._init(region_id, name, size, mapping, key, owner=True)
        self.inode = inode

    @classmethod
    def attach(cls, region_id: str, size: int | None = None) -> MemoryRegion:
        """Map the existing region ``region_id`` (created by this or another process).

        ``size`` defaults to the whole segment.

        Raises:
            UnknownRegionError: no shared memory exists for ``region_id``.
            OutOfBoundsError: the segment is smaller than ``size``.
        """
        name = shm_name_for(region_id)
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            raise UnknownRegionError(region_id, f"no shared memory {name!r}") from None
        try:
            seg_size = os.fstat(fd).st_size - KEY_BYTES  # the region's bytes; its key follows
            want = seg_size if size is None else size
            if want <= 0 or want > seg_size:
                raise OutOfBoundsError(region_id, 0, want, max(seg_size, 0))
            mapping = mmap.mmap(fd, seg_size + KEY_BYTES)
            key = bytes(mapping[seg_size:])
            inode = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        self = cls.__new__(cls)
        self._init(region_id, name, want, mapping, key, owner=False)
        self.inode = inode
        return self

    def is_current(self) -> bool:
        """Whether the segment this maps is still the one its name opens: False once its owner
        died and a new owner (a restarted traffic manager) created the region again, so a
        mapping kept from before would read and write memory nobody else sees. True where the
        segments are not visible as files (not Linux)."""
        try:
            return os.stat(f"/dev/shm/{self.shm_name}").st_ino == self.inode
        except FileNotFoundError:
            return not os.path.isdir("/dev/shm")

    def _init(self, region_id: str, name: str, size: int, mapping: mmap.mmap, key: bytes, *, owner: bool) -> None:
        self.region_id = region_id
        self.shm_name = name
        self.size = size
        self.owner = owner
        self.key = key  # [KEY_BYTES]: what every request naming this region must present
        self._mmap: mmap.mmap | None = mapping
        self._buf: memoryview | None = memoryview(mapping)[:size]
        self._unlinked = False

    @property
    def buf(self) -> memoryview:
        """Writable view of the region's ``size`` bytes.

        Raises:
            ValueError: the region is closed.
        """
        if self._buf is None:
            raise ValueError(f"region {self.region_id!r} is closed")
        return self._buf

    @property
    def closed(self) -> bool:
        """Whether ``close`` has unmapped the region."""
        return self._buf is None

    @property
    def address(self) -> int:
        """Virtual address of the first byte in this process (for RDMA registration)."""
        anchor = ctypes.c_char.from_buffer(self.buf)
        try:
            return ctypes.addressof(anchor)
        finally:
            del anchor

    def accepts(self, key: bytes) -> bool:
        """Whether ``key`` is this region's key (compared in constant time, so how long the
        comparison takes says nothing about how much of a guess was right)."""
        return len(key) == KEY_BYTES and hmac.compare_digest(key, self.key)

    def check_range(self, offset: int, length: int) -> None:
        """Raise ``OutOfBoundsError`` unless ``[offset, offset+length)`` lies in the region."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise OutOfBoundsError(self.region_id, offset, length, self.size)

    def as_array(self, offset: int = 0, nbytes: int | None = None, dtype: Any = np.uint8) -> np.ndarray:
        """A numpy view (no copy) of ``nbytes`` at ``offset`` (default: to the end).

        Raises:
            OutOfBoundsError: the range is outside the region.
            ValueError: ``nbytes`` is not a multiple of the dtype's size.
        """
        nbytes = self.size - offset if nbytes is None else nbytes
        self.check_range(offset, nbytes)
        itemsize = np.dtype(dtype).itemsize
        if nbytes % itemsize:
            raise ValueError(f"{nbytes} bytes is not a whole number of {np.dtype(dtype)}")
        return np.frombuffer(self.buf, dtype=dtype, count=nbytes // itemsize, offset=offset)

    def as_tensor(self, offset: int = 0, nbytes: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A CPU torch tensor view (no copy) of ``nbytes`` at ``offset``; ``dtype`` defaults
        to ``torch.uint8``.

        Raises:
            OutOfBoundsError: the range is outside the region.
            ValueError: ``nbytes`` is not a multiple of the dtype's size.
        """
        import torch  # imported lazily: transports and services without torch stay light

        dtype = torch.uint8 if dtype is None else dtype
        nbytes = self.size - offset if nbytes is None else nbytes
        self.check_range(offset, nbytes)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if nbytes % itemsize:
            raise ValueError(f"{nbytes} bytes is not a whole number of {dtype}")
        # Through numpy, not torch.frombuffer: the ndarray holds a buffer export for as long
        # as the tensor lives, so close() refuses to unmap memory a tensor still points at.
        raw = torch.from_numpy(self.as_array(offset, nbytes))  # [nbytes] uint8
        return raw.view(dtype)

    def close(self) -> None:
        """Unmap the region in this process (idempotent); the segment stays for others.

        Raises:
            RegionInUseError: arrays, tensors or memoryviews of the region are still alive.
        """
        if self._mmap is None:
            return
        try:
            if self._buf is not None:
                self._buf.release()
            self._mmap.close()
        except BufferError:
            self._buf = memoryview(self._mmap)[: self.size]
            raise RegionInUseError(self.region_id) from None
        self._buf = None
        self._mmap = None

    def unlink(self) -> None:
        """Remove the shared-memory segment (idempotent); existing mappings stay valid.

        Normally only the creator calls it; an attacher may, to clean up after a crash.
        """
        if self._unlinked:
            return
        self._unlinked = True
        with contextlib.suppress(FileNotFoundError):  # someone cleaned up already
            _posixshmem.shm_unlink("/" + self.shm_name)
        if self.owner:
            resource_tracker.unregister("/" + self.shm_name, _RT_TYPE)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()

    def __repr__(self) -> str:
        role = "owner" if self.owner else "attached"
        return f"MemoryRegion({self.region_id!r}, size={self.size}, {role})"
