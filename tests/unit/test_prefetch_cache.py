"""Agent-aware prefetch without a bus: the cache's budget, TTL and use, and the scheduler core's
hint when a session's turn ends."""

from __future__ import annotations

import pytest

from dualpath.core import DispatchAnswered, Prefetch, RequestSubmitted, SlotReserved
from dualpath.node.buffer import BufferFullError, BufferPool
from dualpath.node.prefetch import PrefetchCache
from dualpath.policy import ReadSide
from tests.unit.test_scheduler_core import Cluster


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _cache(buffer: int = 1 << 16, budget: int = 100, ttl: float = 10.0, clock: Clock | None = None) -> tuple[PrefetchCache, BufferPool]:
    pool = BufferPool(buffer)
    region = memoryview(bytearray(buffer))
    return PrefetchCache(pool, region, budget, ttl_s=ttl, clock=clock or Clock()), pool


def _stage(cache: PrefetchCache, digest: int, hashes: list[int], bb: int):
    run = cache.open_run(digest, hashes, bb)
    assert run is not None
    for i, h in enumerate(run.hashes):
        assert cache.fill(run, i, memoryview(bytes([h]) * bb))
    return run


def test_leading_staged_blocks_are_copied_once_and_counted_as_used():
    cache, pool = _cache(buffer=1 << 16, budget=1 << 16)
    _stage(cache, 7, [1, 2], 10)
    _stage(cache, 7, [4], 10)
    dest = memoryview(bytearray(40))
    assert cache.take_prefix(7, [1, 2, 3, 4], 10, dest) == 2  # block 3 is absent: the prefix ends there
    assert bytes(dest[:20]) == b"\x01" * 10 + b"\x02" * 10 and bytes(dest[20:]) == bytes(20)
    assert cache.stats.used_bytes == 20 and cache.stats.dropped_bytes == 0 and (7, 1) not in cache and (7, 4) in cache
    assert cache.take_prefix(8, [4], 10, memoryview(bytearray(10))) == 0  # another model's digest
    assert pool.owners() == [next(iter(cache._runs))]  # the consumed run's slot went back to the buffer


def test_staged_runs_live_in_the_node_buffer_and_are_given_up_before_a_request_waits():
    cache, pool = _cache(buffer=3 * 4096, budget=3 * 4096)
    _stage(cache, 0, [1], 4096)
    _stage(cache, 0, [2], 4096)
    assert cache.bytes == 2 * 4096 and pool.free_bytes == 4096  # the same pool the requests' slots come from
    cache.alloc("small", 4096)  # fits in the free room: no run is given up
    assert cache.stats.evictions == 0 and (0, 1) in cache
    pool.free("small")
    cache.alloc("req", 2 * 4096)  # runs go, oldest first, until a contiguous run of room fits
    assert (0, 1) not in cache and cache.stats.evictions >= 1 and cache.stats.dropped_bytes >= 4096
    assert cache.open_run(0, [9], 3 * 4096) is None  # a request's room is never taken for a hint
    with pytest.raises(BufferFullError):
        cache.alloc("big", 4 * 4096)  # nothing left to give up


def test_the_budget_stages_only_the_leading_blocks_that_fit_and_never_drops_another_run():
    bb = 4096
    cache, _ = _cache(buffer=1 << 20, budget=3 * bb)
    _stage(cache, 0, [1], bb)
    run = _stage(cache, 0, [3, 4, 5], bb)  # two blocks of room left: the leading two
    assert run.hashes == [3, 4] and (0, 1) in cache and cache.stats.dropped_bytes == 0
    assert cache.open_run(0, [9], bb) is None  # the budget is spent: the hint waits for nothing
    assert cache.open_run(0, [9], 4 * bb) is None  # one block larger than the budget


def test_a_run_takes_only_the_free_room_requests_left():
    bb = 4096
    cache, pool = _cache(buffer=4 * bb, budget=1 << 20)
    pool.alloc("req", 3 * bb)
    run = _stage(cache, 0, [1, 2, 3], bb)
    assert run.hashes == [1] and pool.free_bytes == 0 and pool.get("req") is not None


def test_expired_blocks_are_dropped_not_served():
    clock = Clock()
    cache, pool = _cache(clock=clock, ttl=5)
    _stage(cache, 0, [1], 10)
    clock.t = 5.0
    assert cache.take_prefix(0, [1], 10, memoryview(bytearray(10))) == 0
    assert cache.bytes == 0 and pool.owners() == [] and cache.stats.dropped_bytes == 10 and cache.stats.used_bytes == 0


def test_a_block_filled_into_a_dropped_run_is_not_kept():
    cache, _ = _cache(buffer=1 << 16, budget=1 << 16)
    run = cache.open_run(0, [1, 2], 10)
    assert run is not None and cache.fill(run, 0, memoryview(b"a" * 10))
    assert cache.make_room()
    assert not cache.fill(run, 1, memoryview(b"b" * 10)) and len(cache) == 0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        _cache(budget=-1)
    with pytest.raises(ValueError):
        _cache(ttl=0.0)


