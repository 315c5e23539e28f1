"""Emulated NICs: links of a given rate shared by two traffic classes, full-duplex pairs.

An ``EmulatedNic`` is one direction of a link: a non-preemptive server of byte jobs. A
caller ``acquire``s ``nbytes`` and is released when the link starts to send them; the link
is then busy for ``nbytes / rate`` seconds, and ``acquire`` returns when that ends (the
``monotonic`` time a transfer is complete: transports wait for the last chunk's end, so a
batch costs ``bytes / rate`` of link time, its last chunk included). When both classes wait,
``MODEL`` goes first (strict priority, like the paper's high-priority InfiniBand virtual lane)
except that ``KV`` earns ``min_kv_share`` of the bytes served meanwhile and is sent as soon as
that credit covers its next job — the small weight IB VL arbitration gives the low lane, so
KV never starves. When ``MODEL`` is idle, ``KV`` gets the whole link.

The schedule is kept on its own timeline (``busy_until``), not on when timers fire: like a
real NIC, the link keeps sending its queue while the host is slow to wake up, so a late
timer grants the work that fell due meanwhile (at most ``max_lag_s`` of it) instead of
losing bandwidth. A job that finds the link idle starts when it asks (``burst_bytes`` of
idle credit may be banked; none by default, so an idle link's transfer takes exactly its
modeled time).

**Shared links.** A link given a ``shared`` key keeps its timeline, queue lengths, credit and
counters in a small shared-memory segment guarded by ``flock``, so several processes on one
host charge one link: the paper's hardware has one NIC per GPU, and a transfer touches the
NICs at *both* ends (an engine reading a decode node's buffer is paced by the decode GPU's
CNIC too, whoever initiates it). Each process queues its own waiters; whichever process's
timer finds the link free grants its next job, MODEL before KV across all of them and, within
a class, first come first served (each process publishes its oldest job's enqueue time).
``EmulatedNic.attach(key)`` finds a link another process created (clocks are
``time.monotonic``: one system-wide clock).

A ``DuplexNic`` is a full-duplex NIC: separate ``rx`` (into the GPU or host) and ``tx`` (out
of it) links, as real 400 Gbps NICs are. ``DuplexNic.links(read, peer)`` names the links one
transfer occupies: a read takes the initiator's ``rx`` and the peer's ``tx``; a write the
initiator's ``tx`` and the peer's ``rx``; a loopback copy (the peer is the initiator's own
NIC, e.g. a GPU's H2D through its CNIC) takes both directions of that one NIC.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import fcntl
import hashlib
import mmap
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from dualpath.transfer.types import TrafficClass, TransferEntry

__all__ = ["DuplexNic", "EmulatedNic", "NicDirectory", "chunk_bytes_for", "complete", "reserve", "sleep_until", "split_entries", "withdraw"]

_HISTORY_S = 10.0  # grants older than this are dropped from the utilisation window

# Fields of a link's state (float64 each), private or in shared memory.
_BUSY, _CREDIT, _Q_MODEL, _Q_KV, _BUSY_S, _SENT_MODEL, _SENT_KV, _RATE, _CHUNK, _MIN_KV, _ONE_CLASS, _NEXT_SLOT = range(12)
# Per process of a shared link, the enqueue times of its oldest MODEL and KV jobs, so the link
# serves each class first come, first served across processes (as a NIC arbitrates its QPs).
_SLOTS, _SLOT0 = 16, 12
_FIELDS = _SLOT0 + 2 * _SLOTS
_EMPTY = 1e300  # no job waiting
_STALE_S = 5.0  # a head older than this belongs to a process that stopped serving it: ignored
_QUEUED = {TrafficClass.MODEL: _Q_MODEL, TrafficClass.KV: _Q_KV}
_SENT = {TrafficClass.MODEL: _SENT_MODEL, TrafficClass.KV: _SENT_KV}
_SHM_DIR = "/dev/shm"
_attached: dict[str, EmulatedNic] = {}  # shared links this process has opened, by key


@dataclass(slots=True)
class _Waiter:
    nbytes: int
    future: asyncio.Future[float]
    cls: TrafficClass = TrafficClass.KV  # the class it is counted in (its queue may be the only one)
    t: float = 0.0  # when it was queued (first come, first served across processes)


def chunk_bytes_for(rate_bytes_per_s: float) -> int:
    """Default chunk of a link of this rate: ~2 ms of link time (bounds MODEL's head-of-line
    wait behind KV), between 16 KiB and 4 MiB."""
    return int(min(max(rate_bytes_per_s * 0.002, 16 * 1024), 4 * 1024 * 1024))


async def sleep_until(deadline: float) -> None:
    """Sleep until ``time.monotonic()`` reaches ``deadline`` (no-op when it has)."""
    left = deadline - time.monotonic()
    if left > 0:
        await asyncio.sleep(left)


def _shm_path(key: str) -> str:
    return os.path.join(_SHM_DIR, "dualpath-nic-" + hashlib.blake2b(key.encode(), digest_size=10).hexdigest())


class _State:
    """A link's state array and the lock around updates to it (a no-op when private)."""

    def __init__(self, arr: np.ndarray, fd: int | None = None, mapping: mmap.mmap | None = None, path: str = "") -> None:
        self.arr = arr
        self._fd = fd
        self._mapping = mapping
        self.path = path

    @property
    def shared(self) -> bool:
        """Whether other processes may use this state (it lives in shared memory)."""
        return self._fd is not None

    @contextlib.contextmanager
    def locked(self) -> Iterator[np.ndarray]:
        if self._fd is None:
            yield self.arr
            return
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield self.arr
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    @classmethod
    def create(cls, key: str) -> _State:
        path = _shm_path(key)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, _FIELDS * 8)
        mapping = mmap.mmap(fd, _FIELDS * 8)
        return cls(np.ndarray((_FIELDS,), dtype=np.float64, buffer=mapping), fd, mapping, path)

    @classmethod
    def open(cls, key: str) -> _State:
        """Raises: FileNotFoundError: no process created the link ``key`` on this host."""
        path = _shm_path(key)
        fd = os.open(path, os.O_RDWR)
        mapping = mmap.mmap(fd, _FIELDS * 8)
        return cls(np.ndarray((_FIELDS,), dtype=np.float64, buffer=mapping), fd, mapping, path)

    def close(self, *, unlink: bool) -> None:
        if self._fd is None:
            return
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        os.close(self._fd)
        self._fd = None


