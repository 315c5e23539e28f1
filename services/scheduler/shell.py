"""The scheduler service around ``dualpath.core.SchedulerCore``: bus messages in, bus calls out.

Nothing here decides anything. Each message becomes a core event; each command the core
returns becomes a bus call (run as its own task, so dispatches overlap) whose
answer becomes the next event. The loop ticks the core (``TimeAdvanced``) whenever a message
arrived, and at least every 50 ms. The decision data a command carries becomes the
``scheduler.queue`` and ``scheduler.decision`` spans (the latter stays current across the
slot reservation and the prefill dispatch, so their bus calls hang under it).

What the core decides and this shell only carries out: which submissions are refused (409 for
a late copy after a failover), the attempt numbers engines and traffic managers see (the core's
attempts offset by the gateway's submission: ``core.wire_attempt``), an engine that restarted
under its name (its reports name a new incarnation), which runs engines must stop
(``StopAttempts``, published before the new attempt's dispatch) and which slots to free.
An engine the core stops using (``ExpelEngine``) is announced on ``Subjects.engine_lost``
(gateways resubmit the started requests it served that no scheduler may know).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence

import anyio
from anyio.abc import TaskGroup
from opentelemetry import trace

from dualpath.bus import Bus, BusTimeoutError, HandlerError
from dualpath.core import (
    Command,
    Decision,
    Dispatch,
    DispatchAnswered,
    DispatchFailed,
    EngineReported,
    ExpelEngine,
    FailRequest,
    FreeSlot,
    NodeReported,
    Prefetch,
    RejectRequest,
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
from dualpath.policy.values import ReadSide, Role
from dualpath.protocol import RemoteError
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from dualpath.protocol.timeouts import TIMEOUTS
from dualpath.telemetry.logs import get_logger
from dualpath.telemetry.tracing import context_from, get_tracer

__all__ = ["SchedulerShell"]

_TICK_S = 0.05  # the longest the loop sleeps between passes
_ALIVE_S = 1.0  # heartbeat period (a gateway that missed the first one learns of a restart this late)
_FORCED = {m.ReadPath.PE: ReadSide.PE, m.ReadPath.DE: ReadSide.DE}
_WIRE_PATH = {ReadSide.PE: m.ReadPath.PE, ReadSide.DE: m.ReadPath.DE, None: m.ReadPath.NONE}

log = get_logger("scheduler")
tracer = get_tracer("dualpath.scheduler")


class SchedulerShell:
    """Turns the scheduler's messages into core events and the core's commands into bus calls."""

    def __init__(self, bus: Bus, subjects: Subjects, core: SchedulerCore, tasks: TaskGroup, instance: str = "") -> None:
        self.bus, self.subjects, self.core, self.tasks = bus, subjects, core, tasks
        self.instance = instance or uuid.uuid4().hex  # new at every start: gateways tell a restart by it
        self._wake = asyncio.Event()
        self._spans: dict[tuple[str, int], trace.Span] = {}  # open scheduler.decision span per (request, attempt)

    # ---- messages -> events ------------------------------------------------------------------
    async def on_submit(self, req: m.SubmitRequest) -> m.SubmitReply:
        forced = _FORCED.get(req.read_path)  # type: ignore[call-overload]
        cmds = self.core.handle(
            RequestSubmitted(
                now=time.monotonic(),
                request_id=req.request_id,
                prompt_tokens=len(req.prompt_tokens),
                hit_blocks=req.hit_blocks,
                block_tokens=req.block_tokens,
                max_tokens=int(req.sampling.get("max_tokens", 16)),
                forced_side=forced,
                payload=req,
                session=req.session,
                submission=req.submission,
            )
        )
        for c in cmds:
            if isinstance(c, RejectRequest):
                raise HandlerError(c.code, c.reason)
            if isinstance(c, StopAttempts):  # published before this request can be placed
                await self._stop_attempts(c)
        self.execute([c for c in cmds if not isinstance(c, StopAttempts)])
        self._wake.set()
        return m.SubmitReply(queue_position=self.core.queued, instance=self.instance)

    async def on_engine_report(self, r: m.EngineReport) -> None:
        if r.engine_id not in self.core.members.engines:
            log.info("engine_joined", engine=r.engine_id, node=r.node_id, role=Role(r.role).name.lower(), incarnation=r.incarnation)
        self.execute(
            self.core.handle(
                EngineReported(
                    now=time.monotonic(),
                    engine=r.engine_id,
                    node=r.node_id,
                    role=Role(r.role),
                    seq=r.seq,
                    tok=r.tok,
                    free_hbm_tokens=r.free_hbm_tokens,
                    capacity_tokens=r.capacity_tokens,
                    block_bytes=r.block_bytes,
                    finished=tuple(r.finished),
                    finished_attempts=tuple(r.finished_attempts),
                    holding=None if r.holding is None else tuple(r.holding),
                    holding_attempts=tuple(r.holding_attempts),
                    incarnation=r.incarnation,
                )
            )
        )
        self._wake.set()

    async def on_node_report(self, r: m.NodeReport) -> None:
        report = NodeReported(
            now=time.monotonic(),
            node=r.node_id,
            read_q_tokens=r.read_q_tokens,
            buffer_free_bytes=r.buffer_free_bytes,
            buffer_bytes=r.buffer_bytes,
        )
        self.execute(self.core.handle(report))
        self._wake.set()  # room in a decode node's buffer may let the queue move

    async def on_task_failed(self, f: m.TaskFailed) -> None:
        log.warning("task_failed", request_id=f.request_id, engine=f.engine_id, reason=f.reason, node_unreachable=f.node_unreachable)
        held = f.request_id in self.core.requests
        self.execute(
            self.core.handle(
                TaskFailed(
                    now=time.monotonic(),
                    request_id=f.request_id,
                    engine=f.engine_id,
                    reason=f.reason,
                    unreachable=f.unreachable,
                    attempt=f.attempt,
                    abandoned=f.abandoned,
                    node_unreachable=f.node_unreachable,
                )
            )
        )
        if held and f.request_id not in self.core.requests and f.abandoned:
            log.info("request_abandoned", request_id=f.request_id, engine=f.engine_id)
            self._end_spans(f.request_id)
        self._wake.set()

    async def on_state(self, _req: m.StateRequest) -> m.StateReply:
        core = self.core
        engines = [{"engine_id": e.name, "node": e.node, "role": int(e.role), "incarnation": e.incarnation} for e in core.engines()]
        nodes = [{"node_id": n.name, "read_q_tokens": n.read_q} for n in core.nodes()]
        return m.StateReply(
            prefill_engines=core.engine_count(Role.PREFILL),
            decode_engines=core.engine_count(Role.DECODE),
            nodes=len(nodes),
            queued=core.queued,
            running=core.running,
            policy=core.policy.name,
            engines=engines,
            node_states=nodes,
            buffer_waits=core.buffer_waits,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Tick the core whenever a message arrived, and at least every ``_TICK_S``."""
        while not stop.is_set():
            self._wake.clear()
            try:
                self.execute(self.core.handle(TimeAdvanced(now=time.monotonic())))
            except Exception:
                log.exception("schedule_pass_failed")
            with anyio.move_on_after(_TICK_S):
                await self._wake.wait()

    async def announce(self, stop: asyncio.Event, acting: Callable[[], bool] = lambda: True) -> None:
        """Publish this scheduler's instance now and every ``_ALIVE_S`` while ``acting()``: a
        gateway that hears a new one resubmits what the old one held (its state died with it)."""
        log.info("scheduler_announced", instance=self.instance)
        while not stop.is_set():
            if acting():
                beat = m.SubmitReply(queue_position=self.core.queued, instance=self.instance)
                try:
                    await self.bus.publish(self.subjects.sched_alive, beat)
                except Exception as exc:  # noqa: BLE001 - NATS restarting: the next beat says it
                    log.debug("heartbeat_failed", error=str(exc))
            with anyio.move_on_after(_ALIVE_S):
                await stop.wait()

    # ---- commands -> bus calls ---------------------------------------------------------------
    def execute(self, cmds: Sequence[Command]) -> None:
        """Start the bus call of each command (in order; each runs as its own task)."""
        for c in cmds:
            if isinstance(c, ReserveSlot):
                self._spans[(c.request_id, c.attempt)] = self._open_decision(c)
                self.tasks.start_soon(self._reserve, c)
            elif isinstance(c, Dispatch):
                self.tasks.start_soon(self._dispatch, c)
            elif isinstance(c, FreeSlot):
                free = (
                    m.FreeRequest(request_id=c.request_id, attempt=c.wire_attempt)
                    if c.wire_attempt >= 0
                    else m.FreeRequest(request_id=c.request_id, before_attempt=c.wire_before)
                )
                self.tasks.start_soon(self._free, c.node, free)
            elif isinstance(c, FailRequest):
                self._end_spans(c.request_id)
                self.tasks.start_soon(self._fail, c)
            elif isinstance(c, Requeued):
                if c.counted:
                    log.warning("request_retried", request_id=c.request_id, attempt=c.attempt, reason=c.reason)
            elif isinstance(c, StopAttempts):
                self.tasks.start_soon(self._stop_attempts, c)
            elif isinstance(c, ExpelEngine):
                log.warning("engine_lost", engine=c.engine, reason=c.reason, incarnation=c.incarnation)
                lost = m.EngineLost(engine_id=c.engine, incarnation=c.incarnation, reason=c.reason)
                self.tasks.start_soon(self._announce_lost, lost)
            elif isinstance(c, Prefetch):
                self.tasks.start_soon(self._prefetch, c)

    async def _announce_lost(self, lost: m.EngineLost) -> None:
        try:
            await self.bus.publish(self.subjects.engine_lost, lost)
        except Exception as exc:  # noqa: BLE001 - gateways then fall back to the request's timeout
            log.warning("engine_lost_announce_failed", engine=lost.engine_id, error=str(exc))

    async def _stop_attempts(self, c: StopAttempts) -> None:
        cancel = m.CancelRequest(request_id=c.request_id, reason=c.reason, before_attempt=c.before)
        try:
            await self.bus.publish(self.subjects.cancel, cancel)
        except Exception as exc:  # noqa: BLE001 - best effort: the old attempt then fails on its own
            log.warning("retry_cancel_failed", request_id=c.request_id, error=str(exc))

    async def _prefetch(self, c: Prefetch) -> None:
        """Hint the session's prompt blocks to the node (published: a lost hint costs nothing)."""
        r: m.SubmitRequest = c.payload
        full = len(r.prompt_tokens) // r.block_tokens
        try:
            await self.bus.publish(
                self.subjects.tm(c.node, "prefetch"),
                m.PrefetchRequest(session=c.session, model_digest=r.model_digest, hashes=r.block_hashes[:full]),
            )
        except Exception as exc:  # noqa: BLE001 - only a hint
            log.warning("prefetch_hint_failed", node=c.node, error=str(exc))

    def _feed(self, event) -> None:
        try:
            self.execute(self.core.handle(event))
        except Exception:
            log.exception("scheduler_event_failed", event=type(event).__name__)
        self._wake.set()

    async def _reserve(self, c: ReserveSlot) -> None:
        key = (c.request_id, c.attempt)
        span = self._spans.get(key, trace.INVALID_SPAN)
        with trace.use_span(span, end_on_exit=False):
            try:
                slot = await self.bus.request(
                    self.subjects.tm(c.node, "alloc"),
                    m.AllocRequest(
                        request_id=c.request_id, blocks=c.blocks, block_bytes=c.block_bytes, attempt=c.wire_attempt, instance=self.instance
                    ),
                    m.AllocReply,
                    timeout=TIMEOUTS.tm_alloc,
                )
                event: object = SlotReserved(
                    now=time.monotonic(), request_id=c.request_id, attempt=c.attempt, region=slot.region, offset=slot.offset
                )
            except RemoteError as exc:
                event = DispatchFailed(
                    now=time.monotonic(), request_id=c.request_id, attempt=c.attempt, stage=Stage.RESERVE, reason=str(exc), code=exc.code
                )
            except Exception as exc:  # noqa: BLE001 - any failure to reserve is the core's to handle
                # Nobody serves the node's traffic manager: the core stops using the node until it reports again.
                down = c.node if isinstance(exc, BusTimeoutError) and exc.no_responders else ""
                event = DispatchFailed(
                    now=time.monotonic(),
                    request_id=c.request_id,
                    attempt=c.attempt,
                    stage=Stage.RESERVE,
                    reason=str(exc),
                    node_unreachable=down,
                )
        self._feed(event)  # a slot reserved for an attempt that is over comes back as the core's FreeSlot
        if not (isinstance(event, SlotReserved) and self.core.is_current(*key)):
            self._end_span(key, error=getattr(event, "reason", ""))  # no Dispatch follows under this span

    async def _dispatch(self, c: Dispatch) -> None:
        key = (c.request_id, c.attempt)
        r: m.SubmitRequest = c.payload
        task = m.PrefillTask(
            request_id=r.request_id,
            model=r.model,
            model_digest=r.model_digest,
            prompt_tokens=r.prompt_tokens,
            block_hashes=r.block_hashes,
            hit_blocks=r.hit_blocks,
            sampling=r.sampling,
            reply_subject=r.reply_subject,
            read_path=int(_WIRE_PATH[c.read_side]),
            prefill_engine=c.prefill_engine,
            prefill_node=c.prefill_node,
            decode_engine=c.decode_engine,
            decode_node=c.decode_node,
            de_region=c.region,
            de_offset=c.offset,
            attempt=c.wire_attempt,
            policy=c.decision.policy,
            trace=r.trace,
            arrival_ts=r.arrival_ts,
            read_split=list(c.decision.read_split or ()),
            chain_root=r.chain_root,
        )
        with trace.use_span(self._spans.get(key, trace.INVALID_SPAN), end_on_exit=False):
            try:
                await self.bus.request(self.subjects.prefill(c.prefill_engine), task, m.Ok, timeout=TIMEOUTS.prefill_dispatch)
                event: object = DispatchAnswered(now=time.monotonic(), request_id=c.request_id, attempt=c.attempt)
            except Exception as exc:  # noqa: BLE001 - any dispatch failure is the core's to handle
                # Nobody listens on the engine's subject: the core stops sending it more.
                unreachable = c.prefill_engine if isinstance(exc, BusTimeoutError) else ""
                event = DispatchFailed(
                    now=time.monotonic(),
                    request_id=c.request_id,
                    attempt=c.attempt,
                    stage=Stage.DISPATCH,
                    reason=str(exc),
                    code=exc.code if isinstance(exc, RemoteError) else 0,
                    unreachable=unreachable,
                )
        self._end_span(key, error=getattr(event, "reason", ""))
        self._feed(event)

    async def _free(self, node: str, req: m.FreeRequest) -> None:
        try:
            await self.bus.request(self.subjects.tm(node, "free"), req, m.Ok, timeout=TIMEOUTS.tm_free)
        except Exception as exc:  # noqa: BLE001 - the node may be the one that died
            log.debug("free_failed", request_id=req.request_id, node=node, error=str(exc))

    async def _fail(self, c: FailRequest) -> None:
        r: m.SubmitRequest = c.payload
        await self.bus.publish(
            r.reply_subject,
            m.TokenEvent(request_id=c.request_id, index=0, token_ids=[], finish_reason="error", error=c.reason, error_code=c.code),
        )

    # ---- spans ------------------------------------------------------------------------------
    def _open_decision(self, c: ReserveSlot) -> trace.Span:
        """The queue wait as a span, then the decision span (ended when the dispatch is answered)."""
        r: m.SubmitRequest = c.payload
        d: Decision = c.decision
        parent = context_from(r.trace)
        now_ns = time.time_ns()
        queued_ns = now_ns - int(max(0.0, time.monotonic() - d.queued_since) * 1e9)
        queued = tracer.start_span("scheduler.queue", context=parent, start_time=queued_ns)
        if queued.is_recording():
            queued.set_attributes({"request_id": c.request_id, "attempt": c.attempt, "queue_len": d.queue_len})
        queued.end(end_time=now_ns)
        span = tracer.start_span("scheduler.decision", context=parent)
        if span.is_recording():
            side = d.policy_side
            path = _WIRE_PATH[d.read_side]
            span.set_attributes(
                {
                    "request_id": c.request_id,
                    "policy": d.policy,
                    "prefill_engine": d.prefill_engine,
                    "decode_engine": d.decode_engine,
                    "prefill_node": d.prefill_node,
                    "decode_node": d.decode_node,
                    "read_side": "pe" if side == ReadSide.PE else "de",
                    "read_path": path.name.lower(),
                    "hit_tokens": d.hit_tokens,
                    "prefill_tokens": d.prefill_tokens,
                    "decode_tokens": d.decode_tokens,
                    "attempt": c.attempt,
                    **d.seen,
                }
            )
            if d.read_split is not None:
                span.set_attribute("read_split", list(d.read_split))
        return span

    def _end_span(self, key: tuple[str, int], error: str = "") -> None:
        span = self._spans.pop(key, None)
        if span is not None:
            if error:
                span.set_status(trace.Status(trace.StatusCode.ERROR, error))
            span.end()

    def _end_spans(self, request_id: str) -> None:
        for key in [k for k in self._spans if k[0] == request_id]:
            self._end_span(key)
