"""The node core's slot lifecycle, event by event (no traffic manager, no clock of its own)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.node import BufferFullError, BufferPool, NodeBuffer, slot_key

MB = 1 << 20


def buffer(size: int = 8 * MB, share: int = 6 * MB, **kw) -> NodeBuffer:
    return NodeBuffer(BufferPool(size), share, **kw)


def test_slots_are_one_per_attempt_within_the_request_buffers_share_and_a_second_alloc_is_the_same_slot():
    b = buffer()
    s0 = b.alloc("r", 0, 2 * MB)
    assert b.alloc("r", 0, 2 * MB) == s0 and b.slot("r", 0) == s0
    s1 = b.alloc("r", 1, 2 * MB)
    assert s1.offset != s0.offset and b.request_bytes() == 4 * MB
    with pytest.raises(BufferFullError):
        b.alloc("q", 0, 3 * MB)  # 2 MiB are left of the 6 MiB share (the region has 4)
    assert b.free_request_bytes() == 2 * MB


def test_a_free_while_a_transfer_uses_the_slot_takes_effect_when_the_transfer_ends():
    b = buffer()
    b.alloc("r", 0, MB)
    key = slot_key("r", 0)
    with b.using(key):
        assert b.free("r", 0) == "deferred" and b.slot("r", 0) is not None
    assert b.slot("r", 0) is None and b.request_bytes() == 0
    assert b.free("r", 0) == "no slot"


def test_an_alloc_again_cancels_a_pending_free():
    b = buffer()
    b.alloc("r", 0, MB)
    key = slot_key("r", 0)
    with b.using(key):
        b.release(key)
        b.alloc("r", 0, MB)  # the same attempt takes its slot again (e.g. a DE read after a persist)
    assert b.slot("r", 0) is not None


def test_slots_given_up_by_a_retry_are_quarantined_until_their_time():
    b = buffer(quarantine_s=5.0)
    for a in (0, 1, 2):
        b.alloc("r", a, MB)
    assert b.give_up_below("r", 2, now=100.0) == 2
    b.sweep(104.9)
    assert b.slot("r", 0) is not None and b.slot("r", 1) is not None
    b.sweep(105.0)
    assert b.slot("r", 0) is None and b.slot("r", 1) is None and b.slot("r", 2) is not None


def test_a_dead_schedulers_unclaimed_reservations_go_back_after_the_grace_and_claimed_ones_stay():
    b = buffer(reclaim_after_s=30.0)
    b.on_scheduler("old", now=0.0)
    b.alloc("claimed", 0, MB, instance="old", now=10.0)
    b.alloc("unclaimed", 0, MB, instance="old", now=10.0)
    b.alloc("engine-owned", 0, MB)  # not a reservation (a prefill's PE slot)
    b.claim("claimed", 0)
    assert b.reclaim(now=1000.0) == []  # the old scheduler is still the active one
    b.on_scheduler("new", now=100.0)
    b.alloc("new-one", 0, MB, instance="new", now=101.0)
    assert b.reclaim(now=129.9) == []
    gone = b.reclaim(now=130.0)
    assert [(r.key, r.instance, r.outcome) for r in gone] == [(slot_key("unclaimed", 0), "old", "freed")]
    assert all(b.slot(rid, 0) is not None for rid in ("claimed", "engine-owned", "new-one"))
    assert b.reclaimed == 1 and b.reclaim(now=1e9) == []


def test_room_is_the_largest_slot_first_fit_can_place_not_the_free_total():
    """The free bytes a node reports are what a reservation can get: two free runs of 1 MB
    apart are not room for a 2 MB slot."""
    node = buffer(size=4 * MB, share=4 * MB)
    for i in range(4):
        node.alloc(f"r{i}", 0, MB)
    node.free("r0", 0), node.free("r2", 0)
    assert node.free_request_bytes() == 2 * MB and node.room() == MB
    with pytest.raises(BufferFullError):
        node.alloc("big", 0, 2 * MB)
    node.free("r1", 0)
    assert node.room() == 3 * MB and node.alloc("big", 0, 3 * MB).offset == 0


def test_a_de_slot_whose_prompt_blocks_were_persisted_is_retained_whole_not_just_its_hits():
    """``keep_prompt`` marks the slot's hits and new prompt blocks as the run to keep; the free
    that follows keeps all of them (not only the hits its load verified)."""
    from dualpath.node.prefetch import PrefetchCache

    pool, bb = BufferPool(16 * MB), 4096
    cache = PrefetchCache(pool, None, 8 * MB, ttl_s=60.0, clock=lambda: 0.0)
    node = NodeBuffer(pool, 8 * MB, cache)
    slot = node.alloc("r", 0, 10 * bb)
    node.loaded(slot_key("r", 0), 7, [1, 2, 3], bb)  # the load verified three hit blocks
    node.keep_prompt(slot_key("r", 0), 7, [1, 2, 3], [4, 5], slot.offset + 3 * bb, bb)  # two prompt blocks persisted after them
    node.free("r", 0)
    assert cache.stats.retained_bytes == 5 * bb and all((7, h) in cache for h in (1, 2, 3, 4, 5))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 15), st.integers(1, 5 * 4096)), max_size=80))
def test_the_pool_places_first_fit_and_coalesces_as_a_page_map_says(ops: list[tuple[bool, int, int]]) -> None:
    """Against a map of 4 KiB pages: each alloc lands at the lowest run of free pages long
    enough (runs merged when freed), slots never overlap, the free figures agree."""
    pages = 24
    pool, used = BufferPool(pages * 4096), [False] * pages
    for is_alloc, owner_no, nbytes in ops:
        owner = f"o{owner_no}"
        if is_alloc and pool.get(owner) is None:
            need = BufferPool.rounded(nbytes) // 4096
            fits = [p for p in range(pages - need + 1) if not any(used[p : p + need])]
            if not fits:
                with pytest.raises(BufferFullError):
                    pool.alloc(owner, nbytes)
                continue
            slot = pool.alloc(owner, nbytes)
            assert (slot.offset // 4096, slot.nbytes // 4096) == (fits[0], need)
            used[fits[0] : fits[0] + need] = [True] * need
        elif not is_alloc:
            slot = pool.get(owner)
            assert pool.free(owner) == (slot is not None)
            if slot is not None:
                used[slot.offset // 4096 : (slot.offset + slot.nbytes) // 4096] = [False] * (slot.nbytes // 4096)
        runs = "".join("x" if u else "." for u in used).split("x")
        assert pool.free_bytes == used.count(False) * 4096
        assert pool.largest_free() == max(len(r) for r in runs) * 4096
