"""``DecodeBatcher``, the decode engine's core, driven without a bus: KV-memory admission,
steps, block flushes, leaving and eviction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.core.batch_errors import DuplicateRequestError, InvalidRequestError, KvCapacityError
from dualpath.core.decode_batcher import CANCELLED, DecodeBatcher

BLOCK = 64


def test_admission_reserves_prompt_plus_max_tokens_in_whole_blocks_and_waits_fifo_for_room():
    b = DecodeBatcher(capacity_tokens=10 * BLOCK, block_tokens=BLOCK, max_running=8)
    b.add("a", prompt_tokens=200, max_tokens=56)  # 256 tokens: 4 blocks
    b.add("b", prompt_tokens=300, max_tokens=30)  # 330 -> 6 blocks
    b.add("c", prompt_tokens=10, max_tokens=10)  # 1 block, but behind b
    assert b.admit() == ["a", "b"] and b.free_tokens == 0
    assert b.admit() == [] and b.waiting == ("c",)  # no room, and no overtaking
    b.evict("a")
    assert b.free_tokens == 4 * BLOCK and b.admit() == ["c"]


def test_admission_stops_at_max_running():
    b = DecodeBatcher(capacity_tokens=100 * BLOCK, block_tokens=BLOCK, max_running=2)
    for rid in "abc":
        b.add(rid, prompt_tokens=10, max_tokens=5)
    assert b.admit() == ["a", "b"] and not b.admit_ready()


def test_a_request_larger_than_the_whole_memory_is_refused_at_once():
    b = DecodeBatcher(capacity_tokens=4 * BLOCK, block_tokens=BLOCK)
    with pytest.raises(KvCapacityError) as err:
        b.add("big", prompt_tokens=250, max_tokens=7)  # 257 tokens: 5 blocks
    assert err.value.needed == 5 * BLOCK and err.value.capacity == 4 * BLOCK
    b.add("fits", prompt_tokens=250, max_tokens=6)
    with pytest.raises(DuplicateRequestError):
        b.add("fits", prompt_tokens=250, max_tokens=6)
    with pytest.raises(InvalidRequestError):
        b.add("none", prompt_tokens=0, max_tokens=6)


def test_a_request_runs_until_max_tokens_then_leaves_and_frees_its_reservation():
    b = DecodeBatcher(capacity_tokens=8 * BLOCK, block_tokens=BLOCK)
    b.add("r", prompt_tokens=20, max_tokens=4)  # the first token came from prefill: 3 steps left
    b.admit()
    steps = 0
    while (step := b.next_step()) is not None:
        assert step.decode == ("r",)
        out = b.finish_step(step)
        steps += 1
    assert steps == 3 and out.leaving == (("r", "length"),)
    assert b.free_tokens == 8 * BLOCK and b.running == ()


def test_a_stop_reason_from_the_driver_ends_the_request():
    b = DecodeBatcher(capacity_tokens=8 * BLOCK, block_tokens=BLOCK)
    b.add("r", prompt_tokens=20, max_tokens=100)
    b.admit()
    out = b.finish_step(b.next_step(), {"r": "stop"})
    assert out.leaving == (("r", "stop"),) and b.next_step() is None


def test_every_block_that_fills_is_reported_once_including_the_final_flush():
    # 62 prompt tokens + the first token = 63 tokens, KV of 62; one step: KV of 63, token 64
    # sampled, generation done. Token 64 completes block 0, so one more forward computes its KV.
    b = DecodeBatcher(capacity_tokens=8 * BLOCK, block_tokens=BLOCK)
    b.add("r", prompt_tokens=62, max_tokens=2)  # tokens: 62 prompt + 2 generated = 64 = one block
    b.admit()
    out = b.finish_step(b.next_step())  # computes KV of token 63, samples token 64: done ("length")
    assert out.filled == () and out.leaving == ()  # token 64's KV is still missing: a flush is due
    step = b.next_step()
    assert step.decode == () and step.flush == ("r",)
    out = b.finish_step(step)
    assert out.filled == (("r", 0),) and out.leaving == (("r", "length"),)


def test_a_cancelled_request_leaves_without_a_flush_and_a_cancelled_waiting_one_leaves_once_admitted():
    b = DecodeBatcher(capacity_tokens=2 * BLOCK, block_tokens=BLOCK, max_running=1)
    b.add("a", prompt_tokens=10, max_tokens=10)
    b.add("b", prompt_tokens=10, max_tokens=10)
    b.admit()
    b.finish("a", CANCELLED)
    b.finish("b", CANCELLED)
    assert b.next_step() is None and b.drain() == (("a", CANCELLED),)
    assert b.admit() == ["b"] and b.finish_reason("b") == CANCELLED
    assert b.drain() == (("b", CANCELLED),) and b.free_tokens == 2 * BLOCK


def test_an_evicted_request_is_skipped_by_the_step_that_was_running():
    b = DecodeBatcher(capacity_tokens=8 * BLOCK, block_tokens=BLOCK)
    b.add("a", prompt_tokens=10, max_tokens=10)
    b.add("b", prompt_tokens=10, max_tokens=10)
    b.admit()
    step = b.next_step()
    assert b.evict("a") and not b.evict("a")
    out = b.finish_step(step)
    assert out.leaving == () and b.running == ("b",) and b.kv_len("b") == 11


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 500), st.integers(1, 200)), min_size=1, max_size=20),
    st.integers(4, 40),
    st.integers(1, 8),
    st.randoms(use_true_random=False),
)
def test_reservations_never_exceed_the_memory_admission_is_fifo_and_each_filled_block_is_reported_once(reqs, blocks, max_running, rnd):
    cap = blocks * BLOCK
    b = DecodeBatcher(capacity_tokens=cap, block_tokens=BLOCK, max_running=max_running)
    want = {}
    for i, (prompt, gen) in enumerate(reqs):
        try:
            b.add(f"r{i}", prompt_tokens=prompt, max_tokens=gen)
            want[f"r{i}"] = (prompt, gen)
        except KvCapacityError:
            assert b.footprint(prompt, gen) > cap
    filled: dict[str, list[int]] = {rid: [] for rid in want}
    left = {}
    admitted = []
    for _ in range(10_000):
        admitted += b.admit()
        assert b.reserved_tokens <= cap and len(b.running) <= max_running
        step = b.next_step()
        if step is None:
            left.update(b.drain())
            if not b.running and not b.waiting:
                break
            continue
        stop = {rid: "stop" for rid in step.decode if rnd.random() < 0.02}
        out = b.finish_step(step, stop)
        for rid, block in out.filled:
            filled[rid].append(block)
        left.update(out.leaving)
    assert admitted == list(want) and set(left) == set(want)  # FIFO admission, everyone leaves
    for rid, blocks_seen in filled.items():
        prompt, _ = want[rid]
        assert blocks_seen == list(range(prompt // BLOCK, len(blocks_seen) + prompt // BLOCK))  # each decoded block once, in order


@settings(max_examples=200, deadline=None)
@given(prompt=st.integers(1, 300), gen=st.integers(1, 200), block=st.sampled_from([1, 4, 16, 64]), stop=st.integers(0, 250))
def test_run_steps_accounts_steps_as_the_step_loop_does(prompt, gen, block, stop):
    """``run_steps`` (the simulator's settle of a request) leaves the same counts, filled
    blocks and finish as the per-step loop, after ``stop`` steps or all of ``steps_left``."""
    loop, bulk = DecodeBatcher(capacity_tokens=1 << 20, block_tokens=block), DecodeBatcher(capacity_tokens=1 << 20, block_tokens=block)
    for b in (loop, bulk):
        b.add("r", prompt_tokens=prompt, max_tokens=gen)
        b.admit()
    if gen == 1:  # its first token (from prefill) was its last: the engine says so
        loop.finish("r", "length")
    left = bulk.steps_left("r")
    steps = min(stop, left)
    filled, leaving = [], []
    for _ in range(steps):
        out = loop.finish_step(loop.next_step())
        filled += out.filled
        leaving += out.leaving
    if steps == 0:
        leaving += loop.drain()
    out = bulk.run_steps("r", steps)
    assert list(out.filled) == filled and list(out.leaving) == leaving
    assert ("r" in bulk) == ("r" in loop) == (steps < left)
    if steps < left:
        assert bulk.kv_len("r") == loop.kv_len("r") and bulk.finish_reason("r") == loop.finish_reason("r")
    else:  # all of steps_left: the loop has nothing more to run for it
        assert loop.next_step() is None and bulk.reserved_tokens == 0
