"""``SchedulerCore``: the scheduler's decisions, with no I/O and no clock of its own.

The scheduler service, the testbed and the simulator drive the same core: they turn what
happens into events and carry out the commands it returns (``core.handle(event) ->
list[Command]``; the types are in ``scheduler_events``). Like vLLM v1's ``Scheduler``
(``schedule()`` / ``update_from_output()``) and Vidur's ``handle_event``, the core only
updates state and decides; the driver owns sockets, timers and spans.

Events in: ``RequestSubmitted``, ``EngineReported``, ``NodeReported``, ``SlotReserved``,
``DispatchAnswered``, ``DispatchFailed``, ``TaskFailed``, ``RequestFinished``,
``TimeAdvanced``. Commands out: ``RejectRequest``, ``ReserveSlot``, ``Dispatch``,
``FreeSlot``, ``FailRequest``, ``ExpelEngine``, ``Requeued``.

A request's life: submitted -> queued (by rank: its submission time less
``history_credit`` times its session's predicted decode seconds (``DecodeHistory``, learned
from the session's earlier turns), so among requests submitted close together the longest
decode goes first; one queued ``urgent_wait_s`` goes ahead of every fresher one; a retry at
the head; the rules are ``scheduler_queue.QueueOrder``'s) -> placed by a pass on ``TimeAdvanced``
(``ReserveSlot`` on the decode node) -> ``SlotReserved`` -> ``Dispatch`` to the prefill
engine -> ``DispatchAnswered`` -> the prefill engine reports it finished (handed to the
decode engine) -> the decode engine reports it finished: forgotten. A failure on the way
puts it back at the head of the queue as a new attempt (its DE slot freed) up to
``max_attempts``, then ``FailRequest`` (503). The policy ranks a decode node whose buffer
has no room for the slot last (its figure below; chosen only when no node has room, as a
report may lag a freed slot, once per pass); a reservation refused (``DispatchFailed`` with
code 507) is back-pressure: the request goes back without using an attempt and passes
pause for ``buffer_backoff_s``, for at most ``buffer_wait_s`` per request. An engine
silent for ``engine_timeout`` seconds, or one a dispatch found unreachable, is expelled:
its requests are re-queued (a prefill engine's only until their prefill is done). A prefill
engine that lists the tasks it holds in its reports (``EngineReported.holding``) is also
checked against the core's placements: a prefill it answered a dispatch for that two such
reports in a row leave out, ``engine_timeout`` seconds or more after the answer, is lost
(the engine dropped it and its ``TaskFailed``, a fire-and-forget message, never arrived) and
is retried like a failed one; the grace covers reports generated before the dispatch arrived
but handled after its answer. A node
whose traffic manager stops reporting for ``node_timeout`` seconds, or does not answer a
``ReserveSlot`` at all (``DispatchFailed.node_unreachable``), is *down*: its engines leave
the policy's state until the node's next ``NodeReported``.

**Reports and charges** (how the policy's figures are kept). Every figure the policy
reads (an engine's seq_e, tok_e, free HBM; a node's read_q and free DRAM buffer) is

    figure = the holder's last reported value + Σ the core's charges it has not reflected

1. A placement charges its holders at once: the prefill engine (seq +1, tok + miss
   tokens), the decode engine (seq +1, tok + prompt + max_tokens, free HBM − the same),
   the node that reads the hits (read_q + hit tokens) and the decode node (free buffer −
   the slot's bytes, ``ReserveSlot``'s blocks × block bytes). The charge is *unreflected*.
2. A charge is *acknowledged* once its holder is known to have it: the prefill engine's
   and the read node's when the prefill engine answers the dispatch (``DispatchAnswered``;
   it asks the read node for the hits right away), the decode engine's when the prefill
   engine reports the prefill finished (it has handed the request over), the decode
   node's slot when the node answers the reservation (``SlotReserved``).
3. A report of a holder *reflects* every charge acknowledged at an earlier event (events
   are numbered in the order the core handles them): such charges leave the sums, and
   from then on only that holder's reports move them.
4. When a request's part on a holder ends (finished, failed, re-queued), an unreflected
   charge is taken off the figure at once; a reflected one is left to the holder's next
   report (which no longer counts it). A slot's part ends when the request is re-queued or
   failed (``FreeSlot``) or its decode finishes (the decode engine freed the slot once the
   KV was in HBM, earlier; the node's reports show that). So nothing is ever subtracted
   twice (a node report that already dropped a read from read_q, then a prefill finish
   subtracting the same read again).

The rule errs on the safe side in the races it cannot see: a report generated just before
an acknowledgement but handled after it makes the core undercount that charge until the
holder's next report (one report interval, 0.2 s), and a report that already counts a
task but is handled before its acknowledgement makes it count the charge twice for as
long. Engines must count a task in their reports from the moment they acknowledge it.

A forced read side (per request, ``RequestSubmitted.forced_side``, or the policy's
``read_path``) is an input to the policy, so the read charge lands on the node that reads.

Determinism: the same events in the same order give the same commands (no wall clock, no
randomness, dicts iterated in insertion order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final, cast

from dualpath.core.scheduler_events import (
    ALL_ATTEMPTS,
    BUFFER_FULL,
    Command,
    Decision,
    Dispatch,
    DispatchAnswered,
    DispatchFailed,
    EngineLost,
    EngineReported,
    Event,
    ExpelEngine,
    FailRequest,
    FreeSlot,
    NodeLost,
    NodeReported,
    Prefetch,
    RejectRequest,
    RequestFinished,
    RequestSubmitted,
    Requeued,
    ReserveSlot,
    SlotReserved,
    Stage,
    StopAttempts,
    TaskFailed,
    TimeAdvanced,
    core_attempt,
    wire_attempt,
)
from dualpath.core.scheduler_members import (
    Charge,
    EngineMember,
    HeldTasks,
    Holder,
    Membership,
    NodeMember,
    reflect,
)
from dualpath.core.scheduler_queue import Queued, QueueOrder, RankedQueue
from dualpath.core.scheduler_request import DISPATCHING as _DISPATCHING
from dualpath.core.scheduler_request import QUEUED as _QUEUED
from dualpath.core.scheduler_request import RESERVING as _RESERVING
from dualpath.core.scheduler_request import RUNNING as _RUNNING
from dualpath.core.scheduler_request import CoreRequest, Submissions
from dualpath.kv.hits import readable_hit_blocks
from dualpath.policy import ClusterState, PendingRequest, Policy
from dualpath.policy.errors import InvalidRequestError
from dualpath.policy.history import DecodeHistory
from dualpath.policy.values import Assignment, ReadSide, Role

__all__ = ["CoreConfig", "SchedulerCore"]


def _split_blocks(a: Assignment, block_tokens: int) -> tuple[int, int] | None:
    """(PE blocks, DE blocks) of a split read, in whole blocks; None when one side reads all."""
    if not a.de_split_tokens:
        return None
    pe_blocks = (a.read_tokens - a.de_split_tokens) // block_tokens  # the PE share is whole blocks
    return pe_blocks, -(-a.read_tokens // block_tokens) - pe_blocks


_DECODE: Final = Role.DECODE
_MAX_STAGED: Final = 100_000  # prefetch: sessions remembered between turns (the oldest is forgotten first)


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreConfig:
    """The core's knobs (the service maps ``SchedulerConfig`` onto these)."""

    engine_timeout: float = 3.0  # seconds without a report after which an engine is dead
    node_timeout: float | None = None  # seconds without a NodeReport after which a (once reporting) node is down; None: never
    max_queue: int = 10_000  # most requests waiting; more are refused with 429
    max_attempts: int = 3  # placements per request before it fails (back-pressure not counted)
    pass_window: int = 1024  # queued requests one pass hands the policy (it places a FIFO prefix)
    buffer_backoff_s: float = 0.02  # pause of passes after a full decode-node buffer
    buffer_wait_s: float = 600.0  # a request waiting longer for buffer room fails (then counts attempts)
    expiry_interval_s: float = 0.25  # how often TimeAdvanced looks for silent engines
    # Queue order (longest decode first among requests submitted close together): a request ranks
    # history_credit x its session's predicted decode seconds (DecodeHistory: measured on the
    # session's earlier turns) earlier than its submission; decode_credit_s x max_tokens more only
    # where clients' max_tokens are real length estimates (an API's max_tokens is a cap: 0, off).
    history_credit: float = 5.0
    decode_credit_s: float = 0.0
    urgent_wait_s: float = 3.0  # a request queued this long goes ahead of every fresher one (FIFO among such)
    trace_inputs: bool = False  # fill Decision.seen (what the policy compared) for spans
    prefetch: bool = False  # agent-aware prefetch: a session's finished turn emits Prefetch for its prefill node


