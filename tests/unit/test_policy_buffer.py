"""Decode nodes' DRAM buffers in the policy and the scheduler core: a decode node whose buffer
cannot take a request's slot ranks last (so a full buffer is no longer found by a refused
reservation while another node has room; when none has, a pass tries one request and stops),
and the core keeps the buffer figure by the same reports-and-charges rule as the others (see
``dualpath.core.scheduler``)."""

from __future__ import annotations

import pytest

from dualpath.core import (
    BUFFER_FULL,
    CoreConfig,
    DispatchAnswered,
    DispatchFailed,
    EngineReported,
    NodeReported,
    RequestSubmitted,
    ReserveSlot,
    SchedulerCore,
    SlotReserved,
    Stage,
    TimeAdvanced,
)
from dualpath.policy import ClusterState, NodeSpec, PendingRequest, Role, Thresholds, get_policy

BIG = 10**9
POLICIES = ("dualpath", "basic", "round_robin", "least_tokens")


def cluster() -> ClusterState:
    """Prefill node 0 (engine 0), decode nodes 1 (engines 1, 2) and 2 (engines 3, 4)."""
    return ClusterState(
        [
            NodeSpec(node_id=0, role=Role.PREFILL, engine_ids=(0,)),
            NodeSpec(node_id=1, role=Role.DECODE, engine_ids=(1, 2), hbm_tokens=1_000_000),
            NodeSpec(node_id=2, role=Role.DECODE, engine_ids=(3, 4), hbm_tokens=1_000_000),
        ]
    )


def req(rid: int, prompt: int = 320) -> PendingRequest:  # 320 tokens: a slot of 5 blocks of 64
    return PendingRequest(request_id=rid, prompt_tokens=prompt, hit_tokens=0, total_len=prompt + 16)


def policy(name: str):
    return get_policy(name, Thresholds(alpha_tokens=BIG, beta_tokens=BIG))


@pytest.mark.parametrize("name", POLICIES)
def test_a_decode_node_whose_buffer_cannot_take_the_slot_is_skipped_for_one_that_can(name):
    state = cluster()
    state.report_engine(3, seq=5, tok=5000)  # node 2 is the busier group: every rule prefers node 1
    state.report_engine(4, seq=5, tok=5000)
    state.report_buffer(1, free_blocks=4, total_blocks=100)  # 4 < 5 blocks
    state.report_buffer(2, free_blocks=5, total_blocks=100)
    [a] = policy(name).schedule([req(1)], state)
    assert state.engines[a.decode_engine].node_id == 2


@pytest.mark.parametrize("name", POLICIES)
def test_once_no_decode_buffer_has_room_a_pass_places_one_more_request_and_stops(name):
    state = cluster()
    state.report_buffer(1, free_blocks=7, total_blocks=100)
    state.report_buffer(2, free_blocks=12, total_blocks=100)
    placed = policy(name).schedule([req(1), req(2), req(3), req(4), req(5)], state)
    # slots of 5 blocks: one fits node 1, two fit node 2; the fourth is tried on a full node
    # (a report may lag a freed slot) and the fifth waits (FIFO)
    nodes = [state.engines[a.decode_engine].node_id for a in placed]
    assert len(placed) == 4 and nodes[:3].count(1) == 1 and nodes[:3].count(2) == 2


def test_an_empty_buffer_takes_a_slot_larger_than_itself_and_an_unreported_one_is_not_checked():
    state = cluster()
    state.report_buffer(1, free_blocks=3, total_blocks=3)  # empty, smaller than the slot
    state.report_buffer(2, free_blocks=0, total_blocks=100)
    [a] = policy("dualpath").schedule([req(1)], state)
    assert state.engines[a.decode_engine].node_id == 1  # alone rather than never
    state.report_buffer(1, free_blocks=2, total_blocks=3)
    assert len(policy("dualpath").schedule([req(2), req(3)], state)) == 1  # nowhere room: one try, then the pass stops
    state.report_buffer(2, free_blocks=0, total_blocks=-1)  # unknown (-1: the node does not report its buffer): no buffer limit is assumed
    placed = policy("dualpath").schedule([req(4), req(5)], state)
    assert [state.engines[a.decode_engine].node_id for a in placed] == [2, 2]


# -- the scheduler core ---------------------------------------------------------------------

BLOCK_BYTES = 1024  # so a 320-token prompt's slot is 5 blocks = 5120 bytes


