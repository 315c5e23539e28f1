"""The scheduler core without a bus: event sequences in, commands out."""

from __future__ import annotations

import pytest

from dualpath.core import (
    BUFFER_FULL,
    CoreConfig,
    Dispatch,
    DispatchAnswered,
    DispatchFailed,
    EngineReported,
    ExpelEngine,
    FailRequest,
    FreeSlot,
    NodeReported,
    RejectRequest,
    RequestFinished,
    RequestSubmitted,
    Requeued,
    ReserveSlot,
    SchedulerCore,
    SlotReserved,
    Stage,
    StopAttempts,
    TaskFailed,
    TimeAdvanced,
)
from dualpath.policy import Thresholds, get_policy
from dualpath.policy.values import ReadSide, Role

HBM = 10_000


class Cluster:
    """A core over prefill node P (p0, p1) and decode nodes D1 (d0, d1), D2 (d2, d3), and a clock."""

    def __init__(self, policy: str = "dualpath", read_path: str = "auto", **cfg) -> None:
        th = Thresholds(alpha_tokens=1 << 22, beta_tokens=1 << 22)
        self.core = SchedulerCore(get_policy(policy, th, read_path=read_path), CoreConfig(**cfg))
        self.now = 0.0
        self.engines = {
            "p0": ("P", Role.PREFILL),
            "p1": ("P", Role.PREFILL),
            "d0": ("D1", Role.DECODE),
            "d1": ("D1", Role.DECODE),
            "d2": ("D2", Role.DECODE),
            "d3": ("D2", Role.DECODE),
        }
        for name in self.engines:
            self.report(name)

    def handle(self, event):
        return self.core.handle(event)

    def report(
        self,
        engine: str,
        seq: int = 0,
        tok: int = 0,
        free: int = HBM,
        finished: tuple[str, ...] = (),
        attempts: tuple[int, ...] = (),
        holding: tuple[str, ...] | None = None,
        holding_attempts: tuple[int, ...] = (),
        incarnation: str = "",
    ):
        node, role = self.engines[engine]
        decode = role == Role.DECODE
        return self.handle(
            EngineReported(
                now=self.now,
                engine=engine,
                node=node,
                role=role,
                seq=seq,
                tok=tok,
                free_hbm_tokens=free if decode else 0,
                capacity_tokens=HBM if decode else 0,
                block_bytes=1024,
                finished=finished,
                finished_attempts=attempts,
                holding=holding,
                holding_attempts=holding_attempts,
                incarnation=incarnation,
            )
        )

    def node_report(self, node: str, read_q: int):
        return self.handle(NodeReported(now=self.now, node=node, read_q_tokens=read_q))

    def submit(
        self, rid: str, prompt: int = 300, hit_blocks: int = 2, max_tokens: int = 16, forced: ReadSide | None = None, session: str = ""
    ):
        return self.handle(
            RequestSubmitted(
                now=self.now,
                request_id=rid,
                prompt_tokens=prompt,
                hit_blocks=hit_blocks,
                block_tokens=64,
                max_tokens=max_tokens,
                forced_side=forced,
                payload={"id": rid},
                session=session,
            )
        )

    def tick(self, dt: float = 0.001):
        self.now += dt
        return self.handle(TimeAdvanced(now=self.now))

    def place_retry(self, rid: str) -> Dispatch:
        """Place a re-queued request again (pass, reservation, dispatch answered)."""
        (reserve,) = [x for x in self.tick() if isinstance(x, ReserveSlot) and x.request_id == rid]
        (dispatch,) = self.handle(SlotReserved(now=self.now, request_id=rid, attempt=reserve.attempt, region={"r": 1}, offset=0))
        assert self.handle(DispatchAnswered(now=self.now, request_id=rid, attempt=reserve.attempt)) == []
        return dispatch

    def place(self, rid: str, **submit) -> Dispatch:
        """Submit, pass, answer the reservation and the dispatch: the request runs."""
        assert self.submit(rid, **submit) == []
        (reserve,) = self.tick()
        (dispatch,) = self.handle(SlotReserved(now=self.now, request_id=rid, attempt=reserve.attempt, region={"r": 1}, offset=0))
        assert self.handle(DispatchAnswered(now=self.now, request_id=rid, attempt=reserve.attempt)) == []
        return dispatch

    def engine(self, name: str):
        return self.core.state.engines[self.core.members.engines[name].num]

    def read_q(self, node: str) -> int:
        return self.core.state.nodes[self.core.members.nodes[node].num].read_q


