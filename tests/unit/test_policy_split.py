"""Split reads (``read_path=split``): a request's hit blocks divided between the PE's and the
DE's storage NICs so that both reads end together; pure rule, policy and scheduler core."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualpath.core import NodeReported
from dualpath.policy import ClusterState, NodeSpec, PendingRequest, ReadSide, Role, Thresholds, get_policy
from dualpath.policy.split import split_blocks, worth_splitting
from tests.unit.test_scheduler_core import Cluster

BIG = 10**9


def _finish(q_pe: int, q_de: int, blocks: int, b: int, bt: int, hop: int) -> int:
    return max(100 * (q_pe + b * bt), 100 * q_de + (100 + hop) * (blocks - b) * bt)


def test_idle_queues_split_a_long_context_in_half_without_hop_cost():
    assert split_blocks(1024, 64, 0, 0, hop_percent=0) == 512


def test_the_de_share_shrinks_by_the_cnic_hop_cost():
    # 100·b = 110·(1024 − b)  ->  b = 536.4: block 536 or 537, the later finish is lower at 536.
    b = split_blocks(1024, 64, 0, 0, hop_percent=10)
    assert b in (536, 537)
    assert _finish(0, 0, 1024, b, 64, 10) <= min(_finish(0, 0, 1024, x, 64, 10) for x in (535, 536, 537, 538))


def test_a_long_queue_on_one_side_sends_every_block_to_the_other():
    assert split_blocks(10, 64, q_pe=100_000, q_de=0) == 0
    assert split_blocks(10, 64, q_pe=0, q_de=100_000) == 10


def test_queues_already_unequal_are_evened_out_first():
    # q_de is 640 tokens (10 blocks) longer: of 30 blocks the PE reads 20, the DE 10 (hop 0).
    assert split_blocks(30, 64, q_pe=0, q_de=640, hop_percent=0) == 20


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        split_blocks(-1, 64, 0, 0)
    with pytest.raises(ValueError):
        split_blocks(1, 0, 0, 0)


@given(st.integers(0, 2000), st.sampled_from([16, 64]), st.integers(0, 200_000), st.integers(0, 200_000), st.integers(0, 50))
def test_the_split_is_the_best_whole_block_choice(blocks, bt, q_pe, q_de, hop):
    """Never later than any other division, in particular than reading everything on one side."""
    b = split_blocks(blocks, bt, q_pe, q_de, hop)
    assert 0 <= b <= blocks
    best = min(_finish(q_pe, q_de, blocks, x, bt, hop) for x in range(blocks + 1))
    assert _finish(q_pe, q_de, blocks, b, bt, hop) == best


def _one_pair() -> ClusterState:
    return ClusterState(
        [
            NodeSpec(node_id=0, role=Role.PREFILL, engine_ids=(0,)),
            NodeSpec(node_id=1, role=Role.DECODE, engine_ids=(1,), hbm_tokens=1_000_000),
        ]
    )


def test_split_policy_divides_the_hits_of_a_request_with_nothing_queued_behind_it():
    state = _one_pair()
    policy = get_policy("dualpath", Thresholds(alpha_tokens=BIG, beta_tokens=BIG), read_path="split")

    def req(i: int) -> PendingRequest:
        return PendingRequest(request_id=i, prompt_tokens=64 * 100 + 10, hit_tokens=64 * 100, total_len=64 * 101)

    [a] = policy.schedule([req(0)], state)
    assert a.read_side is ReadSide.PE and 0 < a.de_split_tokens < a.read_tokens
    assert a.read_split == (a.read_tokens - a.de_split_tokens, a.de_split_tokens)
    assert (a.read_tokens - a.de_split_tokens) % 64 == 0
    # Two in one pass: the first has a request behind it and reads whole (the classic side);
    # the second then finds the PE queue as long as its own read and reads whole on the DE side.
    # With read admission the queues stay short while requests wait in the scheduler's queue,
    # so the queues alone would split both (the testbed measured +4% to +10% JCT for that).
    first, second = policy.schedule([req(1), req(2)], state)
    assert (first.read_side, first.de_split_tokens) == (ReadSide.PE, 0)
    assert (second.read_side, second.de_split_tokens) == (ReadSide.DE, 0)


def test_a_forced_side_is_never_split():
    state = _one_pair()
    policy = get_policy("dualpath", Thresholds(alpha_tokens=BIG, beta_tokens=BIG), read_path="split")
    r = PendingRequest(request_id=0, prompt_tokens=6410, hit_tokens=6400, total_len=6500, forced_side=ReadSide.DE)
    [a] = policy.schedule([r], state)
    assert a.read_side is ReadSide.DE and a.de_split_tokens == 0 and a.read_split == (0, 6400)


def test_core_charges_each_node_its_share_and_records_the_split_in_blocks():
    c = Cluster(read_path="split")
    c.handle(NodeReported(now=c.now, node="P", read_q_tokens=0))
    d = c.place("r1", prompt=64 * 40 + 5, hit_blocks=40)
    pe_blocks, de_blocks = d.decision.read_split
    assert pe_blocks + de_blocks == 40 and pe_blocks > 0 and de_blocks > 0
    assert d.read_side is ReadSide.PE
    assert c.read_q("P") == 64 * pe_blocks
    assert c.read_q(d.decode_node) == 64 * de_blocks
    # The prefill engine finishing releases both read charges.
    c.report(d.prefill_engine, finished=("r1",))
    assert c.read_q("P") == 0 and c.read_q(d.decode_node) == 0


def test_core_without_split_records_no_split():
    c = Cluster(read_path="auto")
    d = c.place("r1", prompt=64 * 40 + 5, hit_blocks=40)
    assert d.decision.read_split is None


def test_only_a_request_longer_than_both_queues_with_nothing_behind_it_is_split():
    assert worth_splitting(6400, 0, 6399)
    assert not worth_splitting(6400, 6400, 0)
    assert not worth_splitting(0, 0, 0)
    assert not worth_splitting(6400, 0, 0, behind=1)
    state = _one_pair()
    state.report_node(1, read_q=100_000)  # a long DE queue: the request goes whole to the PE side
    policy = get_policy("dualpath", Thresholds(alpha_tokens=BIG, beta_tokens=BIG), read_path="split")
    [a] = policy.schedule([PendingRequest(request_id=0, prompt_tokens=6410, hit_tokens=6400, total_len=6500)], state)
    assert a.read_side is ReadSide.PE and a.de_split_tokens == 0