class Core:
    """A core over prefill node P (p0) and decode nodes D1 (d0), D2 (d1)."""

    def __init__(self) -> None:
        self.core = SchedulerCore(policy("dualpath"), CoreConfig())
        self.now = 0.0
        for name, node, role in (("p0", "P", Role.PREFILL), ("d0", "D1", Role.DECODE), ("d1", "D2", Role.DECODE)):
            hbm = 100_000 if role is Role.DECODE else 0
            self.core.handle(
                EngineReported(
                    now=0.0,
                    engine=name,
                    node=node,
                    role=role,
                    seq=0,
                    tok=0,
                    free_hbm_tokens=hbm,
                    capacity_tokens=hbm,
                    block_bytes=BLOCK_BYTES,
                )
            )

    def node(self, node: str, free: int, total: int = 100 * BLOCK_BYTES):
        return self.core.handle(NodeReported(now=self.now, node=node, read_q_tokens=0, buffer_free_bytes=free, buffer_bytes=total))

    def submit(self, rid: str) -> ReserveSlot:
        self.core.handle(RequestSubmitted(now=self.now, request_id=rid, prompt_tokens=320, block_tokens=64, max_tokens=16))
        self.now += 0.001
        (reserve,) = self.core.handle(TimeAdvanced(now=self.now))
        assert isinstance(reserve, ReserveSlot) and reserve.blocks * reserve.block_bytes == 5 * BLOCK_BYTES
        return reserve

    def reserved(self, r: ReserveSlot):
        self.core.handle(SlotReserved(now=self.now, request_id=r.request_id, attempt=r.attempt))
        self.core.handle(DispatchAnswered(now=self.now, request_id=r.request_id, attempt=r.attempt))

    def free_blocks(self, node: str) -> int:
        st = self.core.state
        assert st is not None
        return st.nodes[self.core.members.nodes[node].num].buffer_free


def test_the_core_does_not_reserve_on_a_node_whose_reported_buffer_is_full():
    c = Core()
    c.node("D1", free=4 * BLOCK_BYTES)  # the less loaded group, but no room for 5 blocks
    c.node("D2", free=100 * BLOCK_BYTES)
    assert c.submit("r1").node == "D2"
    assert c.core.buffer_waits == 0


def test_each_placement_charges_its_slot_until_a_report_reflects_it():
    c = Core()
    c.node("D1", free=10 * BLOCK_BYTES)
    c.node("D2", free=10 * BLOCK_BYTES)
    r1 = c.submit("r1")
    assert c.free_blocks(r1.node) == 5  # charged at once
    c.node(r1.node, free=10 * BLOCK_BYTES)  # not acknowledged yet: the node cannot count it
    assert c.free_blocks(r1.node) == 5
    c.reserved(r1)
    c.node(r1.node, free=5 * BLOCK_BYTES)  # the node's own count is the truth from now on
    assert c.free_blocks(r1.node) == 5
    nodes = sorted(c.submit(rid).node for rid in ("r2", "r3", "r4"))
    assert nodes == ["D1", "D2", "D2"] and c.free_blocks("D1") == c.free_blocks("D2") == 0
    for rid in ("r5", "r6"):
        assert c.core.handle(RequestSubmitted(now=c.now, request_id=rid, prompt_tokens=320, block_tokens=64, max_tokens=16)) == []
    c.now += 0.001
    # both buffers full by the figures: one request is tried (a report may lag a freed slot), r6 waits
    assert [x.request_id for x in c.core.handle(TimeAdvanced(now=c.now))] == ["r5"]


def test_a_slot_charge_leaves_the_figure_when_its_request_goes_back_to_the_queue():
    c = Core()
    c.node("D1", free=5 * BLOCK_BYTES)
    c.node("D2", free=0)
    r1 = c.submit("r1")
    assert r1.node == "D1" and c.free_blocks("D1") == 0
    # The node refuses all the same (a race): the unreflected slot charge is taken off, the
    # request goes back, and the next pass after the back-off places it again on D1.
    cmds = c.core.handle(DispatchFailed(now=c.now, request_id="r1", attempt=0, stage=Stage.RESERVE, reason="buffer full", code=BUFFER_FULL))
    assert [type(x).__name__ for x in cmds] == ["FreeSlot", "Requeued"]
    assert c.free_blocks("D1") == 5
    c.now += 0.05
    (again,) = c.core.handle(TimeAdvanced(now=c.now))
    assert again.node == "D1" and again.attempt == 1


def test_a_finished_request_gives_back_an_unreflected_slot_but_not_one_a_report_already_counted():
    c = Core()
    c.node("D1", free=20 * BLOCK_BYTES)
    c.node("D2", free=0)
    r1 = c.submit("r1")
    c.reserved(r1)
    r2 = c.submit("r2")
    c.reserved(r2)
    assert c.free_blocks("D1") == 10
    c.node("D1", free=15 * BLOCK_BYTES)  # reflects both slots; the node freed one of them already
    assert c.free_blocks("D1") == 15
    r3 = c.submit("r3")
    c.reserved(r3)
    assert c.free_blocks("D1") == 10
    de = r3.decision.decode_engine
    for r in (r1, r2, r3):
        c.core.handle(EngineReported(now=c.now, engine="p0", node="P", role=Role.PREFILL, seq=0, tok=0, finished=(r.request_id,)))
    c.core.handle(
        EngineReported(
            now=c.now,
            engine=de,
            node="D1",
            role=Role.DECODE,
            seq=0,
            tok=0,
            free_hbm_tokens=100_000,
            capacity_tokens=100_000,
            finished=("r1", "r3"),
        )
    )
    assert c.free_blocks("D1") == 15  # r3's unreflected 5 blocks come back; r1's are left to the node's reports