def kinds(cmds) -> list[str]:
    return [type(c).__name__ for c in cmds]


def test_a_request_is_reserved_on_its_decode_node_then_dispatched_to_its_prefill_engine():
    c = Cluster()
    assert c.submit("r1") == []
    (reserve,) = c.tick()
    assert isinstance(reserve, ReserveSlot)
    assert reserve.attempt == 0 and reserve.blocks == 5 and reserve.block_bytes == 1024 and reserve.payload == {"id": "r1"}
    assert reserve.node == c.engines[reserve.decision.decode_engine][0]
    (dispatch,) = c.handle(SlotReserved(now=c.now, request_id="r1", attempt=0, region={"r": 1}, offset=4096))
    assert isinstance(dispatch, Dispatch)
    assert (dispatch.region, dispatch.offset, dispatch.decode_node) == ({"r": 1}, 4096, reserve.node)
    assert dispatch.prefill_node == "P" and dispatch.read_side is ReadSide.PE  # equal queues: the PE side
    assert c.core.queued == 0 and c.core.running == 1


def test_submissions_that_cannot_be_served_are_refused_with_their_code_and_nothing_is_queued():
    c = Cluster(max_queue=2)
    assert c.submit("a") == [] and c.submit("b") == []
    (full,) = c.submit("c")
    assert isinstance(full, RejectRequest) and full.code == 429 and "queue full" in full.reason
    c.tick()
    c.tick()
    (dup,) = c.submit("a")
    assert dup.code == 409
    (empty,) = c.submit("e", prompt=0, hit_blocks=0)
    assert empty.code == 400 and empty.reason == "empty prompt"
    (big,) = c.submit("big", prompt=HBM, max_tokens=1)
    assert big.code == 400 and "KV capacity" in big.reason
    assert c.core.queued == 0 and set(c.core.requests) == {"a", "b"}


def _silence(c: Cluster, quiet: set[str], seconds: float = 1.5) -> list:
    """Let time pass while every engine but ``quiet`` reports; then tick."""
    for _ in range(int(seconds / 0.5)):
        c.now += 0.5
        for name in c.engines:
            if name not in quiet:
                c.report(name)
    return c.tick()


def test_an_engine_that_dies_mid_dispatch_loses_its_request_to_the_head_of_the_queue():
    c = Cluster(engine_timeout=1.0)
    first = c.place("r1")
    c.submit("r2")  # queued behind nothing: placed in the same pass as r1's retry
    cmds = _silence(c, {first.prefill_engine})
    assert kinds(cmds)[:3] == ["ExpelEngine", "FreeSlot", "Requeued"]
    assert cmds[0] == ExpelEngine(engine=first.prefill_engine, reason="stopped reporting")
    assert cmds[1] == FreeSlot(node=first.decode_node, request_id="r1", wire_before=1)  # the slots of attempts below 1
    assert cmds[3] == StopAttempts(request_id="r1", before=1, reason=f"retried: {cmds[2].reason}")
    assert cmds[2].attempt == 1 and cmds[2].counted and f"engine {first.prefill_engine} stopped reporting" in cmds[2].reason
    retries = [x for x in cmds if isinstance(x, ReserveSlot)]
    assert [x.request_id for x in retries] == ["r1", "r2"]  # FIFO: the retry goes first
    assert all(x.decision.prefill_engine != first.prefill_engine for x in retries)
    # The dead engine's late answer for attempt 0 changes nothing.
    assert c.handle(DispatchAnswered(now=c.now, request_id="r1", attempt=0)) == []
    assert c.core.is_current("r1", 1) and not c.core.is_current("r1", 0)


