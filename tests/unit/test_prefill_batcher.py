"""``PrefillBatcher``, the prefill engine's core, driven without a bus: requests arrive between
batches, batches are packed under the compute quota by the paper's rule, chunks continue."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.core.batch_errors import BatchOrderError, DuplicateRequestError, InvalidRequestError
from dualpath.core.prefill_batcher import PrefillBatch, PrefillBatcher
from dualpath.cost import cost_model

BLOCK = 64


def per_token_ms(ms: float):
    return lambda batch: sum(new for _, new in batch) * ms / 1000


def run_all(b: PrefillBatcher) -> list[PrefillBatch]:
    batches = []
    while (batch := b.next_batch()) is not None:
        batches.append(batch)
        b.finish_batch()
    return batches


def test_requests_are_packed_whole_in_arrival_order_while_they_fit():
    b = PrefillBatcher(per_token_ms(1))
    for rid, n in (("a", 100), ("b", 150), ("c", 40)):
        b.add(rid, cached=0, total=n)
    batch = b.next_batch()
    assert [(it.request_id, it.new, it.last) for it in batch.items] == [("a", 100, True), ("b", 150, True), ("c", 40, True)]
    assert batch.predicted_s == pytest.approx(0.290) and batch.quota_s == 0.3 and not batch.chunked
    assert b.finish_batch() == ["a", "b", "c"] and len(b) == 0


def test_a_cut_request_continues_from_its_block_aligned_chunk_at_the_head_of_the_queue():
    b = PrefillBatcher(per_token_ms(1))
    b.add("long", cached=128, total=128 + 500)
    b.add("short", cached=0, total=30)
    first = b.next_batch()
    assert [(it.request_id, it.cached, it.new, it.last) for it in first.items] == [("long", 128, 256, False)]
    assert first.chunked and (128 + 256) % BLOCK == 0
    assert b.finish_batch() == [] and b.progress("long") == 384
    second = b.next_batch()
    assert [(it.request_id, it.cached, it.new, it.last) for it in second.items] == [("long", 384, 244, True), ("short", 0, 30, True)]
    assert b.finish_batch() == ["long", "short"]


def test_a_lone_block_over_the_quota_still_runs_so_the_engine_progresses():
    b = PrefillBatcher(per_token_ms(10))  # one block = 640 ms > 300 ms
    b.add("r", cached=0, total=1000)
    batch = b.next_batch()
    assert [(it.new, it.last) for it in batch.items] == [(BLOCK, False)] and batch.over_quota
    assert batch.predicted_s == pytest.approx(0.640)


def test_the_driver_must_report_a_batch_before_asking_for_the_next():
    b = PrefillBatcher(per_token_ms(1))
    b.add("r", cached=0, total=10)
    b.next_batch()
    with pytest.raises(BatchOrderError):
        b.next_batch()
    b.finish_batch()
    with pytest.raises(BatchOrderError):
        b.finish_batch()


def test_a_failed_batch_drops_its_requests_and_keeps_the_others():
    b = PrefillBatcher(per_token_ms(1))
    b.add("a", cached=0, total=200)
    b.add("b", cached=0, total=200)  # only a chunk of b fits with a
    b.add("c", cached=0, total=10)
    batch = b.next_batch()
    assert [it.request_id for it in batch.items] == ["a", "b"]
    assert b.fail_batch() == ["a", "b"]
    assert "c" in b and "a" not in b and len(b) == 1


def test_a_request_removed_while_its_batch_runs_is_left_out_of_the_result():
    b = PrefillBatcher(per_token_ms(1))
    b.add("a", cached=0, total=50)
    b.add("b", cached=0, total=50)
    b.next_batch()
    assert b.remove("a") and not b.remove("zzz")
    assert b.finish_batch() == ["b"] and len(b) == 0


def test_bad_requests_are_refused():
    b = PrefillBatcher(per_token_ms(1))
    b.add("r", cached=0, total=10)
    with pytest.raises(DuplicateRequestError):
        b.add("r", cached=0, total=10)
    with pytest.raises(InvalidRequestError):
        b.add("full-hit", cached=128, total=128)  # nothing left to compute
    with pytest.raises(InvalidRequestError):
        b.add("neg", cached=-64, total=10)


def test_tokens_left_counts_what_the_queue_still_has_to_compute():
    b = PrefillBatcher(per_token_ms(1))
    b.add("a", cached=64, total=564)
    b.add("b", cached=0, total=100)
    assert b.tokens_left() == 600
    b.next_batch()
    b.finish_batch()
    assert b.tokens_left() == 600 - 256 - 0  # a's 256-token chunk; b waits behind it


# -- properties over many requests -----------------------------------------------------------


@st.composite
def predictors(draw):
    """Monotone in every ``new``: per-batch overhead + per-token + attention over context."""
    base = draw(st.floats(0, 0.02))
    per_tok = draw(st.floats(1e-6, 2e-3))
    attn = draw(st.floats(0, 1e-7))
    return lambda batch: (base + sum(per_tok * n + attn * n * (c + n) for c, n in batch)) if batch else 0.0


requests = st.tuples(st.integers(0, 40), st.integers(1, 3000))  # (hit blocks, tokens to compute)
arrivals = st.lists(st.lists(requests, max_size=6), min_size=1, max_size=8)  # requests arriving before each batch


def check_run(waves, predict, quota: float) -> None:
    """Drive a batcher with ``waves`` of arrivals (one wave before each batch, then drain) and
    check every batch and the whole run against the rule."""
    b = PrefillBatcher(predict, quota_s=quota, block_tokens=BLOCK)
    order: list[str] = []
    want: dict[str, tuple[int, int]] = {}  # rid -> (cached, total)
    done_at: dict[str, int] = {}  # rid -> next token expected (chunk continuity)
    finished: list[str] = []
    i = 0
    waves = list(waves)
    while waves or len(b):
        for hit_blocks, new in waves.pop(0) if waves else []:
            rid = f"r{i}"
            i += 1
            cached = hit_blocks * BLOCK
            b.add(rid, cached=cached, total=cached + new)
            order.append(rid)
            want[rid] = (cached, cached + new)
            done_at[rid] = cached
        batch = b.next_batch()
        if batch is None:
            continue
        assert batch.predicted_s == pytest.approx(predict(batch.pairs()))
        minimal = len(batch.items) == 1 and batch.items[0].new == min(BLOCK, want[batch.items[0].request_id][1] - batch.items[0].cached)
        assert batch.predicted_s <= quota or minimal, batch  # the quota, except one minimal chunk alone
        assert batch.over_quota == (batch.predicted_s > quota)
        pending = [rid for rid in order if rid not in finished]
        assert [it.request_id for it in batch.items] == pending[: len(batch.items)]  # FIFO: a queue prefix
        for it in batch.items:
            assert it.cached == done_at[it.request_id]  # chunks are contiguous
            done_at[it.request_id] += it.new
            assert it.last == (done_at[it.request_id] == want[it.request_id][1])
            if not it.last:
                assert (it.cached + it.new) % BLOCK == 0  # cut chunks end on a block boundary
        assert all(it.last for it in batch.items[:-1])  # only the last item may be cut
        finished += b.finish_batch()
    assert finished == order  # every request completes, in arrival order
    assert all(done_at[rid] == want[rid][1] for rid in order)  # tokens conserved across chunks


@settings(max_examples=150, deadline=None)
@given(arrivals, predictors(), st.floats(0.01, 0.6))
def test_every_batch_stays_within_the_quota_in_fifo_order_with_block_aligned_chunks(waves, predict, quota):
    check_run(waves, predict, quota)


DS27B = cost_model("ds27b")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 900), st.integers(1, 20000)), max_size=5), min_size=1, max_size=5))
def test_the_testbed_cost_model_keeps_every_predicted_batch_under_300_ms(waves):
    """The modeled testbed's predictor (ds27b on h800, 300 ms): contexts up to ~57K tokens."""
    check_run(waves, DS27B.prefill_time, 0.300)
