"""The node buffer allocator and the slot layout (Layer Blocks are runs inside Full Blocks)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.engine.layout import SlotLayout
from dualpath.node.buffer import BufferFullError, BufferPool


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 15), st.integers(1, 40000)), max_size=80))
def test_slots_never_overlap_and_freeing_everything_restores_one_run(ops):
    pool = BufferPool(1 << 18)
    live = {}
    for alloc, owner_num, size in ops:
        owner = f"r{owner_num}"
        if alloc and owner not in live:
            try:
                live[owner] = pool.alloc(owner, size)
            except BufferFullError:
                continue
        elif not alloc and owner in live:
            assert pool.free(owner)
            del live[owner]
        spans = sorted((s.offset, s.offset + s.nbytes) for s in live.values())
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert all(0 <= a and b <= pool.size for a, b in spans)
        assert pool.free_bytes == pool.size - sum(s.nbytes for s in live.values())
    for owner in list(live):
        pool.free(owner)
    assert pool.free_bytes == pool.size
    assert pool.alloc("all", pool.size).nbytes == pool.size


def test_full_buffer_raises_a_named_error_with_the_figures():
    pool = BufferPool(8192)
    pool.alloc("a", 8192)
    with pytest.raises(BufferFullError, match="need 4096"):
        pool.alloc("b", 1)


def test_layer_runs_address_layer_blocks_inside_full_blocks():
    lay = SlotLayout(layers=3, block_tokens=4, bytes_per_token_layer=10)
    assert (lay.layer_bytes, lay.block_bytes) == (40, 120)
    # tokens 2..9 of layer 1: block 0 tokens 2-3, block 1 tokens 4-7, block 2 tokens 8-9
    assert lay.layer_runs(1, 2, 10) == [(0 + 40 + 20, 2, 2), (120 + 40, 4, 4), (240 + 40, 8, 2)]
    assert lay.layer_runs(0, 5, 5) == []
    assert lay.slot_bytes(9) == 3 * 120


@settings(max_examples=100, deadline=None)
@given(
    layers=st.integers(1, 6),
    bt=st.integers(1, 16),
    bpt=st.integers(1, 32),
    start=st.integers(0, 100),
    n=st.integers(0, 100),
    layer=st.integers(0, 5),
)
def test_layer_runs_cover_each_token_exactly_once_at_its_address(layers, bt, bpt, start, n, layer):
    layer %= layers
    lay = SlotLayout(layers=layers, block_tokens=bt, bytes_per_token_layer=bpt)
    seen = []
    for off, tok, cnt in lay.layer_runs(layer, start, start + n):
        for i in range(cnt):
            t = tok + i
            assert off + i * bpt == (t // bt) * lay.block_bytes + layer * lay.layer_bytes + (t % bt) * bpt
            seen.append(t)
    assert seen == list(range(start, start + n))


@settings(max_examples=150, deadline=None)
@given(
    layers=st.integers(1, 6),
    bt=st.integers(1, 16),
    bpt=st.integers(1, 32),
    start=st.integers(0, 100),
    n=st.integers(0, 100),
    layer=st.integers(0, 5),
)
def test_layer_strided_is_layer_runs_grouped_into_at_most_three_strided_runs(layers, bt, bpt, start, n, layer):
    layer %= layers
    lay = SlotLayout(layers=layers, block_tokens=bt, bytes_per_token_layer=bpt)
    strided = lay.layer_strided(layer, start, start + n)
    expanded = [(off + k * lay.block_bytes, tok + k * cnt, cnt) for off, tok, cnt, count in strided for k in range(count)]
    assert expanded == lay.layer_runs(layer, start, start + n)
    assert len(strided) <= 3


def test_layer_strided_puts_whole_blocks_in_one_run():
    lay = SlotLayout(layers=3, block_tokens=4, bytes_per_token_layer=10)
    # tokens 2..17 of layer 1: block 0 tokens 2-3, blocks 1-3 whole, block 4 token 16
    assert lay.layer_strided(1, 2, 17) == [(60, 2, 2, 1), (160, 4, 4, 3), (520, 16, 1, 1)]
    assert lay.layer_strided(0, 0, 8) == [(0, 0, 4, 2)]