@pytest.mark.parametrize("lost", ["prefill engine", "decode node"])
def test_a_late_slot_of_an_old_attempt_is_freed_and_only_that_attempt_s(lost):
    c = Cluster(engine_timeout=1.0)
    c.submit("r1")
    (first,) = c.tick()  # its reservation is still in flight when the engine is lost
    quiet = {first.decision.prefill_engine} if lost == "prefill engine" else {n for n, e in c.engines.items() if e[0] == first.node}
    cmds = _silence(c, quiet)
    (second,) = [x for x in cmds if isinstance(x, ReserveSlot)]
    assert second.attempt == 1
    late = c.handle(SlotReserved(now=c.now, request_id="r1", attempt=0, region={}, offset=0))
    # a slot per attempt: attempt 1's, on the same node or not, is not the late one
    assert (second.node == first.node) == (lost == "prefill engine")
    assert late == [FreeSlot(node=first.node, request_id="r1", wire_attempt=0)]
    assert c.handle(SlotReserved(now=c.now, request_id="r1", attempt=0, region={}, offset=0)) == []  # answered once only


def test_duplicate_and_late_messages_change_nothing():
    c = Cluster()
    d = c.place("r1")
    before = (c.engine(d.prefill_engine).tok, c.engine(d.decode_engine).tok)
    assert c.handle(DispatchAnswered(now=c.now, request_id="r1", attempt=0)) == []  # duplicate answer
    assert c.handle(SlotReserved(now=c.now, request_id="r1", attempt=0, region={}, offset=0)) == []  # duplicate slot, same node
    other = "p1" if d.prefill_engine == "p0" else "p0"
    assert c.handle(TaskFailed(now=c.now, request_id="r1", engine=other, reason="not mine")) == []  # not its engine
    assert c.handle(TaskFailed(now=c.now, request_id="nobody", engine="p0", reason="late")) == []
    assert c.handle(RequestFinished(now=c.now, request_id="nobody", engine="p0")) == []
    assert (c.engine(d.prefill_engine).tok, c.engine(d.decode_engine).tok) == before
    c.report(d.prefill_engine, finished=("r1",))
    c.report(d.prefill_engine, finished=("r1",))  # the same finish twice
    c.report(d.decode_engine, seq=1, tok=316, free=HBM - 316, finished=())
    c.report(d.decode_engine, finished=("r1",))
    c.report(d.decode_engine, finished=("r1",))
    assert c.core.requests == {} and c.core.running == 0
    assert c.engine(d.decode_engine).tok == 0 and c.engine(d.decode_engine).free_hbm_tokens == HBM


def test_a_full_decode_buffer_is_back_pressure_not_a_failure():
    c = Cluster(max_attempts=1, buffer_wait_s=1.0)
    c.submit("r1")
    (reserve,) = c.tick()
    cmds = c.handle(DispatchFailed(now=c.now, request_id="r1", attempt=0, stage=Stage.RESERVE, reason="buffer full", code=BUFFER_FULL))
    assert cmds == [
        FreeSlot(node=reserve.node, request_id="r1", wire_before=1),
        Requeued(request_id="r1", attempt=1, reason="decode node buffer full", counted=False),  # no StopAttempts: nothing ran
    ]
    assert c.core.buffer_waits == 1
    assert c.tick(0.005) == []  # passes pause for the back-off
    (again,) = c.tick(0.02)
    assert again.attempt == 1
    # Past buffer_wait_s the wait counts as a failure, and max_attempts=1 ends it.
    c.now += 2.0
    cmds = c.handle(DispatchFailed(now=c.now, request_id="r1", attempt=1, stage=Stage.RESERVE, reason="buffer full", code=BUFFER_FULL))
    assert kinds(cmds) == ["FreeSlot", "FailRequest"]
    assert cmds[1].code == 503 and cmds[1].payload == {"id": "r1"}
    assert c.core.requests == {} and c.core.buffer_waits == 1


