"""The same-node transport: an engine and its node's buffer share memory, so a one-sided
read or write is a memcpy between two mappings of shared memory.

``connect`` maps the remote region (by its id, see ``MemoryRegion.attach``). A batch is then
one ``_copier.Job`` (C, built with the compiled extensions): its entries checked against the
regions and cut into pieces of at most ``_PIECE_BYTES``, which whoever copies takes one at a
time. Below ``thread_copy_bytes`` the event loop copies them all; from there, one of the
process's copy threads (``transfer.copy_threads``; more for larger batches, as many as the
host has cores, up to four) is woken and the loop copies pieces meanwhile: the copy starts at
once, not when a thread is awake, and several cores share it. The loop copies at most
``thread_copy_bytes`` itself and leaves the rest to the threads. Without the
build, batches copy through Python (``_copy_views``: a ``memmove`` per piece, the same
threshold). A peer that dies leaves its shared memory mapped here: transfers to it still
complete (there is nothing that could hang).

The key: shared memory has no serving side to ask, so the check is where a region is named,
``connect``: the descriptor's key must be the one the segment holds (``MemoryRegion.key``),
compared in constant time, or the region is not mapped (``AccessDeniedError``, logged) and no
batch can name it. What that protects against: a peer that learned a region's id (from a log,
a control message) but was never handed its descriptor, and a descriptor kept from before its
owner re-created the region (a restart: new segment, new key), which would otherwise read and
write memory its owner no longer means. What it does not: the segment is a file in
``/dev/shm``, created mode 0600, so other users cannot open it, but any process of the same
user can map it by name without asking this transport (the decode engine maps its node's
buffer that way) and read the key there; isolating same-user processes takes separate users
or containers, not a key.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
from collections.abc import Sequence

import numpy as np

from dualpath.telemetry.logs import get_logger
from dualpath.transfer.base import Transport, check_entries
from dualpath.transfer.copy_threads import THREADS, submit_copy, wait_copy
from dualpath.transfer.errors import AccessDeniedError, OutOfBoundsError, RegionInUseError, UnknownRegionError
from dualpath.transfer.nic import DuplexNic, EmulatedNic
from dualpath.transfer.region import MemoryRegion
from dualpath.transfer.types import RegionDescriptor, TrafficClass, TransferEntry

__all__ = ["ShmTransport"]

_log = get_logger("transfer.shm")

try:  # C, built with the compiled extensions (``dualpath compiled build``)
    from dualpath.transfer import _copier  # type: ignore[attr-defined]
except ImportError:  # not built (or DUALPATH_COMPILED=0): batches copy through ``_copy_views``
    _copier = None

#: A ``_copier.Job``'s pieces: a piece is what one thread claims at a time, so two threads
#: share even a single large block.
_PIECE_BYTES = 128 << 10
#: How long the loop spins for pieces a copy thread is copying before it awaits the thread:
#: a piece or two, not a large share.
_SPIN_S = 100e-6


class ShmTransport(Transport):
    """One-sided transfers between regions of processes on the same host."""

    name = "shm"

    def __init__(self, *, node_id: str, nic: DuplexNic | EmulatedNic | None = None, thread_copy_bytes: int = 1 << 20) -> None:
        super().__init__(node_id=node_id, nic=nic)
        self.thread_copy_bytes = thread_copy_bytes
        self._mapped: dict[str, MemoryRegion] = {}  # attached remote regions, by id

    async def start(self) -> None:
        """Nothing to open: shared memory needs no listener."""

    async def close(self) -> None:
        """Unmap every attached remote region (idempotent); regions still viewed elsewhere
        stay mapped until those views are gone."""
        for region in self._mapped.values():
            _close_quietly(region)
        self._mapped.clear()
        self._remote.clear()

    def register(self, region: MemoryRegion) -> RegionDescriptor:
        """Serve ``region`` to same-node peers.

        Raises:
            ValueError: another region with the same id is registered.
        """
        self._add_local(region)
        return RegionDescriptor(
            region_id=region.region_id,
            node_id=self.node_id,
            size=region.size,
            transport=self.name,
            address={"shm_name": region.shm_name},
            key=region.key,
        )

    async def connect(self, remote: RegionDescriptor) -> None:
        """Map the remote region (idempotent) once the descriptor's key is the segment's.

        Raises:
            ValueError: the descriptor is for another transport.
            AccessDeniedError: the descriptor's key is not the segment's (nothing is mapped,
                and batches naming the region fail with ``UnknownRegionError``).
            UnknownRegionError: no shared memory exists for the region on this host.
            OutOfBoundsError: the segment is smaller than the descriptor says.
        """
        await super().connect(remote)
        current = self._mapped.get(remote.region_id)
        if current is not None and current.size == remote.size and current.is_current() and current.accepts(remote.key):
            return  # (not current: its owner restarted and created the segment again)
        own = self._local.get(remote.region_id)
        if own is not None:  # our own region: copy within this process's mapping
            self._check_key(own, remote)
            return
        try:
            mapped = MemoryRegion.attach(remote.region_id, remote.size)
            try:
                self._check_key(mapped, remote)
            except AccessDeniedError:
                _close_quietly(mapped)
                raise
        except BaseException:
            self._remote.pop(remote.region_id, None)
            raise
        if current is not None:
            _close_quietly(current)  # the region was re-created (with another size, or by a new owner)
        self._mapped[remote.region_id] = mapped

    def _check_key(self, region: MemoryRegion, remote: RegionDescriptor) -> None:
        """Raise (and log) ``AccessDeniedError`` unless ``remote`` carries ``region``'s key."""
        if region.accepts(remote.key):
            return
        self._remote.pop(remote.region_id, None)
        _log.warning("shm_key_refused", node=self.node_id, region=remote.region_id, owner=remote.node_id)
        raise AccessDeniedError(remote.region_id, f"descriptor from node {remote.node_id!r} does not carry the segment's key")

    async def _transfer(
        self,
        local: MemoryRegion,
        entries: Sequence[TransferEntry],
        cls: TrafficClass,
        *,
        read: bool,
        links: tuple[EmulatedNic, ...] = (),
    ) -> int:
        """Copy the batch: in the loop when small, else shared with a copy thread; see
        ``Transport.read``/``write``."""
        if _copier is None:
            total = check_entries(self, local, entries)
            if total:
                await self._paced(links, total, cls, self._move(local, list(entries), read, total))
            return total
        job = self._job(local, entries, read)
        try:
            if job.total:
                await self._paced(links, job.total, cls, self._run(job))
        finally:
            job.release()  # no copy thread touches either region after this
        return job.total

    def _job(self, local: MemoryRegion, entries: Sequence[TransferEntry], read: bool) -> _copier.Job:
        """The batch as one ``_copier.Job``: every entry checked against its regions' extents
        and cut into pieces. It raises what ``check_entries`` raises for the same batch."""
        try:
            return _copier.Job(entries, local.buf, self._resolve, read, _PIECE_BYTES)
        except (_copier.BadEntry, UnknownRegionError):
            check_entries(self, local, entries)  # names the first bad entry as every transport does
            raise

    def _resolve(self, region_id: str) -> tuple[memoryview, int]:
        """A remote region's buffer and the bytes of it a batch may reach (``_copier.Job``)."""
        size = self.descriptor(region_id).size
        return self._region(region_id).buf, size

    async def _run(self, job: _copier.Job) -> None:
        """Copy ``job``: in the loop below ``thread_copy_bytes``. Above, copy threads (one per
        2 x ``thread_copy_bytes``, at most ``THREADS``) and the loop take pieces from it at
        once: the copy starts before a thread is awake, and the loop copies no more than a
        batch it would copy alone, then goes back to serving. It spins for the last pieces
        only when they are already being copied."""
        if job.total < self.thread_copy_bytes:
            job.copy(-1, False)  # short: the GIL stays with the loop
            return
        helpers = [submit_copy(job.copy) for _ in range(min(THREADS, max(1, job.total // (2 * self.thread_copy_bytes))))]
        for helper in helpers:
            helper.add_done_callback(_retrieve)
        job.copy(self.thread_copy_bytes)
        if job.claimed and job.wait(_SPIN_S):
            return  # the threads' copy() calls return having found nothing left; nobody waits for them
        for helper in helpers:  # cancelled meanwhile: ``_transfer`` releases the job, which stops the rest
            await wait_copy(helper)

    async def _move(self, local: MemoryRegion, entries: list[TransferEntry], read: bool, total: int) -> None:
        if total < self.thread_copy_bytes:
            self._copy(local, entries, read)
            return
        larr, remote = self._views(local, entries)
        try:
            if total < _SPLIT_PIECE_BYTES * sum(e.count for e in entries):
                await wait_copy(submit_copy(_copy_views, larr, remote, entries, read))
                return
            # Large pieces: the loop copies a share itself while a copy thread moves the rest, so
            # the loop is at work, not asleep waiting to be woken, through most of the thread's
            # part; it holds the loop no longer than a batch under ``thread_copy_bytes`` would.
            mine, theirs = _split(entries, min(total, self.thread_copy_bytes) // 2)
            pending = submit_copy(_copy_views, larr, remote, theirs, read)
            try:
                _copy_views(larr, remote, mine, read)
            finally:
                await wait_copy(pending)
        finally:
            del larr, remote  # a cancelled batch's traceback keeps this frame, not the views

    def _views(self, local: MemoryRegion, entries: list[TransferEntry]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Views of ``local`` and of every remote region the batch names, taken in the loop
        right after the batch was checked. The copy threads work on these, never on a mapping
        looked up later (a reconnect meanwhile may replace it with a smaller one), and while
        they are alive no mapping they view can be closed."""
        remote: dict[str, np.ndarray] = {}
        for e in entries:
            if e.remote_region not in remote:
                remote[e.remote_region] = self._region(e.remote_region).as_array()
        return local.as_array(), remote

    def _region(self, region_id: str) -> MemoryRegion:
        region = self._mapped.get(region_id) or self._local.get(region_id)
        if region is None:  # connected, then the mapping was dropped by close()
            raise UnknownRegionError(region_id, "not mapped on this transport")
        return region

    def _copy(self, local: MemoryRegion, entries: list[TransferEntry], to_local: bool) -> None:
        if any(e.count > 1 for e in entries):
            _copy_views(*self._views(local, entries), entries, to_local)
            return
        lbuf = local.buf
        for e in entries:
            rbuf = self._region(e.remote_region).buf
            if to_local:
                lbuf[e.local_offset : e.local_offset + e.length] = rbuf[e.remote_offset : e.remote_offset + e.length]
            else:
                rbuf[e.remote_offset : e.remote_offset + e.length] = lbuf[e.local_offset : e.local_offset + e.length]


def _retrieve(fut: asyncio.Future[object]) -> None:
    """Retrieve a helper's outcome that nobody awaits (the loop saw the job done first)."""
    if not fut.cancelled():
        fut.exception()


def _split(entries: list[TransferEntry], share: int) -> tuple[list[TransferEntry], list[TransferEntry]]:
    """The first ``share`` bytes of a batch and the rest, as two lists of entries: a
    contiguous entry splits at any byte, a strided one between its pieces."""
    head: list[TransferEntry] = []
    for i, e in enumerate(entries):
        if share <= 0:
            return head, entries[i:]
        nbytes = e.nbytes
        if nbytes <= share:
            head.append(e)
            share -= nbytes
            continue
        if e.count == 1:
            head.append(dataclasses.replace(e, length=share))
            rest = dataclasses.replace(
                e, local_offset=e.local_offset + share, remote_offset=e.remote_offset + share, length=e.length - share
            )
        else:
            pieces = share // e.length
            if pieces == 0:
                return head, entries[i:]
            head.append(dataclasses.replace(e, count=pieces))
            rest = dataclasses.replace(
                e,
                count=e.count - pieces,
                local_offset=e.local_offset + pieces * e.local_stride,
                remote_offset=e.remote_offset + pieces * e.remote_stride,
            )
        return head, [rest, *entries[i + 1 :]]
    return head, []


#: The loop shares a threaded batch's copy only when its pieces are at least this large on
#: average: two threads copying small pieces each release and retake the GIL per piece and
#: hand it back and forth, which costs more than the loop's share saves.
_SPLIT_PIECE_BYTES = 128 << 10

_memmove = ctypes.memmove  # a foreign call: the GIL is released while it copies


def _copy_views(larr: np.ndarray, remote: dict[str, np.ndarray], entries: list[TransferEntry], to_local: bool) -> None:
    """Copy a batch between views from ``ShmTransport._views``: every contiguous entry is one
    ``memmove`` with the GIL released (a copy thread's work), a strided one goes through
    numpy. Every entry is checked against the views first: the batch was checked against the
    descriptors, and a raw copy must never reach outside a mapping whatever happened since."""
    lsize, laddr = larr.size, larr.ctypes.data
    addresses: dict[str, int] = {}
    for e in entries:
        rarr = remote[e.remote_region]
        if e.local_offset < 0 or e.local_end > lsize:
            raise OutOfBoundsError("local", e.local_offset, e.local_end - e.local_offset, lsize)
        if e.remote_offset < 0 or e.remote_end > rarr.size:
            raise OutOfBoundsError(e.remote_region, e.remote_offset, e.remote_end - e.remote_offset, rarr.size)
        if e.count != 1:
            lview = _strided(larr, e.local_offset, e.count, e.length, e.local_stride)
            rview = _strided(rarr, e.remote_offset, e.count, e.length, e.remote_stride)
            if to_local:
                np.copyto(lview, rview)
            else:
                np.copyto(rview, lview)
            continue
        raddr = addresses.get(e.remote_region)
        if raddr is None:
            raddr = addresses[e.remote_region] = rarr.ctypes.data
        if to_local:
            _memmove(laddr + e.local_offset, raddr + e.remote_offset, e.length)
        else:
            _memmove(raddr + e.remote_offset, laddr + e.local_offset, e.length)


def _strided(arr: np.ndarray, offset: int, count: int, length: int, stride: int) -> np.ndarray:
    """``[count, length]`` view of ``count`` pieces ``stride`` bytes apart (bounds checked by
    ``check_entries``)."""
    return np.lib.stride_tricks.as_strided(arr[offset:], shape=(count, length), strides=(stride, 1))


def _close_quietly(region: MemoryRegion) -> None:
    # A caller still holding views keeps the mapping alive until they are gone.
    with contextlib.suppress(RegionInUseError):
        region.close()
