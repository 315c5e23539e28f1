"""The scheduler core's own answers to failovers and restarts (no shell, no bus): submissions
refused or resubmitted, attempt numbers as engines see them, engines that restarted under
their name, and engines or nodes lost outside any one request."""

from __future__ import annotations

from test_scheduler_core import Cluster, kinds

from dualpath.core import (
    ALL_ATTEMPTS,
    EngineLost,
    ExpelEngine,
    FreeSlot,
    NodeLost,
    RejectRequest,
    RequestSubmitted,
    ReserveSlot,
    SlotReserved,
    StopAttempts,
    TaskFailed,
    core_attempt,
    wire_attempt,
)
from dualpath.protocol.messages import SUBMISSION_ATTEMPTS


def _submit(c: Cluster, rid: str, submission: int):
    return c.handle(
        RequestSubmitted(
            now=c.now, request_id=rid, prompt_tokens=300, hit_blocks=2, block_tokens=64, payload={"id": rid}, submission=submission
        )
    )


def test_wire_attempts_offset_core_attempts_by_submission_and_map_back() -> None:
    assert wire_attempt(0, 3) == 3 and wire_attempt(2, 1) == 2 * SUBMISSION_ATTEMPTS + 1
    assert core_attempt(2, wire_attempt(2, 1)) == 1 and core_attempt(0, -1) == -1
    assert core_attempt(2, wire_attempt(1, 5)) == SUBMISSION_ATTEMPTS  # another submission's: past every attempt, late
    assert core_attempt(1, wire_attempt(2, 0)) == SUBMISSION_ATTEMPTS


def test_a_resubmission_stops_older_runs_first_and_its_commands_carry_wire_attempts() -> None:
    c = Cluster()
    (stop,) = _submit(c, "r1", submission=2)
    assert stop == StopAttempts(request_id="r1", before=wire_attempt(2, 0), reason="resubmitted after a scheduler failover")
    (reserve,) = c.tick()
    assert isinstance(reserve, ReserveSlot) and (reserve.attempt, reserve.wire_attempt) == (0, wire_attempt(2, 0))
    (dispatch,) = c.handle(SlotReserved(now=c.now, request_id="r1", attempt=0, region={}, offset=0))
    assert dispatch.wire_attempt == wire_attempt(2, 0)
    # A prefill failure reported in wire numbers is the current attempt's: retried as attempt 1,
    # whose slot-free and stop name wire numbers too.
    cmds = c.handle(TaskFailed(now=c.now, request_id="r1", engine=dispatch.prefill_engine, reason="boom", attempt=wire_attempt(2, 0)))
    assert kinds(cmds) == ["FreeSlot", "Requeued", "StopAttempts"]
    assert cmds[0] == FreeSlot(node=dispatch.decode_node, request_id="r1", wire_before=wire_attempt(2, 1))
    assert cmds[2].before == wire_attempt(2, 1)
    # A failure of the same core attempt of another submission is late: nothing happens.
    (reserve,) = c.tick()
    (dispatch,) = c.handle(SlotReserved(now=c.now, request_id="r1", attempt=1, region={}, offset=0))
    assert c.handle(TaskFailed(now=c.now, request_id="r1", engine=dispatch.prefill_engine, reason="old", attempt=wire_attempt(1, 1))) == []
    assert c.core.is_current("r1", 1)


def test_a_submission_no_newer_than_one_run_here_is_refused_as_a_late_copy() -> None:
    c = Cluster()
    _submit(c, "r1", submission=1)
    (reserve,) = c.tick()
    (dispatch,) = c.handle(SlotReserved(now=c.now, request_id="r1", attempt=0, region={}, offset=0))
    c.report(dispatch.prefill_engine, finished=("r1",), attempts=(wire_attempt(1, 0),))
    c.report(dispatch.decode_engine, finished=("r1",), attempts=(wire_attempt(1, 0),))
    assert "r1" not in c.core.requests  # finished: wire attempts of the report were mapped back
    for late in (0, 1):
        (reject,) = _submit(c, "r1", submission=late)
        assert isinstance(reject, RejectRequest) and reject.code == 409 and f"submission {late} already run here" in reject.reason
    assert kinds(_submit(c, "r1", submission=2)) == ["StopAttempts"]  # a newer one runs
    (reject,) = _submit(c, "r1", submission=3)  # while that one is held: a duplicate
    assert reject.code == 409 and "already submitted" in reject.reason


def test_an_engine_reporting_a_new_incarnation_is_expelled_first_and_its_requests_retried() -> None:
    c = Cluster()
    for name in c.engines:
        c.report(name, incarnation="a")
    d = c.place("r1")
    cmds = c.report(d.prefill_engine, incarnation="b")
    expel = cmds[0]
    assert expel == ExpelEngine(engine=d.prefill_engine, reason="restarted (incarnation a -> b)", incarnation="a")
    assert "Requeued" in kinds(cmds) and not c.core.is_current("r1", 0)
    assert c.core.members.engines[d.prefill_engine].incarnation == "b"  # joined again as the new process
    assert c.report(d.prefill_engine, incarnation="b") == []  # the same process again: nothing
    assert c.report(d.prefill_engine, incarnation="") == []  # a report that names none changes nothing


def test_lost_engines_and_nodes_are_events_of_their_own() -> None:
    c = Cluster()
    d = c.place("r1")
    cmds = c.handle(EngineLost(now=c.now, engine=d.decode_engine, reason="its process exited"))
    assert cmds[0] == ExpelEngine(engine=d.decode_engine, reason="its process exited")
    assert kinds(cmds)[1:] == ["FreeSlot", "Requeued", "StopAttempts"]
    assert d.decode_engine not in c.core.members.engines
    assert c.handle(NodeLost(now=c.now, node="D2", reason="traffic manager gone")) == []
    assert c.core.members.nodes["D2"].down
    for _ in range(3):  # while D2 is down the retry is placed on D1 only
        placed = [x for x in c.tick() if isinstance(x, ReserveSlot)]
        if placed:
            assert placed[0].node == "D1"
            break


def test_a_task_failure_naming_a_dead_node_takes_the_node_out_before_the_retry() -> None:
    c = Cluster()
    d = c.place("r1")
    cmds = c.handle(TaskFailed(now=c.now, request_id="r1", engine=d.prefill_engine, reason="tm gone", node_unreachable=d.decode_node))
    assert c.core.members.nodes[d.decode_node].down and "Requeued" in kinds(cmds)
    (reserve,) = [x for x in c.tick() if isinstance(x, ReserveSlot)]
    assert reserve.node != d.decode_node


def test_a_late_reservation_of_a_request_gone_frees_every_slot_of_it() -> None:
    c = Cluster(max_attempts=1)
    c.submit("r1")
    (reserve,) = c.tick()  # its reservation is in flight when its prefill engine is lost
    cmds = c.handle(EngineLost(now=c.now, engine=reserve.decision.prefill_engine, reason="gone"))
    assert kinds(cmds) == ["ExpelEngine", "FreeSlot", "FailRequest"] and "r1" not in c.core.requests
    assert cmds[1] == FreeSlot(node=reserve.node, request_id="r1", wire_before=ALL_ATTEMPTS)  # failed for good: every slot
    late = c.handle(SlotReserved(now=c.now, request_id="r1", attempt=0, region={}, offset=0))
    assert late == [FreeSlot(node=reserve.node, request_id="r1", wire_before=ALL_ATTEMPTS)]