def test_retries_exhausted_fail_the_request_with_the_last_reason():
    c = Cluster(max_attempts=2)
    c.submit("r1")
    c.tick()
    assert kinds(c.handle(DispatchFailed(now=c.now, request_id="r1", attempt=0, stage=Stage.RESERVE, reason="nope"))) == [
        "FreeSlot",
        "Requeued",
        "StopAttempts",
    ]
    c.tick()
    c.handle(SlotReserved(now=c.now, request_id="r1", attempt=1, region={}, offset=0))
    cmds = c.handle(DispatchFailed(now=c.now, request_id="r1", attempt=1, stage=Stage.DISPATCH, reason="engine said no", code=500))
    fail = cmds[-1]
    assert isinstance(fail, FailRequest)
    assert (fail.code, fail.attempts) == (503, 2)
    assert fail.reason == "request failed after 2 attempts: dispatch failed: engine said no"
    assert c.core.requests == {} and c.core.queued == 0


def test_an_unreachable_prefill_engine_is_expelled_until_it_reports_again():
    c = Cluster()
    d = c.place("r1")
    c.submit("r2")
    (r2,) = c.tick()
    cmds = c.handle(TaskFailed(now=c.now, request_id="r1", engine=d.prefill_engine, reason="handoff failed", unreachable=d.decode_engine))
    assert ExpelEngine(engine=d.decode_engine, reason=f"engine {d.decode_engine} did not answer") in cmds
    assert d.decode_engine not in c.core.members.engines
    requeued = {x.request_id for x in cmds if isinstance(x, Requeued)}
    assert "r1" in requeued and ("r2" in requeued) == (r2.decision.decode_engine == d.decode_engine)
    placed = [x for x in c.tick() if isinstance(x, ReserveSlot)]
    assert placed and all(x.decision.decode_engine != d.decode_engine for x in placed)
    c.report(d.decode_engine)  # it comes back
    assert d.decode_engine in c.core.members.engines and c.core.state is not None
    assert c.core.members.engines[d.decode_engine].num in c.core.state.engines


def test_a_late_failure_of_an_earlier_attempt_on_the_same_engine_changes_nothing():
    """The race of a decode engine killed mid-flight: a prefill engine's hand-offs to it fail
    one by one; the first failure expels the engine and re-queues all of them, and a retry can
    be placed on the same prefill engine before that engine's failures of the old attempts
    arrive. Those name their attempt, so the current one is neither retried nor counted."""
    c = Cluster()
    d = c.place("r1")
    c.handle(TaskFailed(now=c.now, request_id="r1", engine=d.prefill_engine, reason="handoff failed", unreachable=d.decode_engine))
    again = c.place_retry("r1")
    assert again.attempt == 1
    assert c.handle(TaskFailed(now=c.now, request_id="r1", engine=again.prefill_engine, reason="handoff failed", attempt=0)) == []
    assert c.core.requests["r1"].attempt == 1 and c.core.running == 1
    # the current attempt's own failure is a failure
    cmds = c.handle(TaskFailed(now=c.now, request_id="r1", engine=again.prefill_engine, reason="boom", attempt=1))
    assert [x.attempt for x in cmds if isinstance(x, Requeued)] == [2]


