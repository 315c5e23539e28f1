"""``DecodeEngine``: admits prefilled requests, decodes them together, streams, persists blocks.

The decisions (which requests run, KV-memory admission, when a block is full, when a request
leaves) are ``DecodeBatcher``'s, a core with no I/O; this class drives it through the loop
phases of ``run``: receive (admission) -> next batch -> run (one decode step) -> process
result (sample, stream, persist filled blocks, answer the finished).

Admission moves a request's complete prompt KV from the DE buffer slot (same node: shared
memory) into the engine's KV memory, then asks the node's traffic manager to persist the
prompt's new full blocks from the slot and free it. Each step decodes one token for every
running request; whenever a request's KV fills a block, the block goes to storage the same
way (through a small staging slot). When a request ends on a token that completes a block,
one more forward computes that token's KV so every full block of the context is persisted.

Attempts: which run of a request is current, and what happens to the others, is decided by
the attempt core (``dualpath.core.attempts.AttemptTable``: newest attempt wins, retired
attempts refused, a hand-off that crossed its client's cancel ends on arrival). This engine
keeps that table as its one table of requests, with ``DecodePhase`` as each one's phase, and
carries out its commands: a refused, discarded or dropped attempt's buffer slot is given back
(slots are per attempt); a halted one stops at the next step, silently when superseded (no
more token events, no final event, not reported finished), reported finished when its client
cancelled it.

Tracing: each request has a ``decode.request`` span (child of the request's root, from the
task's ``trace`` carrier) from arrival to its final event, with ``decode.admit`` and one
``kv.persist`` per persist request under it; no span per step or token.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import anyio
import torch
from anyio.abc import TaskGroup
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from dualpath.bus import Bus
from dualpath.config import EngineConfig
from dualpath.core.attempts import Attempt, AttemptCommand, AttemptTable, Discard, Drop, Halt, Refuse, Start, Stop
from dualpath.core.batch_errors import BatcherError
from dualpath.core.decode_batcher import CANCELLED, DecodeBatcher, DecodeStep
from dualpath.engine.common import EngineSetup, FinishedReports, read_path_name
from dualpath.engine.decode import DecodeSequence, KvMemory, decode_step_async
from dualpath.kv import block_hashes
from dualpath.model.sampling import SamplingParams, grammar_constraint, sample
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from dualpath.protocol.timeouts import TIMEOUTS
from dualpath.runtime import start_logged, wait_any
from dualpath.telemetry.logs import get_logger
from dualpath.telemetry.tracing import context_from, get_tracer
from dualpath.transfer import MemoryRegion

if TYPE_CHECKING:
    from dualpath.structured.constraint import TokenConstraint

__all__ = ["DecodeEngine"]

log = get_logger("decode-engine")
tracer = get_tracer("dualpath.decode")


@dataclass(slots=True, kw_only=True)
class Running:
    held: Attempt[m.DecodeTask]  # the attempt table's entry of this run
    seq: DecodeSequence
    params: SamplingParams
    gen: torch.Generator | None
    chain: list[int]  # hash chain of the persisted/persisting full blocks
    finish: str | None = None  # set when done; the request leaves after a final KV flush if needed
    persist_tail: anyio.Event | None = None  # set when the request's last persist ended: commits must go parent first
    t_start: float = field(default_factory=time.perf_counter)
    decode_s: float = 0.0  # admission to last token (set when it leaves)
    span: trace.Span = trace.INVALID_SPAN  # decode.request
    unsent: list = field(default_factory=list)  # (token, logprob, top) not yet streamed (stream interval)
    constraint: TokenConstraint | None = None  # the request's grammar state (structured outputs), the first token replayed
    persist_off: bool = False  # a generated block could not be staged: its later blocks are not persisted either

    @property
    def task(self) -> m.DecodeTask:
        return self.held.task

    @property
    def superseded(self) -> bool:
        """A newer attempt replaced it (or a retry retired it): it leaves without events or a report."""
        return self.held.stop is Stop.SUPERSEDED


class DecodePhase(Enum):
    """Where a request held by the decode engine is (``AttemptTable``'s phase)."""

    LOADING = "loading"  # its prompt KV still crossing the emulated CNIC (testbed)
    WAITING = "waiting"  # in the batcher's waiting queue
    ADMITTING = "admitting"  # its prompt KV moving into KV memory
    RUNNING = "running"  # decoding (``Attempt.state`` is its ``Running``)

    @property
    def queued(self) -> bool:
        return self in (DecodePhase.LOADING, DecodePhase.WAITING)


Held = Attempt[m.DecodeTask]


class DecodeEngine:
    def __init__(self, bus: Bus, subjects: Subjects, cfg: EngineConfig, node_id: str, setup: EngineSetup, tasks: TaskGroup) -> None:
        self.bus, self.subjects, self.cfg, self.node_id, self.setup = bus, subjects, cfg, node_id, setup
        self.tasks = tasks  # the service's task group: H2D copies, persists and final events run there
        d = setup.decoder
        self.memory = KvMemory(
            layers=d.num_layers,
            spec=d.kv_spec,
            dtype=d.dtype,
            device=d.device,
            capacity_tokens=cfg.kv_capacity_tokens,
            block_tokens=setup.layout.block_tokens,
        )
        self.batcher = DecodeBatcher(
            capacity_tokens=cfg.kv_capacity_tokens, block_tokens=setup.layout.block_tokens, max_running=cfg.max_running
        )
        # The one table of requests: each one's current attempt (its phase, its Running once
        # admitted), the successor waiting for it, the attempts retired and the cancels that
        # came before their hand-off (a hand-off that crossed its client's cancel ends on arrival).
        self.requests: AttemptTable[m.DecodeTask] = AttemptTable(DecodePhase.WAITING, remember_cancels=True)
        self.finished: list[tuple[str, int]] = []  # (request, attempt) done since the last report
        self._named = FinishedReports()  # each finish is named in 3 reports in a row
        self._regions: dict[str, MemoryRegion] = {}
        self._wake = asyncio.Event()
        self.incarnation = uuid.uuid4().hex[:12]  # this process (reports and token events name it)
        self.served_by = f"{cfg.engine_id}@{self.incarnation}"
        self._arrived_ns: dict[str, int] = {}  # task arrival, where decode.request spans start
        self.busy_s = 0.0  # wall time inside decode steps
        self.observer = setup.observer  # told each step's start and end (testbed: host time per step, in stats)

    def count(self, *phases: DecodePhase) -> int:
        """Requests held in any of ``phases``."""
        return len(self.requests.in_phase(*phases))

    def running(self, rid: str) -> Running:
        """The ``Running`` of a request the batcher runs."""
        held = self.requests.get(rid)
        assert held is not None and held.state is not None, rid
        return held.state

    # ---- intake ----------------------------------------------------------------------------
    async def on_task(self, task: m.DecodeTask) -> m.Ok:
        """Take a hand-off: a new request, a newer attempt of one held here (it replaces the old
        run), or an older / retired attempt (refused: ``superseded``)."""
        return m.Ok(detail=await self._apply(self.requests.arrive(task.request_id, task.attempt, task)))

    async def on_cancel(self, req: m.CancelRequest) -> None:
        """A client's cancel stops the request (reported finished); the scheduler's retry cancel
        (``before_attempt``) stops older attempts only, silently (see the module docstring)."""
        await self._apply(self.requests.cancel(req.request_id, req.before_attempt))

    async def _apply(self, cmds: list[AttemptCommand[m.DecodeTask]]) -> str:
        """Carry out the attempt core's commands; the detail of a refusal, else ""."""
        detail = ""
        for c in cmds:
            if isinstance(c, Start):
                await self._intake(c.run)
            elif isinstance(c, Refuse):
                detail = c.detail
                t = c.task
                log.info("decode_task_refused", request_id=t.request_id, attempt=t.attempt, detail=c.detail)
                if c.detail != "duplicate":
                    self._free_slot(t)
                if c.detail == Stop.CANCELLED.value:  # its client cancelled it before the hand-off came
                    self.finished.append((t.request_id, t.attempt))  # the scheduler forgets the request
            elif isinstance(c, Discard):  # a successor that never started
                self._free_slot(c.task)
                if c.why is Stop.CANCELLED:
                    self.finished.append((c.task.request_id, c.task.attempt))
            elif isinstance(c, Drop):  # loading or waiting: nothing of it runs yet
                held, rid = c.run, c.run.request_id
                log.info("decode_task_dropped", request_id=rid, attempt=held.attempt, why=held.stop.value if held.stop else "")
                if held.phase is DecodePhase.WAITING:
                    self.batcher.evict(rid)
                self._arrived_ns.pop(rid, None)
                self._free_slot(held.task)
                if held.stop is Stop.CANCELLED:
                    self.finished.append((rid, held.attempt))
            elif isinstance(c, Halt):  # admitting or running: it leaves at the loop's next pass
                self._halt(c.run)
        return detail

    def _halt(self, held: Held) -> None:
        """Stop an admitted run at the next step: silently when superseded (no more token
        events, no final event, not reported finished), as cancelled by its client otherwise.
        One still being admitted is stopped as soon as it is (``_receive``)."""
        rid = held.request_id
        r: Running | None = held.state
        if held.stop is Stop.SUPERSEDED:
            log.info("decode_task_superseded", request_id=rid, attempt=held.attempt)
            if r is not None:
                r.finish = CANCELLED
                r.unsent.clear()
                self.batcher.finish(rid, CANCELLED)
        else:
            if r is not None and r.finish is None:
                r.finish = CANCELLED
            self.batcher.finish(rid, CANCELLED)
        self._wake.set()

    async def _intake(self, held: Held) -> None:
        task = held.task
        try:  # the slot is in use now, whichever scheduler reserved it (the traffic manager's reclaim)
            await self.bus.publish(self.subjects.tm(self.node_id, "claim"), m.SlotClaimed(request_id=task.request_id, attempt=task.attempt))
        except Exception as exc:  # noqa: BLE001 - only matters if its scheduler died meanwhile
            log.warning("slot_claim_failed", request_id=task.request_id, error=str(exc))
        nic = self.setup.nic
        if nic is not None and not self.setup.oracle:
            # Testbed: the prompt KV's H2D goes through the GPU's CNIC (both directions: a
            # loopback) while the running batch keeps decoding; the request joins once it landed.
            self.requests.move(held, DecodePhase.LOADING)
            start_logged(self.tasks, f"h2d:{task.request_id}", self._h2d_then_add, held, nic)
            return
        await self._add(held)

    async def _h2d_then_add(self, held: Held, nic) -> None:
        lay = self.setup.layout
        try:
            await nic.copy(lay.blocks_for(len(held.task.prompt_tokens)) * lay.block_bytes)
        except Exception as exc:  # noqa: BLE001 - the emulated copy failed: the scheduler retries the request
            if self.requests.get(held.request_id) is held:
                await self._fail(held, f"prompt KV copy failed: {type(exc).__name__}: {exc}")
            return
        if self.requests.get(held.request_id) is held:  # else it was dropped while it loaded
            await self._add(held)

    def _free_slot(self, task: m.DecodeTask) -> None:
        """Give back the DE buffer slot of an attempt that will never be admitted (this node's)."""

        async def free() -> None:
            req = m.FreeRequest(request_id=task.request_id, attempt=task.attempt)
            try:
                await self.bus.request(self.subjects.tm(self.node_id, "free"), req, m.Ok, timeout=TIMEOUTS.tm_free)
            except Exception as exc:  # noqa: BLE001 - a reservation nobody claims is given back by the traffic manager
                log.warning("slot_free_failed", request_id=task.request_id, attempt=task.attempt, error=str(exc))

        start_logged(self.tasks, f"free:{task.request_id}", free)

    async def _add(self, held: Held) -> None:
        task = held.task
        try:
            max_tokens = SamplingParams(**task.sampling).max_tokens
            self.batcher.add(task.request_id, prompt_tokens=len(task.prompt_tokens), max_tokens=max_tokens)
        except (BatcherError, ValueError, TypeError) as exc:  # a request this engine can never hold, or bad sampling
            await self._fail(held, str(exc))
            return
        self.requests.move(held, DecodePhase.WAITING)
        self._arrived_ns[task.request_id] = time.time_ns()
        self._wake.set()

    def _region(self, region_id: str) -> MemoryRegion:
        region = self._regions.get(region_id)
        if region is None or not region.is_current():  # not current: the node's traffic manager restarted
            region = self._regions[region_id] = MemoryRegion.attach(region_id)
        return region

    def _admit(self, held: Held) -> Running:
        """Copy the prompt KV from the DE buffer slot into KV memory (the DE's H2D)."""
        task = held.task
        lay = self.setup.layout
        d = self.setup.decoder
        n = len(task.prompt_tokens)
        nb = lay.blocks_for(n)
        kv = self.memory.allocate(n + 1)
        if not self.setup.oracle:
            slot = self._region(task.de_region_id).as_tensor(task.de_offset, nb * lay.block_bytes, d.dtype)
            width = d.kv_spec.width
            slot = slot.view(nb, lay.layers, lay.block_tokens, width)  # [blocks, layers, bt, width]
            tokens = slot.permute(1, 0, 2, 3).reshape(lay.layers, nb * lay.block_tokens, width)[:, :n]
            self.memory.tokens(kv)[:, :n].copy_(d.kv_spec.as_rows(tokens))  # into KV memory's head-major layout
        params = SamplingParams(**task.sampling)
        gen = torch.Generator(device="cpu").manual_seed(params.seed + 1) if params.seed is not None else None
        seq = DecodeSequence(
            request_id=task.request_id, tokens=list(task.prompt_tokens) + [task.first_token], kv=kv, kv_len=n, generated=[task.first_token]
        )
        full = n // lay.block_tokens
        return Running(
            held=held,
            seq=seq,
            params=params,
            gen=gen,
            chain=list(task.block_hashes[:full]),
            constraint=grammar_constraint(params, self.setup.model_dir, prefix=[task.first_token]),
        )

    # ---- persistence -----------------------------------------------------------------------
    def _persist_prompt(self, r: Running) -> None:
        """Persist the prompt's full blocks that were not hits, straight from the slot, then free it."""
        t, lay = r.task, self.setup.layout
        full = len(t.prompt_tokens) // lay.block_tokens
        new = r.chain[t.cached_blocks : full]
        req = m.PersistRequest(
            request_id=t.request_id,
            model_digest=t.model_digest,
            region_id=t.de_region_id,
            offset=t.de_offset + t.cached_blocks * lay.block_bytes,
            hashes=new,
            parent_chain=r.chain[: t.cached_blocks],
            layers=lay.layers,
            bytes_per_token_layer=lay.bytes_per_token_layer,
            dtype=self.setup.dtype,
            block_tokens=lay.block_tokens,
            kv_layout=lay.kv_layout,
            free_after=True,
            attempt=t.attempt,
        )
        self._spawn_persist(r, req)

    async def _persist_block(self, r: Running, b: int) -> None:
        """Stage block ``b`` of a running sequence in the node buffer and persist it.

        Persistence is best effort: when the traffic manager cannot stage the block (its buffer
        is full, it is restarting, it does not answer) the request keeps decoding and its later
        blocks are not persisted either (the index only links a block after its parent)."""
        if r.persist_off:
            return
        lay, d, t = self.setup.layout, self.setup.decoder, r.task
        bt = lay.block_tokens
        parent = r.chain[-1] if r.chain else t.chain_root  # a prompt shorter than a block: the chain starts at its root
        h = block_hashes(t.model, r.seq.tokens[b * bt : (b + 1) * bt], block_tokens=bt, parent=parent)[0]
        parents = list(r.chain)
        owner = f"{t.request_id}-g{b}"
        try:
            reply = await self.bus.request(
                self.subjects.tm(self.node_id, "alloc"),
                m.AllocRequest(request_id=owner, blocks=1, block_bytes=lay.block_bytes, attempt=t.attempt),
                m.AllocReply,
                timeout=TIMEOUTS.tm_alloc,
            )
        except Exception as exc:  # noqa: BLE001 - any refusal or loss of the traffic manager: decoding goes on
            r.persist_off = True
            log.warning("persist_skipped", request_id=t.request_id, block=b, error=f"{type(exc).__name__}: {exc}")
            return
        r.chain.append(h)
        region = self._region(reply.region["region_id"])
        dst = region.as_tensor(reply.offset, lay.block_bytes, d.dtype).view(lay.layers, bt, d.kv_spec.width)
        d.kv_spec.as_rows(dst).copy_(self.memory.tokens(r.seq.kv)[:, b * bt : (b + 1) * bt])  # token-major again
        self._spawn_persist(
            r,
            m.PersistRequest(
                request_id=owner,
                model_digest=t.model_digest,
                region_id=region.region_id,
                offset=reply.offset,
                hashes=[h],
                parent_chain=parents,
                layers=lay.layers,
                bytes_per_token_layer=lay.bytes_per_token_layer,
                dtype=self.setup.dtype,
                block_tokens=bt,
                kv_layout=lay.kv_layout,
                free_after=True,
                attempt=t.attempt,
            ),
        )

    def _spawn_persist(self, r: Running, req: m.PersistRequest) -> None:
        """Persist in the background, after the request's previous persist (the index links a
        block only when its parent is already committed)."""
        previous = r.persist_tail
        done = r.persist_tail = anyio.Event()

        async def go() -> None:
            try:
                if previous is not None:
                    await previous.wait()
                await persist()
            finally:
                done.set()

        async def persist() -> None:
            with tracer.start_as_current_span("kv.persist", context=trace.set_span_in_context(r.span)) as span:
                if span.is_recording():
                    span.set_attributes(
                        {
                            "request_id": req.request_id,
                            "blocks": len(req.hashes),
                            "bytes": len(req.hashes) * self.setup.layout.block_bytes,
                            "node": self.node_id,
                        }
                    )
                try:
                    await self.bus.request(self.subjects.tm(self.node_id, "persist"), req, m.Ok, timeout=TIMEOUTS.tm_persist)
                except Exception as exc:  # noqa: BLE001 - a lost block is only a future miss
                    span.set_status(Status(StatusCode.ERROR, str(exc)))
                    log.warning("persist_failed", request_id=req.request_id, error=str(exc))

        start_logged(self.tasks, f"persist:{req.request_id}", go)

    # ---- the loop --------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """The engine loop: receive -> next batch -> run -> process result, until ``stop``."""
        while not stop.is_set():
            await self._receive()
            step = self.batcher.next_step()
            if step is None:
                await self._leave(self.batcher.drain())
                if self.batcher.next_step() is None and not self.batcher.admit_ready():
                    if self.observer is not None:
                        self.observer.idle()
                    await self._idle(stop)
                continue
            t0 = time.perf_counter()
            if self.observer is not None:
                self.observer.started(t0)
            try:
                logits = await self._run_step(step)
                await self._process_result(step, logits)
                if self.observer is not None:
                    self.observer.ran(len(step.batch))
            except Exception as exc:
                running = self.requests.in_phase(DecodePhase.RUNNING)
                log.exception("decode_step_failed", requests=len(running))
                for held in running:
                    self.batcher.evict(held.request_id)
                    self.memory.release(held.state.seq.kv)
                    await self._fail(held, f"decode failed: {type(exc).__name__}: {exc}")
            self.busy_s += time.perf_counter() - t0
        # Persists and final events still running end in the service's task group (the runner's grace).

    async def _idle(self, stop: asyncio.Event) -> None:
        """Wait for a new task, a cancel or ``stop``."""
        self._wake.clear()
        await wait_any(self._wake, stop)

    async def _receive(self) -> None:
        """Admission: the batcher picks who fits the KV memory; their prompt KV moves in."""
        for rid in self.batcher.admit():
            held = self.requests.get(rid)
            assert held is not None and held.phase is DecodePhase.WAITING, rid
            self.requests.move(held, DecodePhase.ADMITTING)
            task = held.task
            span = self._request_span(task)
            try:
                with tracer.start_as_current_span("decode.admit", context=trace.set_span_in_context(span)):
                    r = await asyncio.to_thread(self._admit, held)  # its H2D time was paid on arrival (on_task)
            except MemoryError as exc:  # the batcher's reservation should make this impossible
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                span.end()
                self.batcher.evict(rid)
                await self._fail(held, str(exc))
                continue
            r.span = span
            held.state = r
            self.requests.move(held, DecodePhase.RUNNING)
            self._persist_prompt(r)
            if held.stop is not None:  # stopped while its KV moved in: it leaves at the next pass
                self._halt(held)
                continue
            reason = r.finish or self._finish_reason(r, task.first_token)
            if reason:
                r.finish = reason
                self.batcher.finish(rid, reason)

    async def _run_step(self, step: DecodeStep) -> torch.Tensor:
        """One token through the model for every request of ``step`` (decode first, then flush)."""
        seqs = [self.running(rid).seq for rid in step.batch]
        inputs = [s.tokens[s.kv_len] for s in seqs]  # the one token without KV yet
        return await decode_step_async(self.setup.decoder, self.memory, seqs, inputs)

    async def _process_result(self, step: DecodeStep, logits: torch.Tensor) -> None:
        """Sample and stream the decoded requests' tokens, persist filled blocks, answer the finished."""
        active = [self.running(rid) for rid in step.decode]
        ended: dict[str, str] = {}
        if active:
            toks = sample(
                logits[: len(active)].float().cpu(),
                [r.params for r in active],
                [r.gen for r in active],
                suppress_eos=[r.params.ignore_eos or len(r.seq.generated) < r.params.min_tokens for r in active],
                eos_ids=self.setup.eos_ids,
                constraints=[r.constraint for r in active],
            )
            for r, tok in zip(active, toks):
                r.seq.tokens.append(tok.token_id)
                r.seq.generated.append(tok.token_id)
                if r.finish is None:
                    reason = self._finish_reason(r, tok.token_id)
                    if reason:
                        r.finish = ended[r.task.request_id] = reason
                r.unsent.append((tok.token_id, tok.logprob, [[i, lp] for i, lp in tok.top_logprobs]))
                if len(r.unsent) >= self.cfg.stream_interval or r.finish is not None:
                    await self._emit(r)
        outcome = self.batcher.finish_step(step, ended)
        for rid, block in outcome.filled:  # a block just filled with KV: persist it
            await self._persist_block(self.running(rid), block)
        await self._leave(outcome.leaving)

    async def _leave(self, leaving: tuple[tuple[str, str], ...]) -> None:
        for rid, reason in leaving:
            held = self.requests.get(rid)
            r: Running | None = held.state if held is not None else None
            if r is not None:
                r.finish = reason
                await self._finish(r)

    def _request_span(self, task: m.DecodeTask) -> trace.Span:
        """``decode.request``, from the task's arrival; it ends with the request's final event."""
        arrived = self._arrived_ns.pop(task.request_id, None)
        span = tracer.start_span("decode.request", context=context_from(task.trace), start_time=arrived)
        if span.is_recording():
            span.set_attributes(
                {
                    "request_id": task.request_id,
                    "engine": self.cfg.engine_id,
                    "prompt_tokens": len(task.prompt_tokens),
                    "cached_blocks": task.cached_blocks,
                    "read_path": read_path_name(task.read_path),
                }
            )
        return span

    def _finish_reason(self, r: Running, token: int) -> str | None:
        """Why ``token`` ends the request ("length", "stop"), or None."""
        p = r.params
        n = len(r.seq.generated)
        if n >= p.max_tokens:
            return "length"
        if n >= p.min_tokens and not p.ignore_eos and (token in self.setup.eos_ids or token in p.stop_token_ids):
            return "stop"
        return None

    async def _emit(self, r: Running) -> None:
        """Stream the request's unsent tokens as one event (``stream_interval`` tokens at a time)."""
        if r.superseded:  # its client follows the newer attempt
            r.unsent.clear()
            return
        ids, lps, tops = (list(x) for x in zip(*r.unsent))
        r.unsent.clear()
        await self.bus.publish(
            r.task.reply_subject,
            m.TokenEvent(
                request_id=r.task.request_id,
                index=len(r.seq.generated) - len(ids),
                token_ids=ids,
                logprobs=lps,
                top_logprobs=tops,
                ts=time.time(),
                attempt=r.task.attempt,
                decode_engine=self.served_by,
            ),
        )

    async def _finish(self, r: Running) -> None:
        """Release the request's KV memory; its final event goes out once its blocks are durable."""
        t = r.task
        self.memory.release(r.seq.kv)
        r.decode_s = time.perf_counter() - r.t_start
        if r.superseded:  # not the scheduler's current attempt: its successor starts instead
            self._end_span(r)
            await self._apply(self.requests.leave(r.held))
            return
        cmds = self.requests.leave(r.held, finished=True)  # a late copy of this hand-off must not run it again
        if r.finish == CANCELLED:
            self.finished.append((t.request_id, t.attempt))
            self._end_span(r)
        else:
            start_logged(self.tasks, f"final:{t.request_id}", self._final_event, r)
        await self._apply(cmds)

    async def _final_event(self, r: Running) -> None:
        # Waiting for the last persist makes "answer received" imply "the next turn hits
        # every full block of this context" (a few ms of fsync on the last block only).
        if r.persist_tail is not None:
            with anyio.move_on_after(30.0):
                await r.persist_tail.wait()
        t, lay = r.task, self.setup.layout
        info = {
            "read_path": read_path_name(t.read_path),
            "prefill_engine": t.prefill_engine,
            "decode_engine": self.cfg.engine_id,
            "hit_tokens": t.cached_blocks * lay.block_tokens,
            **t.timing,
        }
        await self.bus.publish(
            t.reply_subject,
            m.TokenEvent(
                request_id=t.request_id,
                index=len(r.seq.generated),
                token_ids=[],
                finish_reason=r.finish,
                cached_tokens=t.cached_blocks * lay.block_tokens,
                info=info,
                ts=time.time(),
                attempt=t.attempt,
                decode_engine=self.served_by,
            ),
        )
        self.finished.append((t.request_id, t.attempt))
        self._end_span(r)
        log.info(
            "decode_done",
            request_id=t.request_id,
            tokens=len(r.seq.generated),
            finish=r.finish,
            seconds=round(time.perf_counter() - r.t_start, 4),
        )

    @staticmethod
    def _end_span(r: Running) -> None:
        """Close ``decode.request`` with its tokens and TPOT (the first token came from prefill)."""
        if r.span.is_recording():
            n = len(r.seq.generated)
            r.span.set_attributes(
                {"tokens": n, "finish_reason": r.finish or "", "decode_s": r.decode_s, "tpot_s": r.decode_s / (n - 1) if n > 1 else 0.0}
            )
        r.span.end()

    async def _fail(self, held: Held, reason: str) -> None:
        """``held`` leaves with a ``TaskFailed`` (none when superseded: the scheduler's current
        attempt is its successor, which starts instead)."""
        task = held.task
        if held.stop is not Stop.SUPERSEDED:
            log.warning("decode_task_failed", request_id=task.request_id, reason=reason)
            await self.bus.publish(
                self.subjects.task_failed(self.cfg.engine_id),
                m.TaskFailed(request_id=task.request_id, engine_id=self.cfg.engine_id, reason=reason, attempt=task.attempt),
            )
        await self._apply(self.requests.leave(held))

    def report(self) -> m.EngineReport:
        """In the scheduler's units (see ``m.EngineReport``): ``seq_e``: requests here (running
        and waiting); ``tok_e``: Σ their prompt + max_tokens; free HBM: capacity minus the
        footprints reserved for them, waiting ones included."""
        done, self.finished = self._named.name(self.finished), []
        return m.EngineReport(
            engine_id=self.cfg.engine_id,
            role=m.Role.DECODE,
            node_id=self.node_id,
            seq=self.count(DecodePhase.RUNNING, DecodePhase.WAITING),
            incarnation=self.incarnation,
            tok=self.batcher.committed_tokens(),
            free_hbm_tokens=self.batcher.unreserved_tokens,
            capacity_tokens=self.batcher.capacity_tokens,
            finished=[rid for rid, _ in done],
            finished_attempts=[attempt for _, attempt in done],
            block_bytes=self.setup.layout.block_bytes,
            stats={
                "busy_s": self.busy_s,
                **self.setup.decoder.stats(),  # testbed: modeled seconds, model traffic
                **(self.observer.stats() if self.observer is not None else {}),
            },
            ts=time.time(),
        )
