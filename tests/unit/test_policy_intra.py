"""Intra-engine prefill batching: FIFO packing under a compute quota with chunked prefill.
Worked examples use a linear predictor (1 ms per new token) so the arithmetic is by hand;
properties use random monotone predictors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.policy import PrefillWork, pack_prefill_batch
from dualpath.policy.errors import InvalidRequestError, InvalidThresholdError
from dualpath.policy.intra import chunk_sizes


def per_token_ms(ms: float):
    return lambda batch: sum(new for _, new in batch) * ms / 1000


def work(rid: int, remaining: int, cached: int = 0) -> PrefillWork:
    return PrefillWork(request_id=rid, cached=cached, remaining=remaining)


def test_whole_requests_are_packed_in_order_while_they_fit():
    batch = pack_prefill_batch([work(1, 100), work(2, 150), work(3, 40)], per_token_ms(1))
    assert [(c.request_id, c.new, c.completes) for c in batch.chunks] == [(1, 100, True), (2, 150, True), (3, 40, True)]
    assert batch.predicted_s == pytest.approx(0.290)
    assert not batch.over_quota


def test_the_request_that_would_exceed_the_quota_is_cut_to_the_largest_block_chunk():
    # 100 ms used; 200 ms left = 200 tokens; largest multiple of 64 below 300 that fits: 192.
    batch = pack_prefill_batch([work(1, 100), work(2, 300), work(3, 10)], per_token_ms(1))
    assert [(c.request_id, c.new, c.completes) for c in batch.chunks] == [(1, 100, True), (2, 192, False)]
    assert batch.predicted_s == pytest.approx(0.292)  # request 3 waits: FIFO


def test_chunks_end_on_absolute_block_boundaries():
    # cached 100: boundaries at 128, 192, 256 ... -> chunk sizes 28, 92, 156, 220, 284.
    # 300 tokens fit the quota, so the chunk is 284 (ends at 384 = 6 blocks).
    assert list(chunk_sizes(100, 400, 64))[:3] == [28, 92, 156]
    batch = pack_prefill_batch([work(1, 400, cached=100)], per_token_ms(1))
    [c] = batch.chunks
    assert (c.cached, c.new, c.completes) == (100, 284, False)
    assert (c.cached + c.new) % 64 == 0


def test_no_chunk_is_added_when_less_than_a_block_of_quota_is_left():
    # 250 ms used; 50 tokens left < one block: request 2 waits for the next batch.
    batch = pack_prefill_batch([work(1, 250), work(2, 500)], per_token_ms(1))
    assert [c.request_id for c in batch.chunks] == [1]


def test_a_lone_request_too_big_for_one_block_still_runs_one_block():
    # 10 ms per token: one block = 640 ms > 300 ms, but the engine must progress.
    batch = pack_prefill_batch([work(1, 10_000), work(2, 1)], per_token_ms(10))
    assert [(c.new, c.completes) for c in batch.chunks] == [(64, False)]
    assert batch.over_quota and batch.predicted_s == pytest.approx(0.640)


def test_a_short_final_remainder_is_taken_whole_even_over_quota():
    batch = pack_prefill_batch([work(1, 40, cached=128)], per_token_ms(10))
    assert [(c.new, c.completes) for c in batch.chunks] == [(40, True)]
    assert batch.over_quota


def test_remainder_continues_in_the_next_batch():
    queue = [work(1, 700)]
    done = 0
    batches = 0
    while queue:
        batch = pack_prefill_batch(queue, per_token_ms(1))
        [c] = batch.chunks
        done += c.new
        batches += 1
        queue = [] if c.completes else [work(1, queue[0].remaining - c.new, cached=c.cached + c.new)]
    assert (done, batches) == (700, 3)  # 256 + 256 + 188 (each batch <= 300 ms, block-aligned)


def test_empty_queue_gives_an_empty_batch():
    batch = pack_prefill_batch([], per_token_ms(1))
    assert batch.chunks == () and batch.predicted_s == 0.0


def test_bad_inputs_are_refused():
    with pytest.raises(InvalidRequestError):
        work(1, 0)
    with pytest.raises(InvalidThresholdError):
        pack_prefill_batch([work(1, 5)], per_token_ms(1), quota_s=0)
    with pytest.raises(InvalidThresholdError):
        pack_prefill_batch([work(1, 5)], per_token_ms(1), block_tokens=0)


# -- properties ------------------------------------------------------------------------------


@st.composite
def predictors(draw):
    """Monotone in every ``new``: per-batch overhead + per-token + attention over context."""
    base = draw(st.floats(0, 0.05))
    per_tok = draw(st.floats(1e-6, 2e-3))
    attn = draw(st.floats(0, 1e-7))
    return lambda batch: base + sum(per_tok * n + attn * n * (c + n) for c, n in batch)


queues = st.lists(
    st.builds(PrefillWork, request_id=st.integers(0, 10**6), cached=st.integers(0, 5000), remaining=st.integers(1, 3000)), max_size=8
)


def _min_size(w: PrefillWork, block: int) -> int:
    sizes = chunk_sizes(w.cached, w.remaining, block)
    return sizes[0] if len(sizes) else w.remaining


def _next_size(c, w: PrefillWork, block: int) -> int:
    """The next allowed size above chunk ``c`` (the next boundary, or the whole remainder)."""
    bigger = [s for s in chunk_sizes(w.cached, w.remaining, block) if s > c.new]
    return bigger[0] if bigger else w.remaining


@settings(max_examples=200, deadline=None)
@given(queues, predictors(), st.floats(0.01, 1.0), st.sampled_from([16, 64]))
def test_packing_keeps_fifo_order_the_quota_and_maximal_chunks(queue, predict, quota, block):
    batch = pack_prefill_batch(queue, predict, quota_s=quota, block_tokens=block)
    chunks = batch.chunks
    assert bool(chunks) == bool(queue)  # progress whenever there is work
    if not queue:
        return
    assert [c.request_id for c in chunks] == [w.request_id for w in queue[: len(chunks)]]  # FIFO prefix
    pairs = [(c.cached, c.new) for c in chunks]
    for c, w in zip(chunks, queue):
        assert c.cached == w.cached and 1 <= c.new <= w.remaining
        assert c.completes == (c.new == w.remaining)
        if not c.completes:
            assert (c.cached + c.new) % block == 0  # partial chunks end on a block boundary
    assert all(c.completes for c in chunks[:-1])  # only the last may be partial
    assert batch.predicted_s == pytest.approx(predict(pairs))
    if batch.over_quota:  # the only excess allowed: one minimal chunk alone
        assert len(chunks) == 1 and chunks[0].new == _min_size(queue[0], block)
        assert predict(pairs) > quota
        return
    assert predict(pairs) <= quota
    if not chunks[-1].completes:  # maximal: the next allowed size does not fit
        last, w = chunks[-1], queue[len(chunks) - 1]
        assert predict([*pairs[:-1], (last.cached, _next_size(last, w, block))]) > quota
    elif len(chunks) < len(queue):  # greedy: not even the next request's smallest chunk fits
        nxt = queue[len(chunks)]
        assert predict([*pairs, (nxt.cached, _min_size(nxt, block))]) > quota
