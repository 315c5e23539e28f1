"""An emulated NIC: one link of a given rate shared by two traffic classes.

The link is a non-preemptive server of byte jobs: a caller ``acquire``s ``nbytes`` and is
released when the link starts to send them; the link is then busy for ``nbytes / rate``
seconds. When both classes wait, ``MODEL`` goes first (strict priority, like the paper's
high-priority InfiniBand virtual lane) except that ``KV`` earns ``min_kv_share`` of the bytes
served meanwhile and is sent as soon as that credit covers its next job — the small weight
IB VL arbitration gives the low lane, so KV never starves. When ``MODEL`` is idle, ``KV``
gets the whole link.

The schedule is kept on its own timeline (``busy_until``), not on when timers fire: like a
real NIC, the link keeps sending its queue while the host is slow to wake up, so a late
timer grants the work that fell due meanwhile (at most ``max_lag_s`` of it) instead of
losing bandwidth. A link that went idle banks at most ``burst_bytes`` of credit (default:
10 ms of link time). One NIC serves one asyncio event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from dualpath.transfer.types import TrafficClass, TransferEntry

__all__ = ["EmulatedNic", "chunk_bytes_for", "split_entries"]

_HISTORY_S = 10.0  # grants older than this are dropped from the utilisation window


@dataclass(slots=True)
class _Waiter:
    nbytes: int
    future: asyncio.Future[None]


def chunk_bytes_for(rate_bytes_per_s: float) -> int:
    """Default chunk of a link of this rate: ~2 ms of link time (bounds MODEL's head-of-line
    wait behind KV), between 16 KiB and 4 MiB."""
    return int(min(max(rate_bytes_per_s * 0.002, 16 * 1024), 4 * 1024 * 1024))


class EmulatedNic:
    """A two-class shaped link of ``rate_bytes_per_s``.

    ``chunk_bytes`` is the size transports split batches into before acquiring, so a
    ``MODEL`` job never waits behind more than one ``KV`` chunk.
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
    ) -> None:
        """Raises:
        ValueError: a non-positive rate, or ``min_kv_share`` outside ``(0, 0.5]``.
        """
        if rate_bytes_per_s <= 0:
            raise ValueError(f"NIC rate must be positive, got {rate_bytes_per_s}")
        if not 0 < min_kv_share <= 0.5:
            raise ValueError(f"min_kv_share must be in (0, 0.5], got {min_kv_share}")
        self.name = name
        self.rate = float(rate_bytes_per_s)
        self.chunk_bytes = chunk_bytes or chunk_bytes_for(self.rate)
        # 10 ms of credit: a timer that fires late (a busy host) costs no bandwidth.
        default_burst = max(self.chunk_bytes, int(self.rate * 0.010))
        self.burst_bytes = default_burst if burst_bytes is None else burst_bytes
        self.max_lag_s = max_lag_s
        self._kv_weight = min_kv_share / (1.0 - min_kv_share)
        self._queues: dict[TrafficClass, deque[_Waiter]] = {c: deque() for c in TrafficClass}
        self._queued = dict.fromkeys(TrafficClass, 0)
        self._sent = dict.fromkeys(TrafficClass, 0)
        self._kv_credit = 0.0
        self._busy_until = 0.0
        self._busy_s = 0.0
        self._grants: deque[tuple[float, float, TrafficClass, int]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None

    async def acquire(self, nbytes: int, traffic_class: TrafficClass = TrafficClass.KV) -> None:
        """Wait until the link starts sending ``nbytes`` of ``traffic_class``.

        Cancelling the caller before its turn gives the turn up; nothing is accounted.
        """
        if nbytes <= 0:
            return
        loop = asyncio.get_running_loop()
        waiter = _Waiter(nbytes, loop.create_future())
        if not any(self._queues.values()):
            # Nothing was queued: the link may have been idle, and idle time banks at most
            # ``burst_bytes`` of credit.
            floor = time.monotonic() - self.burst_bytes / self.rate
            self._busy_until = max(self._busy_until, floor)
        self._queues[traffic_class].append(waiter)
        self._queued[traffic_class] += nbytes
        self._dispatch()
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter in self._queues[traffic_class]:
                self._queues[traffic_class].remove(waiter)
                self._queued[traffic_class] -= nbytes
                self._dispatch()
            raise

    def queued_bytes(self, traffic_class: TrafficClass) -> int:
        """Bytes of ``traffic_class`` waiting for the link (the class's queue length)."""
        return self._queued[traffic_class]

    def bytes_sent(self, traffic_class: TrafficClass) -> int:
        """Bytes of ``traffic_class`` the link has started sending since creation."""
        return self._sent[traffic_class]

    @property
    def busy_seconds(self) -> float:
        """Total link time granted so far (bytes sent / rate)."""
        return self._busy_s

    def utilisation(self, window_s: float = 1.0) -> float:
        """Fraction of the last ``window_s`` seconds the link spent sending (0..1)."""
        return sum(self._overlaps(window_s, None)) / window_s

    def throughput(self, traffic_class: TrafficClass, window_s: float = 1.0) -> float:
        """Bytes per second of ``traffic_class`` over the last ``window_s`` seconds."""
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

    def _pick(self) -> tuple[TrafficClass, _Waiter] | None:
        model = self._queues[TrafficClass.MODEL]
        kv = self._queues[TrafficClass.KV]
        if model and kv:
            if self._kv_credit >= kv[0].nbytes:
                self._kv_credit -= kv[0].nbytes
                return TrafficClass.KV, kv.popleft()
            self._kv_credit += model[0].nbytes * self._kv_weight
            return TrafficClass.MODEL, model.popleft()
        self._kv_credit = 0.0  # credit is owed only while KV waits behind MODEL
        if model:
            return TrafficClass.MODEL, model.popleft()
        if kv:
            return TrafficClass.KV, kv.popleft()
        return None

    def _dispatch(self) -> None:
        now = time.monotonic()
        # Work queued while the host was slow to wake us is granted now, up to max_lag_s.
        self._busy_until = max(self._busy_until, now - self.max_lag_s)
        # One grant per call: when several are due (catching up, or a burst after idle), the
        # next waits one loop iteration, so the tasks just granted can queue again first and
        # the priority order holds within the burst.
        while self._busy_until <= now:
            picked = self._pick()
            if picked is None:
                break
            cls, waiter = picked
            self._queued[cls] -= waiter.nbytes
            if waiter.future.done():  # cancelled between wake-up and dispatch
                continue
            start = self._busy_until
            duration = waiter.nbytes / self.rate
            self._busy_until = start + duration
            self._busy_s += duration
            self._sent[cls] += waiter.nbytes
            self._grants.append((start, start + duration, cls, waiter.nbytes))
            waiter.future.set_result(None)
            break
        while self._grants and self._grants[0][1] < now - _HISTORY_S:
            self._grants.popleft()
        waiting = any(self._queues[c] for c in TrafficClass)
        loop = asyncio.get_running_loop()
        if self._timer_loop is not loop:  # a timer on a finished loop would never fire
            self._timer = None
        if waiting and self._timer is None:
            self._timer_loop = loop
            self._timer = loop.call_later(max(self._busy_until - now, 0.0), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._dispatch()

    def __repr__(self) -> str:
        return f"EmulatedNic({self.name!r}, {self.rate / 1e6:.1f} MB/s)"


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
                current.append(TransferEntry(entry.local_offset + i * entry.local_stride, entry.remote_region,
                                             entry.remote_offset + i * entry.remote_stride, entry.length, k,
                                             entry.local_stride, entry.remote_stride))
                room -= k * entry.length
                i += k
                if room == 0:
                    flush()
            continue
        for local_offset, remote_offset, length in entry.pieces() if entry.count > 1 else [(entry.local_offset, entry.remote_offset, entry.length)]:
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
