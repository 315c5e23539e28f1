"""``Scheduler``: the queue, the policy pass, dispatch, and recovery from failures.

One pass (``schedule_pass``) hands the FIFO queue to the policy (``dualpath.policy``), applies
each assignment to the policy state, and dispatches it: reserve the DE buffer slot on the
decode node, then send the ``PrefillTask`` to the prefill engine. Requests that cannot be
placed stay queued in order. A request whose engine dies or fails is re-queued at the front
(up to ``max_attempts``), else its client gets an error event: never silence.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass

from dualpath.bus import Bus, BusTimeoutError
from dualpath.bus.client import HandlerError
from dualpath.config import SchedulerConfig
from dualpath.policy import PendingRequest, Policy
from dualpath.policy.values import Assignment, ReadSide
from dualpath.protocol import RemoteError
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from dualpath.protocol.timeouts import TIMEOUTS
from dualpath.telemetry.logs import get_logger
from dualpath.telemetry.tracing import context_from, get_tracer, tracing_enabled
from services.scheduler.membership import Membership

__all__ = ["Scheduler"]

_PASS_WINDOW = 1024  # queued requests one policy pass considers
_BUFFER_BACKOFF_S = 0.02  # after a full decode-node buffer, wait this long before the next pass
_BUFFER_WAIT_S = 600.0  # a request waiting longer than this for buffer room fails (then counts attempts)

log = get_logger("scheduler")
tracer = get_tracer("dualpath.scheduler")


@dataclass(slots=True, kw_only=True)
class Tracked:
    req: m.SubmitRequest
    num: int
    attempt: int = 0
    buffer_waits: int = 0  # attempts that ended in back-pressure, not failure
    buffer_wait_start: float = 0.0  # monotonic time of the first back-pressure (0: none yet)
    prefill_engine: str = ""
    decode_engine: str = ""
    decode_node: str = ""
    prefill_done: bool = False
    assignment: Assignment | None = None
    enqueued_ns: int = 0  # when it (re-)entered the queue, for its trace
    seen: dict | None = None  # what the policy compared when it placed it (traced runs only)


class Scheduler:
    def __init__(self, bus: Bus, subjects: Subjects, cfg: SchedulerConfig, policy: Policy) -> None:
        self.bus, self.subjects, self.cfg, self.policy = bus, subjects, cfg, policy
        self.members = Membership(cfg.engine_timeout)
        self.state = None
        self.queue: deque[Tracked] = deque()
        self.running: dict[str, Tracked] = {}
        self.by_num: dict[int, Tracked] = {}
        self._next_num = 0
        self._wake = asyncio.Event()
        self._dispatches: set[asyncio.Task] = set()
        self._hold_until = 0.0  # no passes before this (monotonic): back-pressure from a full buffer
        self.buffer_waits = 0  # dispatches put back because the decode node's buffer was full

    # ---- intake ----------------------------------------------------------------------------
    async def on_submit(self, req: m.SubmitRequest) -> m.SubmitReply:
        if len(self.queue) >= self.cfg.max_queue:
            raise HandlerError(429, f"scheduler queue full ({self.cfg.max_queue} requests waiting)")
        if req.request_id in self.running or any(t.req.request_id == req.request_id for t in self.queue):
            raise HandlerError(409, f"request {req.request_id} already submitted")
        if not req.prompt_tokens:
            raise HandlerError(400, "empty prompt")
        need = len(req.prompt_tokens) + int(req.sampling.get("max_tokens", 16))
        if self.state is not None and need > self.state.max_decode_hbm_tokens:
            # It could never be placed and would block the FIFO queue behind it.
            raise HandlerError(400, f"prompt plus max_tokens ({need} tokens) exceeds the KV capacity of every decode engine "
                                    f"({self.state.max_decode_hbm_tokens} tokens)")
        num = self._next_num
        self._next_num += 1
        t = Tracked(req=req, num=num, enqueued_ns=time.time_ns())
        self.by_num[num] = t
        self.queue.append(t)
        self._wake.set()
        return m.SubmitReply(queue_position=len(self.queue))

    async def on_engine_report(self, r: m.EngineReport) -> None:
        now = time.monotonic()
        if self.members.engine_report(r, now):
            log.info("engine_joined", engine=r.engine_id, node=r.node_id, role=int(r.role))
            self._rebuild()
        for rid in r.finished:
            t = self.running.get(rid)
            if t is None or self.state is None:
                continue
            if r.role == m.Role.PREFILL and t.prefill_engine == r.engine_id:
                t.prefill_done = True
                self._safe(self.state.on_prefill_finished, t.num)
            elif r.role == m.Role.DECODE and t.decode_engine == r.engine_id:
                self._forget(t)
        self._wake.set()

    async def on_node_report(self, r: m.NodeReport) -> None:
        info = self.members.node_report(r, time.monotonic())
        if self.state is not None and info.num in self.state.nodes:
            self.state.report_node(info.num, read_q=r.read_q_tokens)

    async def on_task_failed(self, f: m.TaskFailed) -> None:
        t = self.running.get(f.request_id)
        if t is None:
            return
        log.warning("task_failed", request_id=f.request_id, engine=f.engine_id, reason=f.reason)
        if f.unreachable:
            await self._expel([f.unreachable])
        if self.running.get(f.request_id) is t:
            await self._retry(t, f.reason)

    async def on_state(self, _req: m.StateRequest) -> m.StateReply:
        engines = [{"engine_id": e.name, "node": e.node, "role": int(e.role)} for e in self.members.engines.values()]
        nodes = [{"node_id": n.name, "read_q_tokens": n.read_q_tokens} for n in self.members.nodes.values()]
        return m.StateReply(prefill_engines=self.members.count(m.Role.PREFILL), decode_engines=self.members.count(m.Role.DECODE),
                            nodes=len(self.members.nodes), queued=len(self.queue), running=len(self.running), policy=self.policy.name,
                            engines=engines, node_states=nodes, buffer_waits=self.buffer_waits)

    # ---- state -----------------------------------------------------------------------------
    def _safe(self, fn, *args) -> None:
        try:
            fn(*args)
        except LookupError:
            pass  # the state was rebuilt after this request was placed

    def _forget(self, t: Tracked) -> None:
        self.running.pop(t.req.request_id, None)
        self.by_num.pop(t.num, None)
        if self.state is not None:
            self._safe(self.state.on_finished, t.num)

    def _rebuild(self) -> None:
        """New policy state after a membership change; live requests are re-charged."""
        self.state = self.members.cluster_state()
        if self.state is None:
            return
        engine_num = {e.name: e.num for e in self.members.engines.values()}
        for t in self.running.values():
            a = t.assignment
            if a is not None and t.prefill_engine in engine_num and t.decode_engine in engine_num:
                self._safe(self.state.on_assigned, a)

    async def expire(self) -> None:
        """Drop silent engines and re-dispatch whatever they held."""
        dead = self.members.expire(time.monotonic())
        if dead:
            await self._lost({e.name for e in dead})

    async def _expel(self, names: list[str]) -> None:
        """Stop using engines that did not answer (they re-join with their next report)."""
        gone = {n for n in names if self.members.engines.pop(n, None) is not None}
        if gone:
            await self._lost(gone)

    async def _lost(self, names: set[str]) -> None:
        log.warning("engines_lost", engines=sorted(names))
        self._rebuild()
        for t in list(self.running.values()):
            if t.decode_engine in names or (t.prefill_engine in names and not t.prefill_done):
                await self._retry(t, f"engine {t.prefill_engine if t.prefill_engine in names else t.decode_engine} stopped reporting")

    async def _retry(self, t: Tracked, reason: str, *, count: bool = True) -> None:
        """Put ``t`` back at the head of the queue; ``count=False`` (back-pressure: a full node
        buffer) does not use up one of its ``max_attempts``."""
        if count:
            log.warning("request_retried", request_id=t.req.request_id, attempt=t.attempt + 1, reason=reason)
        self.running.pop(t.req.request_id, None)
        if self.state is not None:
            self._safe(self.state.on_finished, t.num)
        await self._free_slot(t)
        t.attempt += 1  # also when not counted: a dispatch still in flight for the old attempt is stale
        if not count:
            t.buffer_waits += 1
        if t.attempt - t.buffer_waits >= self.cfg.max_attempts:
            self.by_num.pop(t.num, None)
            await self.bus.publish(t.req.reply_subject, m.TokenEvent(request_id=t.req.request_id, index=0, token_ids=[], finish_reason="error",
                                                                     error=f"request failed after {t.attempt} attempts: {reason}", error_code=503))
            return
        t.prefill_engine = t.decode_engine = t.decode_node = ""
        t.prefill_done = False
        t.assignment = None
        t.enqueued_ns = time.time_ns()
        self.queue.appendleft(t)
        self._wake.set()

    async def _free_slot(self, t: Tracked) -> None:
        if t.decode_node:
            await self._free_on(t.decode_node, t.req.request_id)

    async def _free_on(self, node: str, request_id: str) -> None:
        try:
            await self.bus.request(self.subjects.tm(node, "free"), m.FreeRequest(request_id=request_id), m.Ok, timeout=TIMEOUTS.tm_free)
        except Exception:  # noqa: BLE001 - the node may be the one that died
            pass

    # ---- scheduling ------------------------------------------------------------------------
    def _pending(self) -> list[PendingRequest]:
        """The head of the FIFO queue as policy input. The policy places a prefix and stops at
        the first request that does not fit, so one pass never needs more than the head:
        converting a 10k-deep queue every 50 ms would be wasted work."""
        out = []
        for t in itertools.islice(self.queue, _PASS_WINDOW):
            r = t.req
            hit = min(r.hit_blocks * r.block_tokens, len(r.prompt_tokens) - 1)
            out.append(PendingRequest(request_id=t.num, prompt_tokens=len(r.prompt_tokens), hit_tokens=hit,
                                      total_len=len(r.prompt_tokens) + int(r.sampling.get("max_tokens", 16))))
        return out

    async def schedule_pass(self) -> int:
        """Place what fits now; returns how many requests were dispatched."""
        if self.state is None or not self.queue or time.monotonic() < self._hold_until:
            return 0
        assignments = self.policy.schedule(self._pending(), self.state)
        for a in assignments:
            t = self.queue.popleft()
            assert t.num == a.request_id, "policy must place a FIFO prefix"
            t.seen = self._seen(a) if tracing_enabled() else None
            self.state.on_assigned(a)
            t.assignment = a
            t.prefill_engine = self.members.by_engine_num[a.prefill_engine]
            t.decode_engine = self.members.by_engine_num[a.decode_engine]
            t.decode_node = self.members.engines[t.decode_engine].node
            self.running[t.req.request_id] = t
            task = asyncio.ensure_future(self._dispatch(t, a))
            self._dispatches.add(task)
            task.add_done_callback(self._dispatches.discard)
        return len(assignments)

    def _seen(self, a: Assignment) -> dict:
        """The figures the policy compared for ``a``, before ``a`` is charged (span attributes).

        Earlier placements of the same pass are already charged, as in the policy's own pass.
        """
        st = self.state
        pe, de = st.engines[a.prefill_engine], st.engines[a.decode_engine]
        seen = {"read_q_pe": st.nodes[pe.node_id].read_q, "read_q_de": st.nodes[de.node_id].read_q,
                "tok_e_prefill": pe.tok, "seq_e_prefill": pe.seq, "tok_e_decode": de.tok, "seq_e_decode": de.seq,
                "free_hbm_decode": de.free_hbm_tokens}
        if len(st.engines) <= 32:  # the whole field the policy chose from, while it stays readable
            names = self.members.by_engine_num
            seen["prefill_candidates"] = [f"{names.get(e.engine_id, e.engine_id)}:{e.tok}" for e in st.prefill_engines]
            seen["decode_candidates"] = [f"{names.get(e.engine_id, e.engine_id)}:{e.tok}" for e in st.decode_engines]
        return seen

    def _read_path(self, t: Tracked, a) -> int:
        if t.req.hit_blocks == 0:
            return m.ReadPath.NONE
        forced = t.req.read_path
        if forced in (m.ReadPath.PE, m.ReadPath.DE):
            return forced
        return m.ReadPath.PE if a.read_side == ReadSide.PE else m.ReadPath.DE

    def _trace_decision(self, t: Tracked, a: Assignment, read_path: int, pe_node: str):
        """The queue wait as a span, then the decision span (current until dispatch ends)."""
        parent = context_from(t.req.trace)
        now = time.time_ns()
        queued = tracer.start_span("scheduler.queue", context=parent, start_time=t.enqueued_ns or now)
        if queued.is_recording():
            queued.set_attributes({"request_id": t.req.request_id, "attempt": t.attempt, "queue_len": len(self.queue)})
        queued.end(end_time=now)
        attrs = {"request_id": t.req.request_id, "policy": self.policy.name, "prefill_engine": t.prefill_engine,
                 "decode_engine": t.decode_engine, "prefill_node": pe_node, "decode_node": t.decode_node,
                 "read_side": "pe" if a.read_side == ReadSide.PE else "de",
                 "read_path": {1: "pe", 2: "de", 3: "none"}[int(read_path)], "hit_tokens": a.read_tokens,
                 "prefill_tokens": a.prefill_tokens, "decode_tokens": a.decode_tokens, "attempt": t.attempt, **(t.seen or {})}
        return tracer.start_as_current_span("scheduler.decision", context=parent, attributes=attrs)

    async def _dispatch(self, t: Tracked, a) -> None:
        """Reserve the DE slot, then hand the task to the PE. Works on a snapshot of the
        placement: if the request was re-queued meanwhile (its engine was lost), this
        attempt is stale and ends quietly instead of failing the new one."""
        r, attempt = t.req, t.attempt
        pe, de, de_node = t.prefill_engine, t.decode_engine, t.decode_node
        read_path = self._read_path(t, a)
        pe_node = self.members.engines[pe].node if pe in self.members.engines else ""

        def current() -> bool:
            return self.running.get(r.request_id) is t and t.attempt == attempt

        with self._trace_decision(t, a, read_path, pe_node):
            try:
                block_bytes = self.members.engines[de].block_bytes
                blocks = -(-len(r.prompt_tokens) // r.block_tokens)
                slot = await self.bus.request(self.subjects.tm(de_node, "alloc"),
                                              m.AllocRequest(request_id=r.request_id, blocks=blocks, block_bytes=block_bytes), m.AllocReply,
                                              timeout=TIMEOUTS.tm_alloc)
                if not current():
                    # Re-queued meanwhile: release this slot unless the new attempt already holds
                    # it (placed again on the same node; an allocation is idempotent per request).
                    if not (self.running.get(r.request_id) is t and t.decode_node == de_node):
                        await self._free_on(de_node, r.request_id)
                    return
                task = m.PrefillTask(request_id=r.request_id, model=r.model, model_digest=r.model_digest, prompt_tokens=r.prompt_tokens,
                                     block_hashes=r.block_hashes, hit_blocks=r.hit_blocks, sampling=r.sampling, reply_subject=r.reply_subject,
                                     read_path=int(read_path), prefill_engine=pe, prefill_node=pe_node,
                                     decode_engine=de, decode_node=de_node, de_region=slot.region, de_offset=slot.offset,
                                     attempt=attempt, policy=self.policy.name, trace=r.trace, arrival_ts=r.arrival_ts)
                await self.bus.request(self.subjects.prefill(pe), task, m.Ok, timeout=TIMEOUTS.prefill_dispatch)
            except RemoteError as exc:
                if current():
                    now, full = time.monotonic(), exc.code == m.BUFFER_FULL
                    if full:
                        t.buffer_wait_start = t.buffer_wait_start or now
                    if full and now - t.buffer_wait_start < _BUFFER_WAIT_S:
                        # The DE node's buffer holds requests between prefill and decode: wait
                        # for one to move on instead of failing this one.
                        self.buffer_waits += 1
                        self._hold_until = now + _BUFFER_BACKOFF_S
                        await self._retry(t, "decode node buffer full", count=False)
                    else:
                        await self._retry(t, f"dispatch failed: {exc}")
            except Exception as exc:  # noqa: BLE001 - any dispatch failure is retried
                if isinstance(exc, BusTimeoutError) and exc.subject == self.subjects.prefill(pe):
                    await self._expel([pe])  # nobody listens there: do not send it more
                if current():
                    await self._retry(t, f"dispatch failed: {exc}")

    async def run(self, stop: asyncio.Event) -> None:
        """Schedule whenever something changed, and at least every 50 ms; expire silent engines."""
        while not stop.is_set():
            self._wake.clear()
            try:
                await self.expire()
                await self.schedule_pass()
            except Exception:  # noqa: BLE001 - a bug in one pass must not stop scheduling
                log.exception("schedule_pass_failed")
            try:
                await asyncio.wait_for(self._wake.wait(), 0.05)
            except asyncio.TimeoutError:
                pass