def test_a_finish_of_an_earlier_attempt_on_the_engine_that_holds_the_retry_changes_nothing():
    """Reports name the attempt of each finished request: an old attempt that hands off on the
    prefill engine where its retry was placed (its cancel not there yet) does not pass for the
    retry's prefill, nor an old decode for the retry's."""
    c = Cluster()
    d = c.place("r1")
    c.handle(TaskFailed(now=c.now, request_id="r1", engine=d.prefill_engine, reason="dispatch timed out"))
    again = c.place_retry("r1")
    assert again.prefill_engine == d.prefill_engine and again.attempt == 1
    c.report(d.prefill_engine, finished=("r1",), attempts=(0,))
    t = c.core.requests["r1"]
    assert not t.prefill_done and t.attempt == 1
    c.report(again.decode_engine, finished=("r1",), attempts=(0,))
    assert "r1" in c.core.requests
    c.report(d.prefill_engine, finished=("r1",), attempts=(1,))
    assert c.core.requests["r1"].prefill_done
    c.report(again.decode_engine, finished=("r1",), attempts=(1,))
    assert "r1" not in c.core.requests
    # a report that names no attempts (an engine that does not send them) counts for any attempt
    c.place("r2")
    c.report(c.core.requests["r2"].pe.name, finished=("r2",))
    assert c.core.requests["r2"].prefill_done


def test_a_prefill_its_engine_stops_listing_is_retried_once_two_reports_and_the_engine_timeout_passed():
    """A prefill engine that drops a task tells the scheduler with a fire-and-forget
    TaskFailed; when that message is lost, the engine's reports (which list what it holds)
    stop naming the task, and the core retries it instead of waiting for it forever."""
    c = Cluster()
    c.report("p0", holding=())  # its reports list what it holds from now on
    c.report("p1", holding=())
    d = c.place("r1")
    pe = d.prefill_engine
    assert c.report(pe, seq=1, holding=("r1",), holding_attempts=(0,)) == []
    c.now += 0.2
    assert c.report(pe, holding=()) == []  # one report without it: may predate the dispatch
    c.now += 0.2
    assert c.report(pe, holding=()) == []  # two, but within the engine timeout of the answer
    assert c.core.requests["r1"].stage == 3 and c.core.requests["r1"].attempt == 0
    c.now += 3.0
    cmds = c.report(pe, holding=())
    requeued = [x for x in cmds if isinstance(x, Requeued)]
    assert [(x.request_id, x.attempt) for x in requeued] == [("r1", 1)] and "no longer holds it" in requeued[0].reason
    assert [x.node for x in cmds if isinstance(x, FreeSlot)] == [d.decode_node]
    assert c.report(pe, holding=()) == []  # once: the retry is queued, not placed on that engine


def test_a_prefill_its_engine_still_lists_or_that_was_never_listed_is_left_running():
    c = Cluster()
    c.report("p0", holding=())
    c.report("p1", holding=())
    d = c.place("r1")
    pe = d.prefill_engine
    for _ in range(3):  # a miss, then listed again (a successor waiting for its predecessor counts)
        c.now += 2.0
        assert c.report(pe, holding=()) == []
        c.now += 2.0
        assert c.report(pe, holding=("r1", "r1"), holding_attempts=(-1, 0)) == []
    # listed under an earlier attempt only: the engine does not hold this one
    c.now += 4.0
    c.report(pe, holding=("r1",), holding_attempts=(7,))
    cmds = c.report(pe, holding=("r1",), holding_attempts=(7,))
    assert [(x.request_id, x.attempt) for x in cmds if isinstance(x, Requeued)] == [("r1", 1)]
    # an engine whose reports list nothing (the simulator's, an older engine) is never checked
    c2 = Cluster()
    d2 = c2.place("r2")
    for _ in range(3):
        c2.now += 4.0
        assert c2.report(d2.prefill_engine) == []
    # nor a prefill that finished: its report's finished list ends the check
    c3 = Cluster()
    c3.report("p0", holding=())
    c3.report("p1", holding=())
    d3 = c3.place("r3")
    c3.now += 4.0
    c3.report(d3.prefill_engine, finished=("r3",), attempts=(0,), holding=())
    c3.now += 4.0
    assert c3.report(d3.prefill_engine, holding=()) == [] and c3.core.requests["r3"].prefill_done