def _finish_session_turn(prefetch: bool, session: str) -> list:
    c = Cluster(prefetch=prefetch)
    c.handle(
        RequestSubmitted(
            now=c.now,
            request_id="r1",
            prompt_tokens=300,
            hit_blocks=2,
            block_tokens=64,
            max_tokens=16,
            payload={"id": "r1"},
            session=session,
        )
    )
    assert len(c.tick()) == 1  # ReserveSlot
    (d,) = c.handle(SlotReserved(now=c.now, request_id="r1", attempt=0, region={"r": 1}, offset=0))
    c.handle(DispatchAnswered(now=c.now, request_id="r1", attempt=0))
    assert c.report(d.prefill_engine, finished=("r1",)) == []  # the prefill part ending hints nothing
    return c.report(d.decode_engine, finished=("r1",))


def test_a_finished_session_turn_hints_its_prefill_node():
    (hint,) = _finish_session_turn(True, "agent-3")
    assert isinstance(hint, Prefetch) and hint.node == "P" and hint.session == "agent-3" and hint.payload == {"id": "r1"}


def test_no_hint_without_a_session_or_with_prefetch_off():
    assert _finish_session_turn(True, "") == []
    assert _finish_session_turn(False, "agent-3") == []


def _session_turn(c, rid: str, session: str, node_q: dict[str, int]) -> list:
    """Submit a session's turn (2 hit blocks) with the given read queues; the commands of its pass."""
    for node, q in node_q.items():
        c.node_report(node, q)
    c.handle(
        RequestSubmitted(
            now=c.now, request_id=rid, prompt_tokens=300, hit_blocks=2, block_tokens=64, max_tokens=16, payload={"id": rid}, session=session
        )
    )
    return c.tick()


def test_the_next_turn_reads_on_the_node_that_staged_it_even_with_a_longer_queue():
    c = Cluster(prefetch=True)
    (reserve,) = _session_turn(c, "r1", "agent-3", {"P": 1000, "D1": 0, "D2": 0})  # DE side reads: the shorter queue
    (d,) = c.handle(SlotReserved(now=c.now, request_id="r1", attempt=0, region={"r": 1}, offset=0))
    assert d.read_side is ReadSide.DE
    c.handle(DispatchAnswered(now=c.now, request_id="r1", attempt=0))
    c.report(d.prefill_engine, finished=("r1",))
    (hint,) = c.report(d.decode_engine, finished=("r1",))
    assert isinstance(hint, Prefetch) and hint.node == d.decode_node  # the node that read stages the next turn
    (reserve,) = _session_turn(c, "r2", "agent-3", {"P": 0, "D1": 100, "D2": 100})
    assert reserve.node == d.decode_node  # the decode group holding the copy (room there, load even)
    (d2,) = c.handle(SlotReserved(now=c.now, request_id="r2", attempt=0, region={"r": 1}, offset=0))
    assert d2.read_side is ReadSide.DE  # the side with the staged copy, though its queue is longer
    (reserve,) = _session_turn(c, "r3", "agent-4", {"P": 0, "D1": 100, "D2": 100})
    (d3,) = c.handle(SlotReserved(now=c.now, request_id="r3", attempt=0, region={"r": 1}, offset=0))
    assert d3.read_side is ReadSide.PE  # another session: the shorter queue as ever


def test_a_staged_side_with_a_much_longer_queue_is_not_forced():
    c = Cluster(prefetch=True)
    _session_turn(c, "r1", "agent-3", {"P": 1000, "D1": 0, "D2": 0})
    (d,) = c.handle(SlotReserved(now=c.now, request_id="r1", attempt=0, region={"r": 1}, offset=0))
    c.handle(DispatchAnswered(now=c.now, request_id="r1", attempt=0))
    c.report(d.prefill_engine, finished=("r1",))
    c.report(d.decode_engine, finished=("r1",))
    _session_turn(c, "r2", "agent-3", {"P": 0, "D1": 5000, "D2": 5000})  # 5000 > 0 + the request's 128 hits
    (d2,) = c.handle(SlotReserved(now=c.now, request_id="r2", attempt=0, region={"r": 1}, offset=0))
    assert d2.read_side is ReadSide.PE  # a lost copy would cost more than one read: the shorter queue


def test_a_retained_slot_becomes_a_run_in_place_within_the_budget_and_never_drops_another():
    cache, pool = _cache(buffer=4 * 4096, budget=3 * 4096)
    slot = pool.alloc("req#0", 2 * 4096)
    cache.region[slot.offset : slot.offset + 4096] = b"\x07" * 4096
    assert cache.retain("req#0", 1, [7, 8], 4096)
    assert "req#0" not in pool.owners() and cache.bytes == 2 * 4096 and pool.free_bytes == 2 * 4096  # same bytes, new owner
    assert cache.stats.retained_bytes == 2 * 4096 and (1, 7) in cache and (1, 8) in cache
    other = pool.alloc("other#0", 2 * 4096)
    assert not cache.retain("other#0", 1, [9, 10], 4096)  # over the budget: the caller frees it, the first run stays
    assert pool.get("other#0") == other and (1, 7) in cache
    assert not cache.retain("other#0", 1, [1, 2, 3], 4096)  # more blocks than the slot holds
    dest = memoryview(bytearray(4096))
    assert cache.take_prefix(1, [7], 4096, dest) == 1 and bytes(dest) == b"\x07" * 4096