class SchedulerCore:
    """The scheduler's queue, membership, placement, retries and back-pressure (see the
    module docstring). One owner drives it; not thread-safe."""

    def __init__(self, policy: Policy, config: CoreConfig = CoreConfig()) -> None:
        self.policy, self.cfg = policy, config
        self.pass_window = config.pass_window  # a driver may adapt it between passes (the simulator does)
        self.members = Membership()
        self.order = QueueOrder(  # the queue and its order (scheduler_queue)
            history_credit=config.history_credit,
            decode_credit_s=config.decode_credit_s,
            urgent_wait_s=config.urgent_wait_s,
            waiting=self._waiting,
        )
        self.requests: dict[str, CoreRequest] = {}  # queued and placed, by request id
        self.buffer_waits = 0  # placements put back because a decode node's buffer was full
        self.now = 0.0
        self._state: ClusterState | None = None
        self._stale = True  # membership changed: rebuild the state before using it
        self._k = 0  # events handled: the order that decides what a report reflects
        self._num = 0
        self._hold_until = float("-inf")
        self._next_expiry = float("-inf")
        self._reserving: dict[tuple[str, int], str] = {}  # (request, attempt) -> node of an unanswered ReserveSlot
        self._staged: dict[str, str] = {}  # prefetch: session -> node asked to stage its next turn's hits
        self._held = HeldTasks()  # the lost-failure check of prefill engines that list their tasks
        self._submissions = Submissions()  # the newest submission accepted per request (a late copy is refused)
        self._handlers: dict[type, Callable[[Any], list[Command]]] = {  # each takes its own event type
            RequestSubmitted: self._submitted,
            EngineReported: self._engine_reported,
            NodeReported: self._node_reported,
            SlotReserved: self._slot_reserved,
            DispatchAnswered: self._answered,
            DispatchFailed: self._dispatch_failed,
            TaskFailed: self._task_failed,
            EngineLost: self._engine_lost,
            NodeLost: self._node_lost,
            RequestFinished: self._finished_event,
            TimeAdvanced: self._time_advanced,
        }

    # ---- the one entry point ------------------------------------------------------------
    def handle(self, event: Event) -> list[Command]:
        """Apply ``event`` and return what the driver must do, in order.

        Raises:
            TypeError: ``event`` is not one of the core's event types.
        """
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TypeError(f"not a scheduler event: {type(event).__name__}")
        self._k += 1
        self.now = event.now
        return handler(event)

    # ---- read-only views (health, metrics, state replies) --------------------------------
    @property
    def queue(self) -> RankedQueue:
        """The waiting requests, in the order they are placed (``QueueOrder``; iterating it
        sorts a copy). Do not modify."""
        return self.order.items

    @property
    def history(self) -> DecodeHistory:
        """Per-session decode seconds, the queue's order. Do not modify."""
        return self.order.history

    @property
    def queued(self) -> int:
        """Requests waiting to be placed."""
        return len(self.queue)

    @property
    def running(self) -> int:
        """Requests placed and not finished."""
        return len(self.requests) - len(self.queue)

    def engine_count(self, role: Role) -> int:
        """Live engines of ``role``."""
        return self.members.count(role)

    def engines(self) -> Iterable[EngineMember]:
        """Live engines (name, node, role, last reported figures). Do not modify."""
        return self.members.engines.values()

    def nodes(self) -> Iterable[NodeMember]:
        """Known nodes (name, last reported read_q). Do not modify."""
        return self.members.nodes.values()

    @property
    def state(self) -> ClusterState | None:
        """The policy's view of the cluster (reports + unreflected charges); None until both
        roles have live engines. Do not modify."""
        return self._cluster()

    @property
    def held_until(self) -> float:
        """Passes place nothing before this ``now`` (back-pressure after a full node buffer)."""
        return self._hold_until

    def _waiting(self, t: Queued, attempt: int) -> bool:
        """Whether ``t`` is still in the queue as ``attempt`` (QueueOrder asks)."""
        return isinstance(t, CoreRequest) and t.stage == _QUEUED and t.attempt == attempt and self.requests.get(t.rid) is t

    def is_current(self, request_id: str, attempt: int) -> bool:
        """Whether ``attempt`` is the live placement of the request."""
        t = self.requests.get(request_id)
        return t is not None and t.stage != _QUEUED and t.attempt == attempt

    # ---- intake -------------------------------------------------------------------------
    def _submitted(self, ev: RequestSubmitted) -> list[Command]:
        rid = ev.request_id
        if len(self.queue) >= self.cfg.max_queue:
            return [RejectRequest(request_id=rid, code=429, reason=f"scheduler queue full ({self.cfg.max_queue} requests waiting)")]
        if rid in self.requests:
            return [RejectRequest(request_id=rid, code=409, reason=f"request {rid} already submitted")]
        newest = self._submissions.newest(rid)
        if ev.submission <= newest:
            # Run here already and over: a late copy of an unanswered submit after a failover, or
            # an older submission than one run here (the gateway resubmitted it meanwhile).
            # Running it again would answer nobody.
            return [
                RejectRequest(
                    request_id=rid, code=409, reason=f"request {rid} submission {ev.submission} already run here (newest {newest})"
                )
            ]
        if ev.prompt_tokens <= 0:
            return [RejectRequest(request_id=rid, code=400, reason="empty prompt")]
        need = ev.prompt_tokens + ev.max_tokens
        state = self._cluster()
        if state is not None and need > state.max_decode_hbm_tokens:
            # It could never be placed and would block the FIFO queue behind it.
            return [
                RejectRequest(
                    request_id=rid,
                    code=400,
                    reason=f"prompt plus max_tokens ({need} tokens) exceeds the KV capacity "
                    f"of every decode engine ({state.max_decode_hbm_tokens} tokens)",
                )
            ]
        hit = readable_hit_blocks(ev.prompt_tokens, ev.hit_blocks, ev.block_tokens) * ev.block_tokens
        try:
            pending = PendingRequest(
                request_id=self._num,
                prompt_tokens=ev.prompt_tokens,
                hit_tokens=hit,
                total_len=need,
                forced_side=ev.forced_side if hit > 0 else None,
                block_tokens=ev.block_tokens,
                staged_node=self._staged_node(ev.session) if self.cfg.prefetch and hit > 0 else -1,
            )
        except InvalidRequestError as exc:
            return [RejectRequest(request_id=rid, code=400, reason=exc.reason)]
        t = CoreRequest(rid, self._num, pending, -(-ev.prompt_tokens // ev.block_tokens), ev.payload, ev.now)
        t.session = ev.session
        t.submission = ev.submission
        self._num += 1
        self.requests[rid] = t
        self._submissions.accept(rid, ev.submission)
        self.order.submit(t, ev.now, t.attempt, ev.session, ev.max_tokens)
        if ev.submission > 0:
            # The scheduler that held it died. A run of it that engines may still hold stops
            # now (before this one is placed), so it neither hands off later nor keeps writing
            # into a slot that only the traffic manager's reclaim frees.
            return [StopAttempts(request_id=rid, before=wire_attempt(ev.submission, 0), reason="resubmitted after a scheduler failover")]
        return []

    # ---- reports ------------------------------------------------------------------------
    def _engine_reported(self, ev: EngineReported) -> list[Command]:
        member = self.members.engines.get(ev.engine)
        cmds: list[Command] = []
        if member is not None and ev.incarnation and member.incarnation and ev.incarnation != member.incarnation:
            # Restarted under its name before it was found silent: what it held is gone.
            self._lose([ev.engine], f"restarted (incarnation {member.incarnation} -> {ev.incarnation})", cmds)
            member = None
        if member is None:
            member = self.members.join(
                ev.engine, ev.now, node=ev.node, role=Role(ev.role), capacity_tokens=ev.capacity_tokens, block_bytes=ev.block_bytes
            )
            self._stale = True
        if ev.incarnation:
            member.incarnation = ev.incarnation
        member.last_seen = ev.now
        seq, tok, free = member.seq, member.tok, member.free_hbm = ev.seq, ev.tok, ev.free_hbm_tokens
        if ev.block_bytes and ev.block_bytes != member.block_bytes:
            member.block_bytes = ev.block_bytes
            if member.role is _DECODE:
                self.members.nodes[member.node].block_bytes = ev.block_bytes
                self._stale = True  # the policy's buffer figures are in its blocks
        if ev.finished:
            attempts = ev.finished_attempts
            if len(attempts) == len(ev.finished):
                for rid, attempt in zip(ev.finished, attempts):
                    self._finish(rid, member, cmds, self._core_attempt(rid, attempt))
            else:
                for rid in ev.finished:
                    self._finish(rid, member, cmds)
        if ev.holding is not None:
            held = ev.holding_attempts
            if len(held) == len(ev.holding):
                held = tuple(self._core_attempt(rid, wire) for rid, wire in zip(ev.holding, held))
            lost = self._held.lost(member.name, ev.holding, held, self._prefill_attempt, self.now, self.cfg.engine_timeout)
            for rid in lost:
                self._retry(self.requests[rid], f"prefill engine {member.name} no longer holds it (its failure was never reported)", cmds)
        if member.acked:
            reflect(member, self._k)
        state = self._state
        if state is not None and not self._stale and member.num in state.engines:  # not there while its node is down
            state.report_engine(member.num, seq + member.dseq, tok + member.dtok, free - member.dhbm if member.role is _DECODE else None)
        return cmds

    def _core_attempt(self, rid: str, wire: int) -> int:
        """An engine's (wire) attempt of ``rid`` as this core numbers it (-1: not said or not held)."""
        t = self.requests.get(rid)
        return core_attempt(t.submission, wire) if t is not None else -1

    def _prefill_attempt(self, engine: str, rid: str) -> int:
        """The attempt of ``rid`` prefilling on ``engine`` (dispatch answered, not done), else -1."""
        t = self.requests.get(rid)
        if t is None or t.pe is None or t.pe.name != engine or t.stage != _RUNNING or t.prefill_done:
            return -1
        return t.attempt

    def _node_reported(self, ev: NodeReported) -> list[Command]:
        node = self.members.node(ev.node, ev.now)
        node.last_seen = ev.now
        node.reported = True
        if node.down:  # its traffic manager is back: its engines are scheduled again
            node.down = False
            self._stale = True
        node.read_q = ev.read_q_tokens
        if ev.buffer_free_bytes >= 0:
            node.buffer_free, node.buffer_bytes = ev.buffer_free_bytes, ev.buffer_bytes
        if node.acked:
            reflect(node, self._k)
        state = self._state
        if not self._stale and state is not None and node.num in state.nodes:
            state.report_node(node.num, read_q=ev.read_q_tokens + node.dtok)
            free, total = node.buffer_blocks()
            state.report_buffer(node.num, free_blocks=free, total_blocks=total)
        return []

    def _finished_event(self, ev: RequestFinished) -> list[Command]:
        member = self.members.engines.get(ev.engine)
        cmds: list[Command] = []
        if member is not None:
            self._finish(ev.request_id, member, cmds, ev.attempt)
        return cmds

    def _finish(self, rid: str, member: EngineMember, cmds: list[Command], attempt: int = -1) -> None:
        """``member`` finished its part of request ``rid`` (late, unknown or, when ``attempt``
        is said, another attempt than the current one: ignored; a prefill engine that holds
        a retry of the request may finish the earlier attempt first)."""
        t = self.requests.get(rid)
        if t is None or t.stage == _QUEUED or (attempt >= 0 and attempt != t.attempt):
            return
        if t.pe is not None and t.pe.name == member.name and not t.prefill_done:
            t.prefill_done = True
            t.prefill_done_at = self.now
            t.stage = _RUNNING
            self._release(t.pe_charge)
            self._release(t.read_charge)
            self._release(t.split_charge)
            self._close_reads(t)
            if t.de_charge is not None:
                t.de_charge.acknowledge(self._k)  # the decode engine has it now
        elif t.de is not None and t.de.name == member.name:
            self._release_all(t)
            del self.requests[rid]
            if t.prefill_done_at >= 0:
                self.order.learned(t.session, self.now - t.prefill_done_at)
            if self.cfg.prefetch and t.session and t.pe is not None and t.pending.prompt_tokens >= t.pending.block_tokens:
                # The session's next turn starts with this context: the node that read this
                # turn (the PE's when nothing was read) stages it while the agent runs its
                # tool, and the next turn prefers that node (PendingRequest.staged_node).
                node = t.de.node if t.read_side is ReadSide.DE else t.pe.node
                self._staged.pop(t.session, None)
                if len(self._staged) >= _MAX_STAGED:
                    del self._staged[next(iter(self._staged))]  # the oldest hint
                self._staged[t.session] = node
                cmds.append(Prefetch(node=node, request_id=rid, session=t.session, payload=t.payload))

    # ---- dispatch answers ---------------------------------------------------------------
    def _slot_reserved(self, ev: SlotReserved) -> list[Command]:
        t = self.requests.get(ev.request_id)
        if t is None or t.attempt != ev.attempt or t.stage != _RESERVING:
            return self._stale_slot(t, ev)
        assert t.pe is not None and t.de is not None and t.decision is not None
        self._reserving.pop((t.rid, t.attempt), None)
        t.stage = _DISPATCHING
        if t.slot_charge is not None:
            t.slot_charge.acknowledge(self._k)  # the decode node holds the slot
        return [
            Dispatch(
                request_id=t.rid,
                attempt=t.attempt,
                prefill_engine=t.pe.name,
                prefill_node=t.pe.node,
                decode_engine=t.de.name,
                decode_node=t.de.node,
                read_side=t.read_side,
                region=ev.region,
                offset=ev.offset,
                decision=t.decision,
                payload=t.payload,
                wire_attempt=wire_attempt(t.submission, t.attempt),
            )
        ]

    def _stale_slot(self, t: CoreRequest | None, ev: SlotReserved) -> list[Command]:
        """A slot reserved for an attempt that is over: nothing will use it (the traffic
        manager holds a slot per attempt); that one is freed, or every one of the request
        once it is gone."""
        node = self._reserved_node(ev.request_id, ev.attempt)
        if not node:
            return []
        if t is None:
            return [FreeSlot(node=node, request_id=ev.request_id)]
        return [FreeSlot(node=node, request_id=ev.request_id, wire_attempt=wire_attempt(t.submission, ev.attempt))]

    def _answered(self, ev: DispatchAnswered) -> list[Command]:
        t = self.requests.get(ev.request_id)
        if t is not None and t.attempt == ev.attempt and t.stage == _DISPATCHING:
            t.stage = _RUNNING
            if t.pe_charge is not None:
                t.pe_charge.acknowledge(self._k)
            if t.read_charge is not None:
                t.read_charge.acknowledge(self._k)
            if t.split_charge is not None:
                t.split_charge.acknowledge(self._k)
            if t.pe is not None:
                self._held.given(t.pe.name, t.rid, self.now)
        return []

    def _dispatch_failed(self, ev: DispatchFailed) -> list[Command]:
        cmds: list[Command] = []
        if ev.stage == Stage.RESERVE:
            self._reserved_node(ev.request_id, ev.attempt)
        if ev.unreachable:
            self._lose([ev.unreachable], f"engine {ev.unreachable} did not answer", cmds)
        if ev.node_unreachable:
            self._node_down(ev.node_unreachable)
        t = self.requests.get(ev.request_id)
        if t is None or t.attempt != ev.attempt or t.stage == _QUEUED:
            return cmds  # stale: that attempt is over already
        if ev.code == BUFFER_FULL:
            if t.wait_start < 0:
                t.wait_start = ev.now
            if ev.now - t.wait_start < self.cfg.buffer_wait_s:
                # The DE node's buffer holds requests between prefill and decode: wait for
                # one to move on instead of failing this one.
                self.buffer_waits += 1
                self._hold_until = ev.now + self.cfg.buffer_backoff_s
                self._retry(t, "decode node buffer full", cmds, counted=False)
                return cmds
        self._retry(t, f"dispatch failed: {ev.reason}", cmds)
        return cmds

    def _task_failed(self, ev: TaskFailed) -> list[Command]:
        cmds: list[Command] = []
        if ev.node_unreachable:  # before the retry, so the retry is not placed on that node while it restarts
            self._node_down(ev.node_unreachable)
        t = self.requests.get(ev.request_id)
        if t is None or t.stage == _QUEUED:
            return cmds
        holders = (t.pe.name if t.pe else "", t.de.name if t.de else "")
        attempt = core_attempt(t.submission, ev.attempt)
        if ev.engine not in holders or (attempt >= 0 and attempt != t.attempt):
            return cmds  # late: from an engine of an earlier attempt, or an earlier attempt on the same engine
        if ev.abandoned:  # a newer run answers the client, or nobody waits any more: the request just leaves
            self._release_all(t)
            del self.requests[t.rid]
            if t.de is not None:  # its slot, which no hand-off will claim (only this attempt's: a newer run may hold another)
                cmds.append(FreeSlot(node=t.de.node, request_id=t.rid, wire_attempt=wire_attempt(t.submission, t.attempt)))
            return cmds
        attempt = t.attempt
        if ev.unreachable:
            self._lose([ev.unreachable], f"engine {ev.unreachable} did not answer", cmds)
        if t.attempt == attempt and t.stage != _QUEUED and self.requests.get(ev.request_id) is t:
            self._retry(t, ev.reason, cmds)
        return cmds

    def _engine_lost(self, ev: EngineLost) -> list[Command]:
        cmds: list[Command] = []
        self._lose([ev.engine], ev.reason, cmds)
        return cmds

    def _node_lost(self, ev: NodeLost) -> list[Command]:
        self._node_down(ev.node)
        return []

    # ---- time: expiry and the scheduling pass -----------------------------------------------
    def _time_advanced(self, ev: TimeAdvanced) -> list[Command]:
        cmds: list[Command] = []
        if ev.now >= self._next_expiry:
            self._next_expiry = ev.now + self.cfg.expiry_interval_s
            silent = self.members.silent(ev.now, self.cfg.engine_timeout)
            if silent:
                self._lose(silent, "stopped reporting", cmds)
            if self.cfg.node_timeout is not None:
                for name in self.members.silent_nodes(ev.now, self.cfg.node_timeout):
                    self._node_down(name)
        self._pass(cmds)
        return cmds

    def _pass(self, cmds: list[Command]) -> None:
        """Place the longest FIFO prefix of the queue that fits now."""
        if not self.queue or self.now < self._hold_until:
            return
        self.order.promote_urgent(self.now)
        state = self._cluster()
        if state is None:
            return
        queue = self.order.items
        window = [cast("CoreRequest", t).pending for t in queue.head(self.pass_window)]
        for a in self.policy.schedule(window, state):
            t = cast("CoreRequest", queue.popleft())  # it holds only the core's requests
            assert t.num == a.request_id, "the policy places a FIFO prefix"
            self._place(t, a, state, cmds)

    def _place(self, t: CoreRequest, a: Assignment, state: ClusterState, cmds: list[Command]) -> None:
        m = self.members
        pe, de = m.engine_by_num[a.prefill_engine], m.engine_by_num[a.decode_engine]
        read_node = m.node_by_num[a.read_node]
        seen = self._seen(a, state) if self.cfg.trace_inputs else {}
        t.pe, t.de, t.stage, t.prefill_done = pe, de, _RESERVING, False
        t.read_side = a.read_side if a.read_tokens else None
        t.pe_charge = Charge(pe, 1, a.prefill_tokens, 0)
        state.adjust_engine(pe.num, 1, a.prefill_tokens)
        t.de_charge = Charge(de, 1, a.decode_tokens, a.decode_tokens)
        state.adjust_engine(de.num, 1, a.decode_tokens, -a.decode_tokens)
        if a.read_tokens:
            own = a.read_tokens - a.de_split_tokens  # all of it unless the read is split
            t.read_charge = Charge(read_node, 0, own, 0)
            state.adjust_read_q(read_node.num, own)
            self._open_read(t, read_node, own, state)
        de_node = m.nodes[de.node]
        if a.de_split_tokens:
            t.split_charge = Charge(de_node, 0, a.de_split_tokens, 0)
            state.adjust_read_q(de_node.num, a.de_split_tokens)
            self._open_read(t, de_node, a.de_split_tokens, state)
        t.slot_charge = Charge(de_node, 0, 0, t.blocks * de.block_bytes)
        if de_node.buffer_free >= 0:
            free, total = de_node.buffer_blocks()
            state.report_buffer(de_node.num, free_blocks=free, total_blocks=total)
        state.assigned_total += 1
        t.decision = Decision(
            policy=self.policy.name,
            prefill_engine=pe.name,
            prefill_node=pe.node,
            decode_engine=de.name,
            decode_node=de.node,
            read_side=t.read_side,
            policy_side=a.read_side,
            hit_tokens=a.read_tokens,
            prefill_tokens=a.prefill_tokens,
            decode_tokens=a.decode_tokens,
            queued_since=t.queued_since,
            queue_len=len(self.queue),
            seen=seen,
            read_split=_split_blocks(a, t.pending.block_tokens),
        )
        self._reserving[(t.rid, t.attempt)] = de.node
        cmds.append(
            ReserveSlot(
                request_id=t.rid,
                attempt=t.attempt,
                node=de.node,
                blocks=t.blocks,
                block_bytes=de.block_bytes,
                decision=t.decision,
                payload=t.payload,
                wire_attempt=wire_attempt(t.submission, t.attempt),
            )
        )

    def _seen(self, a: Assignment, st: ClusterState) -> dict[str, int | list[str]]:
        """The figures the policy compared for ``a``, before ``a`` is charged (earlier
        placements of the same pass are charged already, as in the policy's own pass)."""
        pe, de = st.engines[a.prefill_engine], st.engines[a.decode_engine]
        seen: dict[str, int | list[str]] = {
            "read_q_pe": st.nodes[pe.node_id].read_q,
            "read_q_de": st.nodes[de.node_id].read_q,
            "tok_e_prefill": pe.tok,
            "seq_e_prefill": pe.seq,
            "tok_e_decode": de.tok,
            "seq_e_decode": de.seq,
            "free_hbm_decode": de.free_hbm_tokens,
            "buffer_free_blocks_decode": st.nodes[de.node_id].buffer_free,
        }
        if len(st.engines) <= 32:  # the whole field the policy chose from, while it stays readable
            names = self.members.engine_by_num
            seen["prefill_candidates"] = [f"{names[e.engine_id].name}:{e.tok}" for e in st.prefill_engines]
            seen["decode_candidates"] = [f"{names[e.engine_id].name}:{e.tok}" for e in st.decode_engines]
        return seen

    # ---- failures -----------------------------------------------------------------------
    def _retry(self, t: CoreRequest, reason: str, cmds: list[Command], *, counted: bool = True) -> None:
        """Put ``t`` back at the head of the queue as a new attempt, or fail it after
        ``max_attempts`` (back-pressure, ``counted=False``, does not use one up)."""
        self._release_all(t)
        slot_node = t.de.node if t.de is not None else ""
        t.attempt += 1  # also when not counted: answers for the old attempt are stale now
        failed = t.attempt - t.buffer_waits - (0 if counted else 1) >= self.cfg.max_attempts
        if not counted:
            t.buffer_waits += 1
        t.pe = t.de = None
        t.pe_charge = t.de_charge = t.read_charge = t.split_charge = t.slot_charge = None
        t.decision = None
        t.prefill_done = False
        t.stage = _QUEUED
        if slot_node:  # the slots of every attempt before the new one (all of them if it fails)
            cmds.append(
                FreeSlot(node=slot_node, request_id=t.rid, wire_before=ALL_ATTEMPTS if failed else wire_attempt(t.submission, t.attempt))
            )
        if failed:
            del self.requests[t.rid]
            cmds.append(
                FailRequest(
                    request_id=t.rid,
                    code=503,
                    reason=f"request failed after {t.attempt} attempts: {reason}",
                    attempts=t.attempt,
                    payload=t.payload,
                )
            )
            return
        t.queued_since = self.now
        self.order.requeue(t)
        cmds.append(Requeued(request_id=t.rid, attempt=t.attempt, reason=reason, counted=counted))
        if counted:
            # A live prefill engine may still hold the old attempt: it stops before it writes
            # into the decode slot just given up (sent before the new attempt's dispatch).
            cmds.append(StopAttempts(request_id=t.rid, before=wire_attempt(t.submission, t.attempt), reason=f"retried: {reason}"))

    def _lose(self, names: Iterable[str], reason: str, cmds: list[Command]) -> None:
        """Stop using engines (they re-join with their next report) and re-queue what they
        held: every request on a lost decode engine, and the unfinished prefills of a lost
        prefill engine. The earliest request ends up first in the queue."""
        gone: set[str] = set()
        for name in names:
            self._held.forget(name)
            member = self.members.remove(name)
            if member is not None:
                gone.add(name)
                cmds.append(ExpelEngine(engine=name, reason=reason, incarnation=member.incarnation))
        if not gone:
            return
        self._stale = True
        hit = [
            t
            for t in self.requests.values()
            if t.stage != _QUEUED
            and t.pe is not None
            and t.de is not None
            and (t.de.name in gone or (t.pe.name in gone and not t.prefill_done))
        ]
        for t in sorted(hit, key=lambda r: r.num, reverse=True):
            lost = t.pe.name if t.pe is not None and t.pe.name in gone else (t.de.name if t.de is not None else "")
            self._retry(t, f"engine {lost} {reason}", cmds)

    def _node_down(self, name: str) -> None:
        """Stop placing work on the engines of node ``name`` until its traffic manager reports
        again. What they hold is left to fail on its own (a transfer through the dead traffic
        manager fails fast and comes back as ``TaskFailed``); the engines stay members."""
        node = self.members.nodes.get(name)
        if node is not None and not node.down:
            node.down = True
            self._stale = True

    # ---- the ledger (see the module docstring) ---------------------------------------------
    def _release(self, c: Charge | None) -> None:
        if c is None or not c.release():
            return
        h: Holder = c.holder
        state = self._state
        if self._stale or state is None or not h.live:
            return  # the next rebuild starts from the holders' sums
        if isinstance(h, NodeMember):
            if h.num in state.nodes:
                if c.tok:
                    state.adjust_read_q(h.num, -c.tok)
                if c.hbm and h.buffer_free >= 0:
                    free, total = h.buffer_blocks()
                    state.report_buffer(h.num, free_blocks=free, total_blocks=total)
        elif h.num in state.engines:
            state.adjust_engine(h.num, -c.seq, -c.tok, c.hbm)

    def _release_all(self, t: CoreRequest) -> None:
        self._release(t.pe_charge)
        self._release(t.de_charge)
        self._release(t.read_charge)
        self._release(t.split_charge)
        self._release(t.slot_charge)
        self._close_reads(t)

    def _open_read(self, t: CoreRequest, node: NodeMember, tokens: int, state: ClusterState) -> None:
        """Count ``tokens`` of ``t``'s reads as open on ``node`` until its prefill ends."""
        node.reads_open += tokens
        state.adjust_reads_open(node.num, tokens)
        t.open_reads = (*t.open_reads, (node, tokens))

    def _close_reads(self, t: CoreRequest) -> None:
        """``t``'s reads are over (its prefill ended, or its placement did): no longer open."""
        if not t.open_reads:
            return
        state = None if self._stale else self._state
        for node, tokens in t.open_reads:
            node.reads_open -= tokens
            if state is not None and node.live and node.num in state.nodes:
                state.adjust_reads_open(node.num, -tokens)
        t.open_reads = ()

    def _cluster(self) -> ClusterState | None:
        if self._stale:
            self._state = self.members.cluster_state()
            self._stale = False
        return self._state

    def _staged_node(self, session: str) -> int:
        """Prefetch: the policy's id of the node staging ``session``'s hits (-1: none, or down)."""
        node = self.members.nodes.get(self._staged.pop(session, "")) if session else None
        return node.num if node is not None and not node.down else -1

    def _reserved_node(self, rid: str, attempt: int) -> str:
        """The node of an answered reservation (forgotten from now on); "" if unknown."""
        return self._reserving.pop((rid, attempt), "")
