"""The emulated NIC: rate accuracy, two-class priority, no starvation, and the same priority
holding for real transfers through a shaped tcp transport."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.transfer import (
    EmulatedNic,
    MemoryRegion,
    TrafficClass,
    TransferEntry,
    TransferError,
    create_transport,
    split_entries,
)

pytestmark = pytest.mark.anyio

MB = 1_000_000
KIB = 1024
LINK = 50 * MB  # slow enough that a busy 2-core host keeps up with ~200 requests/s


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _saturate(acquire: Callable, size: int, until: float, workers: int = 16) -> None:
    """Keep ``workers`` requests of ``size`` bytes outstanding until ``until`` (a deep queue,
    as a real saturating flow has, so the link never runs dry while the host is busy)."""

    async def worker() -> None:
        while anyio.current_time() < until:
            await acquire(size)

    async with anyio.create_task_group() as tg:
        for _ in range(workers):
            tg.start_soon(worker)


async def _paced(acquire: Callable, size: int, rate: float, until: float, issued: list[int]) -> None:
    """Issue ``size``-byte requests at ``rate`` bytes/s until ``until``, each on its own (as
    model-execution steps or queued layer loads are), appending each to ``issued``."""
    period = size / rate
    async with anyio.create_task_group() as tg:
        next_at = anyio.current_time()
        while next_at < until:
            tg.start_soon(acquire, size)
            issued.append(size)
            next_at += period
            await anyio.sleep(max(0.0, next_at - anyio.current_time()))


async def _on_one_of_two(measure: Callable[[], Awaitable[Any]], ok: Callable[[Any], bool], missed: str) -> None:
    """Pass when ``ok`` holds of one of two ``measure()`` results. A shared host that starves
    the event loop for part of a try (a CI run once measured 31.7 of 50 MB/s) leaves the link
    idle for want of requests or delays the last grants, which says nothing of the NIC; a
    pacing or priority regression misses both tries."""
    got = []
    for _ in range(2):
        got.append(await measure())
        if ok(got[-1]):
            return
    raise AssertionError(f"{missed} on both tries: {got}")


async def _kv_alone(seconds: float) -> tuple[float, float]:
    """A fresh link saturated with KV for ``seconds``: its rate (never faster than the link,
    asserted on every try) and its utilisation over the last second."""
    nic = EmulatedNic(LINK, name="cnic0")
    start = anyio.current_time()
    await _saturate(lambda n: nic.acquire(n, TrafficClass.KV), 256 * KIB, start + seconds)
    rate = nic.bytes_sent(TrafficClass.KV) / (anyio.current_time() - start)
    assert rate < 1.05 * nic.rate, rate
    return rate, nic.utilisation(window_s=1.0)


async def test_a_saturated_nic_delivers_its_rate_within_five_percent_over_two_seconds() -> None:
    await _on_one_of_two(
        lambda: _kv_alone(2.0), lambda r: abs(r[0] - LINK) / LINK < 0.05 and r[1] > 0.9, f"the link rate {LINK} B/s missed"
    )


async def _model_share_beside_kv_backlog(nic: EmulatedNic, model_cls: TrafficClass) -> tuple[float, float]:
    """Fraction of a 50%-of-link model demand granted within the window while KV is offered
    at twice the link rate (an ever-growing backlog, as when many layer loads are queued),
    and the link's utilisation over the window's last second."""
    granted: list[tuple[float, int]] = []

    async def model(n: int) -> None:
        await nic.acquire(n, model_cls)
        granted.append((anyio.current_time(), n))

    start = anyio.current_time()
    until = start + 1.0
    demand: list[int] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_paced, lambda n: nic.acquire(n, TrafficClass.KV), 512 * KIB, 2 * nic.rate, until, [])
        tg.start_soon(_paced, model, 128 * KIB, 0.5 * nic.rate, until, demand)
        await anyio.sleep(until + 0.01 - start)
        utilisation = nic.utilisation(window_s=1.0)
        tg.cancel_scope.cancel()  # drop whatever is still queued
    return sum(n for t, n in granted if t <= until + 0.01) / sum(demand), utilisation


async def test_model_traffic_gets_its_demand_while_a_saturating_kv_flow_runs() -> None:
    """Model demand met and KV filling the rest (the link stays busy); the check below shows
    that without priority the same demand is not met."""
    await _on_one_of_two(
        lambda: _model_share_beside_kv_backlog(EmulatedNic(LINK, name="cnic0"), TrafficClass.MODEL),
        lambda r: r[0] >= 0.95 and r[1] >= 0.95,
        "model share and utilisation below 0.95",
    )


async def test_without_priority_the_same_model_demand_is_not_met() -> None:
    """The check above can fail: sent as KV, the same flow loses to the backlog."""
    nic = EmulatedNic(LINK, name="cnic0")
    share, _ = await _model_share_beside_kv_backlog(nic, TrafficClass.KV)
    assert share < 0.8, share


async def test_kv_traffic_alone_takes_at_least_ninety_percent_of_the_link() -> None:
    await _on_one_of_two(lambda: _kv_alone(0.8), lambda r: r[0] >= 0.9 * LINK, "KV alone below 90% of the link")


async def test_kv_traffic_never_starves_behind_saturating_model_traffic() -> None:
    nic = EmulatedNic(LINK, name="cnic0", min_kv_share=0.02)
    start = anyio.current_time()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_saturate, lambda n: nic.acquire(n, TrafficClass.MODEL), 128 * KIB, start + 0.6)
        tg.start_soon(_saturate, lambda n: nic.acquire(n, TrafficClass.KV), 128 * KIB, start + 0.6)
    kv, model = nic.bytes_sent(TrafficClass.KV), nic.bytes_sent(TrafficClass.MODEL)
    assert kv >= 0.01 * (kv + model), (kv, model)  # its guaranteed share, roughly 2%
    assert model >= 0.9 * (kv + model)


async def test_queued_bytes_counts_waiting_requests_per_class_and_forgets_cancelled_ones() -> None:
    nic = EmulatedNic(1 * MB, name="slow", burst_bytes=0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(nic.acquire, 500_000, TrafficClass.KV)  # occupies the link for 0.5 s
        await anyio.sleep(0.01)
        tg.start_soon(nic.acquire, 100_000, TrafficClass.KV)
        tg.start_soon(nic.acquire, 30_000, TrafficClass.MODEL)
        await anyio.sleep(0.01)
        assert nic.queued_bytes(TrafficClass.KV) == 100_000
        assert nic.queued_bytes(TrafficClass.MODEL) == 30_000
        tg.cancel_scope.cancel()
    assert nic.queued_bytes(TrafficClass.KV) == 0
    assert nic.queued_bytes(TrafficClass.MODEL) == 0
    assert nic.bytes_sent(TrafficClass.KV) == 500_000


@settings(deadline=None, max_examples=60)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=5000), max_size=40),
    chunk=st.integers(min_value=1, max_value=4096),
)
def test_split_entries_keeps_every_byte_in_order_and_no_chunk_exceeds_its_limit(lengths: list[int], chunk: int) -> None:
    entries, offset = [], 0
    for i, n in enumerate(lengths):
        entries.append(TransferEntry(offset, f"r{i % 3}", 10 * offset, n))
        offset += n
    chunks = split_entries(entries, chunk)

    assert all(0 < sum(e.length for e in c) <= chunk for c in chunks)
    # Walking the pieces in order must retrace every non-empty entry, byte for byte.
    todo = iter([e for e in entries if e.length])
    current, done = next(todo, None), 0
    for piece in (p for c in chunks for p in c):
        assert current is not None, "a piece beyond the last entry"
        assert piece.remote_region == current.remote_region
        assert piece.local_offset == current.local_offset + done
        assert piece.remote_offset == current.remote_offset + done
        done += piece.length
        assert done <= current.length
        if done == current.length:
            current, done = next(todo, None), 0
    assert current is None, "an entry was not fully covered"


@settings(deadline=None, max_examples=80)
@given(
    shapes=st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 12), st.integers(0, 500)), max_size=12),
    chunk=st.integers(min_value=1, max_value=8192),
)
def test_split_entries_cuts_strided_entries_into_the_same_pieces_in_order(shapes, chunk) -> None:
    entries, offset = [], 0
    for i, (length, count, gap) in enumerate(shapes):
        entries.append(TransferEntry(offset, f"r{i % 2}", 3 * offset, length, count, length, length + gap))
        offset += length * count
    chunks = split_entries(entries, chunk)

    assert all(0 < sum(e.length * e.count for e in c) <= chunk for c in chunks)
    want = [(e.remote_region, lo + k, ro + k) for e in entries for lo, ro, n in e.pieces() for k in range(n)]
    got = [(p.remote_region, lo + k, ro + k) for c in chunks for p in c for lo, ro, n in p.pieces() for k in range(n)]
    assert got == want  # every byte once, in order, at the same local and remote address


async def test_on_a_shaped_tcp_link_model_writes_get_their_demand_beside_kv() -> None:
    """One shaped link (the initiator's NIC) carrying real tcp transfers."""
    nic = EmulatedNic(LINK, name="cnic0", chunk_bytes=256 * KIB)
    initiator = create_transport("tcp", node_id="engine", nic=nic)
    target = create_transport("tcp", node_id="buffer")
    tag = uuid.uuid4().hex[:10]
    local = MemoryRegion(f"test-nic-l-{tag}", 8 << 20)
    remote = MemoryRegion(f"test-nic-r-{tag}", 8 << 20)
    try:
        await initiator.start()
        await target.start()
        await initiator.connect(target.register(remote))
        rid = remote.region_id

        model_done: list[tuple[float, int]] = []

        async def write(cls: TrafficClass, offset: int, n: int) -> None:
            moved = await initiator.write(local, [TransferEntry(offset, rid, offset, n)], traffic_class=cls)
            if cls is TrafficClass.MODEL:
                model_done.append((anyio.current_time(), moved))

        # KV alone: at least 90% of the link (the event loop also copies the bytes here).
        async def kv_alone() -> float:
            sent0, start = nic.bytes_sent(TrafficClass.KV), anyio.current_time()
            await _saturate(lambda n: write(TrafficClass.KV, 0, n), 1 << 20, start + 0.8, workers=4)
            return (nic.bytes_sent(TrafficClass.KV) - sent0) / (anyio.current_time() - start)

        await _on_one_of_two(kv_alone, lambda rate: rate >= 0.9 * nic.rate, "KV alone below 90% of the link")

        # MODEL demand of 50% of the link beside KV writes offered at twice the link rate.
        async def kv_write(n: int) -> None:
            with contextlib.suppress(TransferError):  # a KV write cut off at the window's end
                await write(TrafficClass.KV, 0, n)

        async def model_beside_kv() -> tuple[int, int]:
            """(model bytes landed by the window's end, model bytes asked for)."""
            model_done.clear()
            start = anyio.current_time()
            until = start + 1.5
            demand: list[int] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(_paced, kv_write, 1 << 20, 2 * nic.rate, until, [])
                tg.start_soon(
                    _paced,
                    lambda n: write(TrafficClass.MODEL, 4 << 20, n),
                    256 * KIB,
                    0.5 * nic.rate,
                    until,
                    demand,
                )
                await anyio.sleep(until + 0.05 - start)
                tg.cancel_scope.cancel()
            # Completed (not just scheduled) by the end of the window, give or take the latency
            # of the last few requests (without priority that latency grows with the KV backlog).
            return sum(n for t, n in model_done if t <= until + 0.05), sum(demand)

        await _on_one_of_two(model_beside_kv, lambda r: r[0] >= 0.95 * r[1], "model writes landed below 95% of their demand")
    finally:
        await initiator.close()
        await target.close()
        for region in (local, remote):
            region.close()
            region.unlink()
