"""Agent-aware prefetch without a bus: the cache's budget, TTL and use, and the scheduler core's
hint when a session's turn ends."""

from __future__ import annotations

import pytest

from dualpath.core import DispatchAnswered, Prefetch, RequestSubmitted, SlotReserved
from dualpath.node.prefetch import PrefetchCache
from tests.unit.test_scheduler_core import Cluster


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_leading_cached_blocks_are_copied_once_and_counted_as_used():
    cache = PrefetchCache(100, ttl_s=10, clock=Clock())
    for h in (1, 2, 4):
        assert cache.put(7, h, bytes([h]) * 10)
    dest = memoryview(bytearray(40))
    assert cache.take_prefix(7, [1, 2, 3, 4], 10, dest) == 2  # block 3 is absent: the prefix ends there
    assert bytes(dest[:20]) == b"\x01" * 10 + b"\x02" * 10 and bytes(dest[20:]) == bytes(20)
    assert cache.stats.used_bytes == 20 and cache.bytes == 10 and (7, 1) not in cache
    assert cache.take_prefix(8, [4], 10, memoryview(bytearray(10))) == 0  # another model's digest


def test_the_budget_evicts_the_oldest_and_refuses_what_can_never_fit():
    cache = PrefetchCache(25, ttl_s=10, clock=Clock())
    assert cache.put(0, 1, b"a" * 10) and cache.put(0, 2, b"b" * 10) and cache.put(0, 3, b"c" * 10)
    assert (0, 1) not in cache and (0, 2) in cache and (0, 3) in cache
    assert cache.bytes == 20 and cache.stats.dropped_bytes == 10
    assert not cache.put(0, 9, b"x" * 26)


def test_expired_blocks_are_dropped_not_served():
    clock = Clock()
    cache = PrefetchCache(100, ttl_s=5, clock=clock)
    cache.put(0, 1, b"a" * 10)
    clock.t = 5.0
    assert cache.take_prefix(0, [1], 10, memoryview(bytearray(10))) == 0
    assert cache.bytes == 0 and cache.stats.dropped_bytes == 10 and cache.stats.used_bytes == 0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        PrefetchCache(-1, 1.0)
    with pytest.raises(ValueError):
        PrefetchCache(10, 0.0)


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