def test_a_finish_named_in_several_reports_counts_once():
    """Engines name each finish in three reports in a row (a lost report then loses none): the
    repeats change nothing, neither the figures nor the history nor a retried attempt."""
    c = Cluster(prefetch=True)
    d = c.place("r1", session="s")
    pe, de = d.prefill_engine, d.decode_engine
    for _ in range(3):
        assert c.report(pe, finished=("r1",), attempts=(0,)) == []
    assert c.core.requests["r1"].prefill_done
    cmds = [x for _ in range(3) for x in c.report(de, finished=("r1",), attempts=(0,))]
    assert kinds(cmds) == ["Prefetch"] and "r1" not in c.core.requests  # one hint, one history sample
    assert c.engine(pe).seq == 0 and c.engine(de).seq == 0 and c.engine(de).free_hbm_tokens == HBM


def test_an_abandoned_request_leaves_without_an_answer_or_a_retry():
    """A scheduler that took over was given an old submission after it had run a newer one
    (a late copy of a submit nobody answered): the decode engine refuses the hand-off (it ran
    the newer run), so this copy leaves, charges released, neither retried nor failed to the
    client (the newer run answered it); a client's cancel during the prefill is the same. The
    same for an earlier attempt changes nothing."""
    c = Cluster()
    d = c.place("r1")
    pe = c.engine(d.prefill_engine)
    charged = (pe.seq, pe.tok)
    assert charged[0] == 1
    late = TaskFailed(now=c.now, request_id="r1", engine=d.prefill_engine, reason="refused", attempt=5, abandoned=True)
    assert c.handle(late) == [] and "r1" in c.core.requests  # not the current attempt: late
    cmds = c.handle(TaskFailed(now=c.now, request_id="r1", engine=d.prefill_engine, reason="refused", attempt=0, abandoned=True))
    # no Requeued, no FailRequest; the slot of this attempt only (a newer run may hold another there)
    assert [(type(x).__name__, x.node, x.wire_attempt) for x in cmds] == [("FreeSlot", d.decode_node, 0)]
    assert "r1" not in c.core.requests and c.core.running == 0 and c.core.queued == 0
    assert (pe.seq, pe.tok) == (0, 0)  # its prefill charge went back


def test_a_forced_read_path_charges_the_node_that_actually_reads():
    c = Cluster()
    c.place("r1", forced=ReadSide.DE)
    d = c.place("r2", forced=ReadSide.DE)
    assert d.read_side is ReadSide.DE and d.decision.policy_side is ReadSide.DE
    assert c.read_q("P") == 0
    assert sum(c.read_q(n) for n in ("D1", "D2")) == 2 * 128
    stack = Cluster(read_path="de")  # the stack-wide flag is an input too
    d = stack.place("r1")
    assert d.read_side is ReadSide.DE and stack.read_q("P") == 0 and stack.read_q(d.decode_node) == 128
    assert stack.place("r2", forced=ReadSide.PE).read_side is ReadSide.PE  # the request's own choice wins
    assert stack.read_q("P") == 128
    none = Cluster().place("r0", hit_blocks=0)
    assert none.read_side is None


def test_hits_covering_the_last_prompt_token_are_charged_as_the_whole_blocks_before_it():
    """``kv.hits.readable_hit_blocks``: what the prefill engine reads, so what the core charges."""
    c = Cluster()
    d = c.place("r1", prompt=128, hit_blocks=2)  # the second block ends on the last token: computed
    assert d.decision.hit_tokens == 64 and c.read_q(d.decode_node if d.read_side is ReadSide.DE else "P") == 64
    one = c.place("r2", prompt=64, hit_blocks=1)  # a one-block prompt: nothing to read
    assert one.read_side is None and one.decision.hit_tokens == 0