class EmulatedNic:
    """A two-class shaped link of ``rate_bytes_per_s`` (one direction of a NIC).

    ``chunk_bytes`` is the size transports split batches into before acquiring, so a
    ``MODEL`` job never waits behind more than one ``KV`` chunk. ``shared``: a host-wide key
    under which other processes ``attach`` to this link (this object owns it and removes it
    on ``close``).
    """

    def __init__(
        self,
        rate_bytes_per_s: float,
        *,
        name: str,
        burst_bytes: int | None = None,
        chunk_bytes: int | None = None,
        min_kv_share: float = 0.01,
        max_lag_s: float = 0.1,
        shared: str | None = None,
        one_class: bool = False,
    ) -> None:
        """``one_class``: no isolation — every job waits in one FIFO queue whatever its class
        (counted in its own class still), the baseline the two-class link is compared with.

        Raises:
            ValueError: a non-positive rate, or ``min_kv_share`` outside ``(0, 0.5]``.
        """
        if rate_bytes_per_s <= 0:
            raise ValueError(f"NIC rate must be positive, got {rate_bytes_per_s}")
        if not 0 < min_kv_share <= 0.5:
            raise ValueError(f"min_kv_share must be in (0, 0.5], got {min_kv_share}")
        chunk = chunk_bytes or chunk_bytes_for(float(rate_bytes_per_s))
        state = _State.create(shared) if shared else _State(np.zeros(_FIELDS, dtype=np.float64))
        with state.locked() as st:
            st[:] = 0.0
            st[_SLOT0:] = _EMPTY
            st[_RATE], st[_CHUNK], st[_MIN_KV] = float(rate_bytes_per_s), chunk, min_kv_share
            st[_ONE_CLASS] = 1.0 if one_class else 0.0
        self._init(name, state, burst_bytes, max_lag_s, owner=True)
        if shared:
            _attached[shared] = self
            atexit.register(self.close)  # the owner removes the segment even if nobody calls close
        self.key = shared or ""

    def _init(self, name: str, state: _State, burst_bytes: int | None, max_lag_s: float, *, owner: bool) -> None:
        st = state.arr
        self.name = name
        self._state = state
        self._owner = owner
        self.rate = float(st[_RATE])
        self.chunk_bytes = int(st[_CHUNK])
        self.burst_bytes = 0 if burst_bytes is None else burst_bytes
        self.max_lag_s = max_lag_s
        self._kv_weight = float(st[_MIN_KV]) / (1.0 - float(st[_MIN_KV]))
        self.one_class = bool(st[_ONE_CLASS])
        self._queues: dict[TrafficClass, deque[_Waiter]] = {c: deque() for c in TrafficClass}
        self._grants: deque[tuple[float, float, TrafficClass, int]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        self._slot: int | None = None  # this process's head slot (shared links)
        if state.shared:
            with state.locked() as st:
                n = int(st[_NEXT_SLOT])
                st[_NEXT_SLOT] = n + 1
                if n < _SLOTS:
                    self._slot = _SLOT0 + 2 * n
                    st[self._slot] = st[self._slot + 1] = _EMPTY

    @classmethod
    def attach(cls, key: str, *, name: str = "") -> EmulatedNic:
        """The shared link ``key`` (created by this or another process on this host); one
        object per key per process.

        Raises:
            FileNotFoundError: no process created it.
        """
        nic = _attached.get(key)
        if nic is not None:
            return nic
        nic = cls.__new__(cls)
        nic._init(name or key, _State.open(key), None, 0.1, owner=False)
        nic.key = key
        _attached[key] = nic
        return nic

    def close(self) -> None:
        """Release a shared link's memory (the owner also removes it); idempotent."""
        if self.key and _attached.get(self.key) is self:
            del _attached[self.key]
        if self._slot is not None and self._state.shared:
            with self._state.locked() as st:
                st[self._slot] = st[self._slot + 1] = _EMPTY
        self._state.close(unlink=self._owner)

    def enqueue(self, nbytes: int, traffic_class: TrafficClass = TrafficClass.KV) -> asyncio.Future[float]:
        """Queue a job of ``nbytes`` now; the future resolves when the link starts sending it,
        to the ``time.monotonic()`` at which it will have sent it. A batch queues all its
        chunks at once, so the link's timeline has no gaps while the host is slow to come
        back for the next one. ``withdraw`` a future that is no longer wanted."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(max(nbytes, 0), loop.create_future(), traffic_class, time.monotonic())
        if nbytes <= 0:
            waiter.future.set_result(time.monotonic())
            return waiter.future
        if self.one_class:
            traffic_class = TrafficClass.KV  # one FIFO queue for every class
        with self._state.locked() as st:
            if st[_Q_MODEL] + st[_Q_KV] <= 0:
                # Nothing was queued anywhere: the link may have been idle, and idle time banks
                # at most ``burst_bytes`` of credit.
                st[_BUSY] = max(st[_BUSY], time.monotonic() - self.burst_bytes / self.rate)
            st[_QUEUED[traffic_class]] += nbytes
            self._queues[traffic_class].append(waiter)
            self._publish(st)
        self._dispatch()
        return waiter.future

    def withdraw(self, future: asyncio.Future[float]) -> None:
        """Give up a queued job (nothing is accounted); a granted one stays granted."""
        for cls, queue in self._queues.items():
            for waiter in queue:
                if waiter.future is future:
                    queue.remove(waiter)
                    with self._state.locked() as st:
                        st[_QUEUED[cls]] = max(0.0, st[_QUEUED[cls]] - waiter.nbytes)
                        self._publish(st)
                    future.cancel()
                    self._dispatch()
                    return

    async def acquire(self, nbytes: int, traffic_class: TrafficClass = TrafficClass.KV) -> float:
        """Wait until the link starts sending ``nbytes`` of ``traffic_class``; return the
        ``time.monotonic()`` at which the link will have sent them (the job's completion).

        Cancelling the caller before its turn gives the turn up; nothing is accounted.
        """
        future = self.enqueue(nbytes, traffic_class)
        try:
            return await future
        except asyncio.CancelledError:
            self.withdraw(future)
            raise

    async def send(self, nbytes: int, traffic_class: TrafficClass = TrafficClass.KV) -> None:
        """Acquire ``nbytes`` and wait until the link has sent them (a whole job's time)."""
        await sleep_until(await self.acquire(nbytes, traffic_class))

    def queued_bytes(self, traffic_class: TrafficClass) -> int:
        """Bytes of ``traffic_class`` waiting for the link (the class's queue length, all
        processes of a shared link)."""
        return int(self._state.arr[_QUEUED[traffic_class]])

    def bytes_sent(self, traffic_class: TrafficClass) -> int:
        """Bytes of ``traffic_class`` the link has started sending since creation."""
        return int(self._state.arr[_SENT[traffic_class]])

    @property
    def busy_until(self) -> float:
        """When the link will have sent everything granted so far (``time.monotonic``)."""
        return float(self._state.arr[_BUSY])

    @property
    def busy_seconds(self) -> float:
        """Total link time granted so far (bytes sent / rate)."""
        return float(self._state.arr[_BUSY_S])

    def utilisation(self, window_s: float = 1.0) -> float:
        """Fraction of the last ``window_s`` seconds the link spent sending (0..1) — the
        grants this process made (all of them for a private link)."""
        return sum(self._overlaps(window_s, None)) / window_s

    def throughput(self, traffic_class: TrafficClass, window_s: float = 1.0) -> float:
        """Bytes per second of ``traffic_class`` over the last ``window_s`` seconds (grants
        made by this process)."""
        return sum(self._overlaps(window_s, traffic_class)) * self.rate / window_s

    def _overlaps(self, window_s: float, cls: TrafficClass | None) -> Iterator[float]:
        now = time.monotonic()
        lo = now - window_s
        for start, end, grant_cls, _ in self._grants:
            if cls is not None and grant_cls != cls:
                continue
            overlap = min(end, now) - max(start, lo)
            if overlap > 0:
                yield overlap

    def _publish(self, st: np.ndarray) -> None:
        """Write this process's oldest waiting MODEL and KV enqueue times to its slot."""
        if self._slot is not None:
            model, kv = self._queues[TrafficClass.MODEL], self._queues[TrafficClass.KV]
            st[self._slot] = model[0].t if model else _EMPTY
            st[self._slot + 1] = kv[0].t if kv else _EMPTY

    def _first(self, st: np.ndarray, queue: deque[_Waiter], offset: int) -> bool:
        """Whether this process's head of ``queue`` is the oldest of its class on the link
        (always true for a private link, or heads of processes that stopped serving them)."""
        if self._slot is None or not queue:
            return bool(queue)
        mine = queue[0].t
        floor = time.monotonic() - _STALE_S
        heads = st[_SLOT0 + offset : _FIELDS : 2]
        return not bool(((heads < mine) & (heads > floor)).any())

    def _pick(self, st: np.ndarray) -> tuple[TrafficClass, _Waiter] | None:
        """This process's next job, or None (nothing here, or another process's job of the
        class goes first, or only KV held back by MODEL waiting elsewhere)."""
        model = self._queues[TrafficClass.MODEL] if self._first(st, self._queues[TrafficClass.MODEL], 0) else deque()
        kv = self._queues[TrafficClass.KV] if self._first(st, self._queues[TrafficClass.KV], 1) else deque()
        if model:
            if kv and st[_CREDIT] >= kv[0].nbytes:
                st[_CREDIT] -= kv[0].nbytes
                return TrafficClass.KV, kv.popleft()
            if st[_Q_KV] > 0:  # KV waits somewhere behind this MODEL job: it earns its share
                st[_CREDIT] += model[0].nbytes * self._kv_weight
            return TrafficClass.MODEL, model.popleft()
        if not kv:
            return None
        if st[_Q_MODEL] > 0:  # MODEL waits in another process: KV goes only on credit
            if st[_CREDIT] >= kv[0].nbytes:
                st[_CREDIT] -= kv[0].nbytes
                return TrafficClass.KV, kv.popleft()
            return None
        st[_CREDIT] = 0.0  # credit is owed only while KV waits behind MODEL
        return TrafficClass.KV, kv.popleft()

    def _dispatch(self) -> None:
        now = time.monotonic()
        blocked = False
        with self._state.locked() as st:
            # Work queued while the host was slow to wake us is granted now, up to max_lag_s.
            st[_BUSY] = max(st[_BUSY], now - self.max_lag_s)
            # One grant per call: when several are due (catching up, or a burst after idle),
            # the next waits one loop iteration, so the tasks just granted can queue again
            # first and the priority order holds within the burst.
            while st[_BUSY] <= now:
                picked = self._pick(st)
                if picked is None:
                    blocked = any(self._queues.values())
                    break
                queue_cls, waiter = picked
                st[_QUEUED[queue_cls]] = max(0.0, st[_QUEUED[queue_cls]] - waiter.nbytes)
                if waiter.future.done():  # cancelled between wake-up and dispatch
                    continue
                start = float(st[_BUSY])
                duration = waiter.nbytes / self.rate
                st[_BUSY] = start + duration
                st[_BUSY_S] += duration
                st[_SENT[waiter.cls]] += waiter.nbytes
                self._grants.append((start, start + duration, waiter.cls, waiter.nbytes))
                waiter.future.set_result(start + duration)
                break
            self._publish(st)
            busy_until = float(st[_BUSY])
        while self._grants and self._grants[0][1] < now - _HISTORY_S:
            self._grants.popleft()
        loop = asyncio.get_running_loop()
        if self._timer_loop is not loop:  # a timer on a finished loop would never fire
            self._timer = None
        if any(self._queues.values()) and self._timer is None:
            delay = max(busy_until - now, 0.0)
            if blocked:  # another process's job goes first; look again shortly
                delay = max(delay, 0.25 * self.chunk_bytes / self.rate)
            self._timer_loop = loop
            self._timer = loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._dispatch()

    def __repr__(self) -> str:
        return f"EmulatedNic({self.name!r}, {self.rate / 1e6:.1f} MB/s)"


@dataclass(frozen=True, slots=True)
class DuplexNic:
    """A full-duplex NIC: ``rx`` carries bytes into its GPU or host, ``tx`` out of it."""

    rx: EmulatedNic
    tx: EmulatedNic

    @property
    def name(self) -> str:
        return self.rx.name.removesuffix("-rx")

    @property
    def chunk_bytes(self) -> int:
        return min(self.rx.chunk_bytes, self.tx.chunk_bytes)

    @classmethod
    def create(
        cls,
        rate_bytes_per_s: float,
        *,
        name: str,
        chunk_bytes: int | None = None,
        shared: str | None = None,
        min_kv_share: float = 0.01,
        one_class: bool = False,
    ) -> DuplexNic:
        """Two links of ``rate_bytes_per_s``, shared under ``{shared}-rx``/``-tx`` when a key is given."""
        return cls(
            *(
                EmulatedNic(
                    rate_bytes_per_s,
                    name=f"{name}-{d}",
                    chunk_bytes=chunk_bytes,
                    min_kv_share=min_kv_share,
                    shared=f"{shared}-{d}" if shared else None,
                    one_class=one_class,
                )
                for d in ("rx", "tx")
            )
        )

    @classmethod
    def attach(cls, shared: str) -> DuplexNic:
        """The duplex NIC another process created under ``shared``.

        Raises:
            FileNotFoundError: no process created it.
        """
        return cls(EmulatedNic.attach(f"{shared}-rx"), EmulatedNic.attach(f"{shared}-tx"))

    @classmethod
    def half_duplex(cls, link: EmulatedNic) -> DuplexNic:
        """One link carrying both directions (reads and writes share it)."""
        return cls(link, link)

    def links(self, read: bool, peer: DuplexNic | None = None) -> tuple[EmulatedNic, ...]:
        """The links a transfer initiated here occupies: see the module docstring."""
        own = self.rx if read else self.tx
        if peer is None:
            return (own,)
        other = peer.tx if read else peer.rx
        return (own,) if other is own else (own, other)

    async def acquire(self, nbytes: int, traffic_class: TrafficClass = TrafficClass.KV) -> float:
        """A loopback copy of ``nbytes`` through this NIC (a GPU's H2D or D2H goes through its
        CNIC, the paper's §5): wait until both directions have started it; return when both
        will have sent it (``time.monotonic``)."""
        end = 0.0
        for link in self.links(True, self):
            end = max(end, await link.acquire(nbytes, traffic_class))
        return end

    async def copy(self, nbytes: int, traffic_class: TrafficClass = TrafficClass.KV) -> None:
        """A whole loopback copy, in chunks queued at once on both directions: returns when
        it is complete."""
        links = self.links(True, self)
        await complete(links, reserve(links, nbytes, traffic_class))

    def close(self) -> None:
        self.rx.close()
        if self.tx is not self.rx:
            self.tx.close()


def reserve(links: Sequence[EmulatedNic], nbytes: int, traffic_class: TrafficClass) -> list[asyncio.Future[float]]:
    """Queue ``nbytes`` on every link, cut into each link's chunks (all at once: see
    ``EmulatedNic.enqueue``); ``await complete(...)`` on the result."""
    futures = []
    for link in links:
        chunk = link.chunk_bytes
        for start in range(0, nbytes, chunk):
            futures.append(link.enqueue(min(chunk, nbytes - start), traffic_class))
    return futures


async def complete(links: Sequence[EmulatedNic], futures: list[asyncio.Future[float]]) -> None:
    """Wait until every reserved chunk has been sent (the batch's completion); on
    cancellation or error the chunks not granted yet are withdrawn."""
    try:
        end = 0.0
        for future in futures:
            end = max(end, await future)
        await sleep_until(end)
    except BaseException:
        withdraw(links, futures)
        raise


def withdraw(links: Sequence[EmulatedNic], futures: list[asyncio.Future[float]]) -> None:
    """Give up the reserved chunks not granted yet (a batch that failed)."""
    for future in futures:
        if not future.done():
            for link in links:
                link.withdraw(future)


class NicDirectory:
    """Finds the shared duplex NICs of other processes by name (``{prefix}.{name}``), e.g. a
    decode engine's CNIC that a prefill engine's transfer to its buffer also occupies."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._known: dict[str, DuplexNic | None] = {}

    @staticmethod
    def key(prefix: str, name: str) -> str:
        """The shared key of ``name``'s NIC under ``prefix``."""
        return f"{prefix}.{name}"

    def get(self, name: str) -> DuplexNic | None:
        """``name``'s NIC, or None when no process on this host created it (not emulated,
        or not started yet: asked again next time)."""
        nic = self._known.get(name)
        if nic is None:
            try:
                nic = DuplexNic.attach(self.key(self.prefix, name))
            except FileNotFoundError:
                return None
            self._known[name] = nic
        return nic


def split_entries(entries: Sequence[TransferEntry], chunk_bytes: int) -> list[list[TransferEntry]]:
    """Split a batch into consecutive chunks of at most ``chunk_bytes`` each, cutting
    entries longer than that into pieces (so a NIC can interleave other traffic). A strided
    entry is cut between its pieces into strided entries of fewer pieces."""
    chunks: list[list[TransferEntry]] = []
    current: list[TransferEntry] = []
    room = chunk_bytes

    def flush() -> None:
        nonlocal current, room
        chunks.append(current)
        current, room = [], chunk_bytes

    for entry in entries:
        if entry.nbytes == 0:
            continue
        if entry.count > 1 and entry.length <= chunk_bytes:
            i = 0
            while i < entry.count:
                if room < entry.length:
                    flush()
                k = min(entry.count - i, room // entry.length)
                current.append(
                    TransferEntry(
                        entry.local_offset + i * entry.local_stride,
                        entry.remote_region,
                        entry.remote_offset + i * entry.remote_stride,
                        entry.length,
                        k,
                        entry.local_stride,
                        entry.remote_stride,
                    )
                )
                room -= k * entry.length
                i += k
                if room == 0:
                    flush()
            continue
        pieces = entry.pieces() if entry.count > 1 else [(entry.local_offset, entry.remote_offset, entry.length)]
        for local_offset, remote_offset, length in pieces:
            done = 0
            while done < length:
                take = min(length - done, room)
                current.append(TransferEntry(local_offset + done, entry.remote_region, remote_offset + done, take))
                done += take
                room -= take
                if room == 0:
                    flush()
    if current:
        chunks.append(current)
    return chunks
