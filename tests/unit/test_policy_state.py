"""Cluster state: topology, applying decisions and completions, reports, and the errors a
caller gets for impossible inputs."""

from __future__ import annotations

import pytest

from dualpath.policy import Assignment, ClusterState, NodeSpec, PendingRequest, ReadSide, Role
from dualpath.policy.errors import (
    DuplicateRequestError,
    InsufficientHbmError,
    InvalidRequestError,
    InvalidTopologyError,
    RoleMismatchError,
    UnknownEngineError,
    UnknownNodeError,
    UnknownRequestError,
)


def small() -> ClusterState:
    # node 0: PEs 0, 1; node 1: DEs 2, 3 with 1000 tokens of HBM each
    return ClusterState.from_topology(prefill_nodes=1, decode_nodes=1, gpus_per_node=2, decode_hbm_tokens=1000)


def assignment(rid: int = 1, pe: int = 0, de: int = 2, side: ReadSide = ReadSide.DE, **charges) -> Assignment:
    values = {"prefill_tokens": 100, "decode_tokens": 400, "read_tokens": 256} | charges
    return Assignment(
        request_id=rid, prefill_engine=pe, decode_engine=de, read_side=side, read_node=0 if side is ReadSide.PE else 1, **values
    )


def test_from_topology_numbers_nodes_and_engines_densely_with_leaders():
    state = ClusterState.from_topology(prefill_nodes=2, decode_nodes=4, decode_hbm_tokens=10)
    assert [n.node_id for n in state.prefill_nodes] == [0, 1]
    assert [n.leader for n in state.decode_nodes] == [16, 24, 32, 40]
    assert len(state.prefill_engines) == 16 and len(state.decode_engines) == 32
    assert all(e.free_hbm_tokens == 10 for e in state.decode_engines)


def test_assignment_charges_engines_hbm_and_the_read_queue():
    state = small()
    state.on_assigned(assignment())
    pe, de = state.engines[0], state.engines[2]
    assert (pe.seq, pe.tok) == (1, 100)
    assert (de.seq, de.tok, de.free_hbm_tokens) == (1, 400, 600)
    assert state.nodes[1].read_q == 256 and state.nodes[0].read_q == 0
    assert state.nodes[1].tok_sum == 400 and state.assigned_total == 1


def test_completions_release_each_charge_once():
    state = small()
    state.on_assigned(assignment())
    state.on_read_finished(1)
    state.on_read_finished(1)  # idempotent
    assert state.nodes[1].read_q == 0
    state.on_prefill_finished(1)
    assert (state.engines[0].seq, state.engines[0].tok) == (0, 0)
    assert state.engines[2].tok == 400  # still decoding
    state.on_finished(1)
    de = state.engines[2]
    assert (de.seq, de.tok, de.free_hbm_tokens, state.nodes[1].tok_sum) == (0, 0, 1000, 0)
    assert state.live_count == 0


def test_finishing_an_aborted_request_releases_read_prefill_and_decode():
    state = small()
    state.on_assigned(assignment())
    state.on_finished(1)
    assert state.nodes[1].read_q == 0 and state.engines[0].tok == 0 and state.engines[2].free_hbm_tokens == 1000


def test_reports_overwrite_counters_and_later_completions_clamp_at_zero():
    state = small()
    state.on_assigned(assignment())
    state.report_engine(0, seq=0, tok=0)  # the leader already counted the prefill as done
    state.report_node(1, read_q=0)
    state.on_finished(1)
    assert (state.engines[0].seq, state.engines[0].tok, state.nodes[1].read_q) == (0, 0, 0)
    state.report_engine(2, seq=0, tok=0, free_hbm_tokens=5000)  # clamped to capacity
    assert state.engines[2].free_hbm_tokens == 1000


def test_applying_the_same_request_twice_is_refused():
    state = small()
    state.on_assigned(assignment())
    with pytest.raises(DuplicateRequestError):
        state.on_assigned(assignment())


def test_a_stale_decision_without_hbm_room_is_refused_and_changes_nothing():
    state = small()
    with pytest.raises(InsufficientHbmError):
        state.on_assigned(assignment(decode_tokens=1001))
    assert state.engines[0].tok == 0 and state.live_count == 0


def test_roles_and_ids_are_checked():
    state = small()
    with pytest.raises(RoleMismatchError):
        state.on_assigned(assignment(pe=2, de=3))
    with pytest.raises(RoleMismatchError):
        state.on_assigned(assignment(pe=0, de=1))
    with pytest.raises(UnknownEngineError):
        state.on_assigned(assignment(de=99))
    with pytest.raises(UnknownRequestError):
        state.on_finished(42)
    with pytest.raises(UnknownEngineError):
        state.report_engine(99, seq=0, tok=0)
    with pytest.raises(UnknownNodeError):
        state.report_node(7, read_q=1)


def test_inconsistent_topologies_are_refused():
    pe = NodeSpec(node_id=0, role=Role.PREFILL, engine_ids=(0,))
    with pytest.raises(InvalidTopologyError):
        ClusterState([pe])  # no decode node
    with pytest.raises(InvalidTopologyError):
        ClusterState([pe, NodeSpec(node_id=1, role=Role.DECODE, engine_ids=(0,), hbm_tokens=5)])  # engine 0 twice
    with pytest.raises(InvalidTopologyError):
        NodeSpec(node_id=1, role=Role.DECODE, engine_ids=(), hbm_tokens=5)
    with pytest.raises(InvalidTopologyError):
        NodeSpec(node_id=1, role=Role.DECODE, engine_ids=(1,))  # a decode node needs HBM


@pytest.mark.parametrize(("prompt", "hit", "total"), [(10, 10, 20), (10, -1, 20), (10, 0, 9), (0, 0, 0)])
def test_impossible_requests_are_refused(prompt, hit, total):
    with pytest.raises(InvalidRequestError):
        PendingRequest(request_id=1, prompt_tokens=prompt, hit_tokens=hit, total_len=total)