def test_a_report_sent_before_the_engine_had_the_task_does_not_erase_the_charge():
    c = Cluster()
    c.submit("r1")
    (reserve,) = c.tick()
    pe = reserve.decision.prefill_engine
    assert c.engine(pe).tok == 172 and c.engine(pe).seq == 1  # 300 - 128 hit tokens
    c.report(pe, seq=0, tok=0)  # not acknowledged yet: the engine cannot count it
    assert (c.engine(pe).seq, c.engine(pe).tok) == (1, 172)
    c.handle(SlotReserved(now=c.now, request_id="r1", attempt=0, region={}, offset=0))
    c.handle(DispatchAnswered(now=c.now, request_id="r1", attempt=0))
    assert c.engine(pe).tok == 172
    c.report(pe, seq=1, tok=300)  # after the answer: the engine's own count is the truth
    assert (c.engine(pe).seq, c.engine(pe).tok) == (1, 300)
    c.report(pe, seq=1, tok=100)
    assert c.engine(pe).tok == 100
    c.report(pe, seq=0, tok=0, finished=("r1",))  # the finish comes with the report: nothing subtracted twice
    assert (c.engine(pe).seq, c.engine(pe).tok) == (0, 0)


def test_a_node_report_then_a_prefill_finish_do_not_subtract_the_same_read_twice():
    c = Cluster()
    a = c.place("r1", forced=ReadSide.PE)
    c.node_report("P", 128)  # reflects r1's read (acknowledged before this report)
    assert c.read_q("P") == 128
    b = c.place("r2", forced=ReadSide.PE)  # not yet seen by any report of P
    assert c.read_q("P") == 256
    c.node_report("P", 0)  # r1's read is done; r2's load is not queued there yet
    assert c.read_q("P") == 0  # r2 was acknowledged before the report: reflected (see the docstring's race)
    c.report(a.prefill_engine, finished=("r1",))
    assert c.read_q("P") == 0
    c.submit("r3", forced=ReadSide.PE)
    c.tick()
    assert c.read_q("P") == 128  # unreflected: charged
    c.report(b.prefill_engine, finished=("r2",))  # r2's reflected read is left to the reports
    assert c.read_q("P") == 128
    c.node_report("P", 50)  # r3 is not acknowledged yet: the report cannot hold it
    assert c.read_q("P") == 178


def test_an_unreflected_charge_leaves_the_figures_when_its_request_fails():
    c = Cluster(max_attempts=1)
    c.submit("r1", forced=ReadSide.DE)
    (reserve,) = c.tick()
    de, pe = reserve.decision.decode_engine, reserve.decision.prefill_engine
    assert c.engine(de).free_hbm_tokens == HBM - 316 and c.read_q(reserve.node) == 128
    cmds = c.handle(DispatchFailed(now=c.now, request_id="r1", attempt=0, stage=Stage.RESERVE, reason="gone"))
    assert isinstance(cmds[-1], FailRequest)
    assert c.engine(de).free_hbm_tokens == HBM and c.engine(de).tok == 0 and c.engine(pe).tok == 0 and c.read_q(reserve.node) == 0


def test_the_decode_charge_is_reflected_only_after_the_prefill_handed_the_request_over():
    c = Cluster()
    d = c.place("r1")
    c.report(d.decode_engine, seq=0, tok=0, free=HBM)  # the decode engine has not got it yet
    assert c.engine(d.decode_engine).free_hbm_tokens == HBM - 316
    c.report(d.prefill_engine, finished=("r1",))  # handed over
    c.report(d.decode_engine, seq=1, tok=301, free=HBM - 320)
    assert (c.engine(d.decode_engine).tok, c.engine(d.decode_engine).free_hbm_tokens) == (301, HBM - 320)


def test_the_same_events_give_the_same_commands():
    def run() -> list:
        c = Cluster(engine_timeout=0.5)
        out = []
        for i in range(20):
            out += c.submit(f"r{i}", prompt=200 + 37 * i, hit_blocks=i % 3)
            out += c.tick()
        for x in list(out):
            if isinstance(x, ReserveSlot) and x.request_id.endswith("3"):
                out += c.handle(
                    DispatchFailed(
                        now=c.now, request_id=x.request_id, attempt=x.attempt, stage=Stage.RESERVE, reason="full", code=BUFFER_FULL
                    )
                )
        out += c.tick(1.0)
        return out

    assert run() == run()


def test_an_unknown_event_is_a_type_error():
    # pure Python: the core's own message; the mypyc build: the extension's argument check
    with pytest.raises(TypeError, match="not a scheduler event|scheduler_events.RequestSubmitted.* object expected; got object"):
        Cluster().handle(object())  # type: ignore[arg-type]


def _decode_nodes(commands) -> set[str]:
    return {c.node for c in commands if isinstance(c, ReserveSlot)}


def test_a_reserve_nobody_serves_marks_the_node_down_so_the_retry_and_later_requests_go_to_the_other_node():
    c = Cluster()
    assert c.submit("a") == []
    (reserve,) = c.tick()
    down = reserve.node
    other = "D2" if down == "D1" else "D1"
    cmds = c.handle(
        DispatchFailed(
            now=c.now,
            request_id="a",
            attempt=reserve.attempt,
            stage=Stage.RESERVE,
            reason=f"tm.{down}.alloc: no service listens",
            node_unreachable=down,
        )
    )
    assert any(isinstance(x, Requeued) for x in cmds) and not any(isinstance(x, ExpelEngine) for x in cmds)
    assert _decode_nodes(c.tick()) == {other}  # the retry
    for i in range(4):
        assert c.submit(f"b{i}") == []
    assert _decode_nodes(c.tick()) == {other}
    assert {e.name for e in c.core.engines()} == set(c.engines)  # the engines stay members, only out of the policy's state
    assert {c.core.members.engine_by_num[e].name for e in c.core.state.engines} == {"p0", "p1"} | (
        {"d2", "d3"} if other == "D2" else {"d0", "d1"}
    )


def test_a_node_that_stops_reporting_goes_down_after_the_node_timeout_and_comes_back_with_its_next_report():
    c = Cluster(node_timeout=1.0, engine_timeout=10.0)
    for n in ("P", "D1", "D2"):
        c.node_report(n, 0)
    c.tick(0.6)
    c.node_report("P", 0)
    c.node_report("D2", 0)
    c.tick(0.6)  # D1 silent for 1.2 s
    for i in range(4):
        assert c.submit(f"r{i}") == []
    assert _decode_nodes(c.tick()) == {"D2"}
    c.node_report("D1", 0)  # its traffic manager is back
    for i in range(6):
        assert c.submit(f"s{i}") == []
    assert "D1" in _decode_nodes(c.tick())


def test_nodes_that_never_reported_do_not_expire():
    c = Cluster(node_timeout=1.0, engine_timeout=100.0)
    c.tick(5.0)
    for i in range(6):
        assert c.submit(f"r{i}") == []
    assert _decode_nodes(c.tick()) == {"D1", "D2"}


def test_an_engine_report_while_its_node_is_down_is_kept_and_counts_once_the_node_is_back():
    c = Cluster()
    c.node_report("D1", 0)
    assert c.submit("a") == []
    (reserve,) = c.tick()
    c.handle(DispatchFailed(now=c.now, request_id="a", attempt=reserve.attempt, stage=Stage.RESERVE, reason="x", node_unreachable="D1"))
    assert c.core.state is not None
    assert c.report("d0", seq=2, tok=500, free=HBM - 500) == []  # must not raise: d0 is out of the state
    c.node_report("D1", 0)
    assert c.engine("d0").tok == 500
