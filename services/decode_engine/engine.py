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

Attempts: the scheduler may place a request again (a retry after a failure, or a new
scheduler's placement after a failover: ``DecodeTask.attempt`` orders them). A newer attempt
of a request held here replaces the old run, which stops silently (no more token events, no
final event, not reported finished: the scheduler's current attempt is the new one); an
older attempt arriving late (its hand-off crossed the retry) is refused, and so is one the
scheduler's retry cancel (``CancelRequest.before_attempt``) already retired. Either way the
refused or replaced attempt's buffer slot is given back (slots are per attempt). A client's
cancel of a request not held here is remembered (the newest 4,096): a hand-off that crossed
it is taken, its slot given back and reported finished at once, instead of decoding for
nobody.

Tracing: each request has a ``decode.request`` span (child of the request's root, from the
task's ``trace`` carrier) from arrival to its final event, with ``decode.admit`` and one
``kv.persist`` per persist request under it; no span per step or token.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import torch
from anyio.abc import TaskGroup
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from dualpath.bus import Bus
from dualpath.config import EngineConfig
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
_MAX_RETIRED = 4096  # requests remembered as retired below an attempt, or as cancelled (the oldest forgotten first)


def _remember(memory: OrderedDict, rid: str, value) -> None:
    """Keep ``rid -> value`` as the newest entry of a memory bounded at ``_MAX_RETIRED``."""
    memory[rid] = value
    while len(memory) > _MAX_RETIRED:
        memory.popitem(last=False)


@dataclass(slots=True, kw_only=True)
class Running:
    task: m.DecodeTask
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
    superseded: bool = False  # a newer attempt replaced it: it leaves without events or a report
    persist_off: bool = False  # a generated block could not be staged: its later blocks are not persisted either


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
        self.waiting: dict[str, m.DecodeTask] = {}  # arrived, not admitted yet (the batcher's waiting queue)
        self.running: dict[str, Running] = {}
        self.finished: list[tuple[str, int]] = []  # (request, attempt) done since the last report
        self._named = FinishedReports()  # each finish is named in 3 reports in a row
        self._regions: dict[str, MemoryRegion] = {}
        self._wake = asyncio.Event()
        self._loading: dict[str, m.DecodeTask] = {}  # arrived, prompt KV still crossing the emulated CNIC (testbed)
        self._successors: dict[str, m.DecodeTask] = {}  # newer attempts waiting for the run they replace to leave
        self._admitting: dict[str, m.DecodeTask] = {}  # prompt KV moving into KV memory (neither waiting nor running)
        self._stop_admitted: set[str] = set()  # replaced during admission: stopped as soon as admitted
        self._retired: OrderedDict[str, int] = OrderedDict()  # request -> attempts below this one are over
        # Client cancels of requests not held here: a hand-off that crossed its cancel comes
        # later and is taken only to end at once (else it would decode for nobody).
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self.incarnation = uuid.uuid4().hex[:12]  # this process (reports and token events name it)
        self.served_by = f"{cfg.engine_id}@{self.incarnation}"
        self._arrived_ns: dict[str, int] = {}  # task arrival, where decode.request spans start
        self.busy_s = 0.0  # wall time inside decode steps
        self.observer = setup.observer  # told each step's start and end (testbed: host time per step, in stats)

    # ---- intake ----------------------------------------------------------------------------
    async def on_task(self, task: m.DecodeTask) -> m.Ok:
        """Take a hand-off: a new request, a newer attempt of one held here (it replaces the old
        run), or an older / retired attempt (refused: ``superseded``)."""
        rid = task.request_id
        if rid in self._cancelled:  # its client cancelled it before the hand-off came: done, nothing to run
            del self._cancelled[rid]
            log.info("decode_task_cancelled_before_handoff", request_id=rid, attempt=task.attempt)
            self._free_slot(task)
            self.finished.append((rid, task.attempt))  # the scheduler forgets the request (its charges go)
            return m.Ok(detail="cancelled")
        held = self._held(rid)
        if task.attempt < self._retired.get(rid, 0) or (held is not None and task.attempt < held.attempt):
            log.info("decode_task_refused_older_attempt", request_id=rid, attempt=task.attempt)
            self._free_slot(task)
            return m.Ok(detail="superseded")
        if held is not None:
            if task.attempt == held.attempt:
                return m.Ok(detail="duplicate")
            log.info("decode_task_superseded", request_id=rid, attempt=held.attempt, by=task.attempt)
            self._retire(rid, task.attempt)
            await self._stop_run(rid, successor=task)
            return m.Ok()
        return await self._intake(task)

    async def _intake(self, task: m.DecodeTask) -> m.Ok:
        try:  # the slot is in use now, whichever scheduler reserved it (the traffic manager's reclaim)
            await self.bus.publish(self.subjects.tm(self.node_id, "claim"), m.SlotClaimed(request_id=task.request_id, attempt=task.attempt))
        except Exception as exc:  # noqa: BLE001 - only matters if its scheduler died meanwhile
            log.warning("slot_claim_failed", request_id=task.request_id, error=str(exc))
        nic = self.setup.nic
        if nic is not None and not self.setup.oracle:
            # Testbed: the prompt KV's H2D goes through the GPU's CNIC (both directions: a
            # loopback) while the running batch keeps decoding; the request joins once it landed.
            self._loading[task.request_id] = task
            start_logged(self.tasks, f"h2d:{task.request_id}", self._h2d_then_add, task, nic)
            return m.Ok()
        return await self._add(task)

    async def _h2d_then_add(self, task: m.DecodeTask, nic) -> None:
        lay = self.setup.layout
        try:
            await nic.copy(lay.blocks_for(len(task.prompt_tokens)) * lay.block_bytes)
        finally:
            current = self._loading.get(task.request_id) is task
            if current:
                del self._loading[task.request_id]
        if current:  # else a newer attempt replaced it while it loaded
            await self._add(task)

    def _held(self, rid: str) -> m.DecodeTask | None:
        """The newest attempt of ``rid`` held here (waiting to replace a run, running, waiting or loading)."""
        successor = self._successors.get(rid)
        if successor is not None:
            return successor
        r = self.running.get(rid)
        return r.task if r is not None else self.waiting.get(rid) or self._admitting.get(rid) or self._loading.get(rid)

    def _retire(self, rid: str, before: int) -> None:
        """Remember that attempts of ``rid`` below ``before`` are over (a late hand-off is refused)."""
        _remember(self._retired, rid, max(before, self._retired.pop(rid, 0)))

    async def _stop_run(self, rid: str, successor: m.DecodeTask | None) -> None:
        """Stop the run of ``rid`` held here silently: no more token events, no final event, not
        reported finished. A running one leaves at the loop's next pass (its step may be under
        way) and ``successor`` starts then; one not running yet goes now and ``successor`` starts now."""
        r = self.running.get(rid)
        if r is None and rid in self._admitting:  # stopped once admitted (``_receive``); leaves like a running one
            self._stop_admitted.add(rid)
        if r is not None or rid in self._admitting:
            replaced = self._successors.pop(rid, None)
            if replaced is not None:  # a successor that never started, replaced in turn
                self._free_slot(replaced)
            if r is not None and not r.superseded:
                self._supersede(r)
            if successor is not None:
                self._successors[rid] = successor
            return
        for old in (self.waiting.pop(rid, None), self._loading.pop(rid, None)):
            if old is not None:
                self.batcher.evict(rid)
                self._arrived_ns.pop(rid, None)
                self._free_slot(old)
        if successor is not None:
            await self._intake(successor)

    def _supersede(self, r: Running) -> None:
        r.superseded, r.finish = True, CANCELLED
        r.unsent.clear()
        self.batcher.finish(r.task.request_id, CANCELLED)
        self._wake.set()

    def _free_slot(self, task: m.DecodeTask) -> None:
        """Give back the DE buffer slot of an attempt that will never be admitted (this node's)."""

        async def free() -> None:
            req = m.FreeRequest(request_id=task.request_id, attempt=task.attempt)
            try:
                await self.bus.request(self.subjects.tm(self.node_id, "free"), req, m.Ok, timeout=TIMEOUTS.tm_free)
            except Exception as exc:  # noqa: BLE001 - a reservation nobody claims is given back by the traffic manager
                log.warning("slot_free_failed", request_id=task.request_id, attempt=task.attempt, error=str(exc))

        start_logged(self.tasks, f"free:{task.request_id}", free)

    async def _add(self, task: m.DecodeTask) -> m.Ok:
        try:
            max_tokens = SamplingParams(**task.sampling).max_tokens
            self.batcher.add(task.request_id, prompt_tokens=len(task.prompt_tokens), max_tokens=max_tokens)
        except (BatcherError, ValueError, TypeError) as exc:  # a request this engine can never hold, or bad sampling
            await self._fail_task(task, str(exc))
            return m.Ok(detail="refused")
        self.waiting[task.request_id] = task
        self._arrived_ns[task.request_id] = time.time_ns()
        self._wake.set()
        return m.Ok()

    async def on_cancel(self, req: m.CancelRequest) -> None:
        """A client's cancel stops the request (reported finished); the scheduler's retry cancel
        (``before_attempt``) stops older attempts only, silently (see the module docstring)."""
        rid = req.request_id
        if req.before_attempt >= 0:
            self._retire(rid, req.before_attempt)
            held = self._held(rid)
            if held is not None and held.attempt < req.before_attempt:
                await self._stop_run(rid, successor=None)
            return
        if self._held(rid) is None:  # not here (yet): a hand-off that crossed this cancel ends on arrival
            _remember(self._cancelled, rid, None)
            return
        successor = self._successors.pop(rid, None)
        if successor is not None:  # it never starts: reported finished so the scheduler forgets the request
            self._free_slot(successor)
            self.finished.append((rid, successor.attempt))
        r = self.running.get(rid)
        if r is not None and r.finish is None:
            r.finish = CANCELLED
        self.batcher.finish(rid, CANCELLED)  # a waiting one leaves as soon as it is admitted
        self._wake.set()

    def _region(self, region_id: str) -> MemoryRegion:
        region = self._regions.get(region_id)
        if region is None or not region.is_current():  # not current: the node's traffic manager restarted
            region = self._regions[region_id] = MemoryRegion.attach(region_id)
        return region

    def _admit(self, task: m.DecodeTask) -> Running:
        """Copy the prompt KV from the DE buffer slot into KV memory (the DE's H2D)."""
        lay = self.setup.layout
        d = self.setup.decoder
        n = len(task.prompt_tokens)
        nb = lay.blocks_for(n)
        kv = self.memory.allocate(n + 1)
        if not self.setup.oracle:
            slot = self._region(task.de_region_id).as_tensor(task.de_offset, nb * lay.block_bytes, d.dtype)
            width = d.kv_spec.width
            slot = slot.view(nb, lay.layers, lay.block_tokens, width)  # [blocks, layers, bt, width]
            kv[:, :n].copy_(slot.permute(1, 0, 2, 3).reshape(lay.layers, nb * lay.block_tokens, width)[:, :n])
        params = SamplingParams(**task.sampling)
        gen = torch.Generator(device="cpu").manual_seed(params.seed + 1) if params.seed is not None else None
        seq = DecodeSequence(
            request_id=task.request_id, tokens=list(task.prompt_tokens) + [task.first_token], kv=kv, kv_len=n, generated=[task.first_token]
        )
        full = n // lay.block_tokens
        return Running(
            task=task,
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
        dst.copy_(r.seq.kv[:, b * bt : (b + 1) * bt])
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
                log.exception("decode_step_failed", requests=len(self.running))
                for r in list(self.running.values()):
                    rid = r.task.request_id
                    self.running.pop(rid, None)
                    self.batcher.evict(rid)
                    self.memory.release(r.seq.kv)
                    if r.superseded:  # not the scheduler's current attempt: its successor starts instead
                        successor = self._successors.pop(rid, None)
                        if successor is not None:
                            await self._intake(successor)
                        continue
                    await self._fail_task(r.task, f"decode failed: {type(exc).__name__}: {exc}")
            self.busy_s += time.perf_counter() - t0
        # Persists and final events still running end in the service's task group (the runner's grace).

    async def _idle(self, stop: asyncio.Event) -> None:
        """Wait for a new task, a cancel or ``stop``."""
        self._wake.clear()
        await wait_any(self._wake, stop)

    async def _receive(self) -> None:
        """Admission: the batcher picks who fits the KV memory; their prompt KV moves in."""
        for rid in self.batcher.admit():
            task = self._admitting[rid] = self.waiting.pop(rid)
            span = self._request_span(task)
            try:
                with tracer.start_as_current_span("decode.admit", context=trace.set_span_in_context(span)):
                    r = await asyncio.to_thread(self._admit, task)  # its H2D time was paid on arrival (on_task)
            except MemoryError as exc:  # the batcher's reservation should make this impossible
                del self._admitting[rid]
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                span.end()
                self.batcher.evict(rid)
                if rid in self._stop_admitted:  # replaced meanwhile: its successor runs instead
                    self._stop_admitted.discard(rid)
                    successor = self._successors.pop(rid, None)
                    if successor is not None:
                        await self._intake(successor)
                    continue
                await self._fail_task(task, str(exc))
                continue
            r.span = span
            del self._admitting[rid]
            self.running[rid] = r
            self._persist_prompt(r)
            if rid in self._stop_admitted:  # a newer attempt came while its KV moved in
                self._stop_admitted.discard(rid)
                self._supersede(r)
                continue
            r.finish = self.batcher.finish_reason(rid)  # cancelled while it waited
            reason = r.finish or self._finish_reason(r, task.first_token)
            if reason:
                r.finish = reason
                self.batcher.finish(rid, reason)

    async def _run_step(self, step: DecodeStep) -> torch.Tensor:
        """One token through the model for every request of ``step`` (decode first, then flush)."""
        seqs = [self.running[rid].seq for rid in step.batch]
        inputs = [s.tokens[s.kv_len] for s in seqs]  # the one token without KV yet
        return await decode_step_async(self.setup.decoder, self.memory, seqs, inputs)

    async def _process_result(self, step: DecodeStep, logits: torch.Tensor) -> None:
        """Sample and stream the decoded requests' tokens, persist filled blocks, answer the finished."""
        active = [self.running[rid] for rid in step.decode]
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
            await self._persist_block(self.running[rid], block)
        await self._leave(outcome.leaving)

    async def _leave(self, leaving: tuple[tuple[str, str], ...]) -> None:
        for rid, reason in leaving:
            r = self.running.get(rid)
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
        self.running.pop(t.request_id, None)
        self.memory.release(r.seq.kv)
        r.decode_s = time.perf_counter() - r.t_start
        if r.superseded:
            self._end_span(r)
            successor = self._successors.pop(t.request_id, None)
            if successor is not None:
                await self._intake(successor)
            return
        self._retire(t.request_id, t.attempt + 1)  # a late copy of this hand-off must not run it again
        if r.finish == CANCELLED:
            self.finished.append((t.request_id, t.attempt))
            self._end_span(r)
            return
        start_logged(self.tasks, f"final:{t.request_id}", self._final_event, r)

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

    async def _fail_task(self, task: m.DecodeTask, reason: str) -> None:
        log.warning("decode_task_failed", request_id=task.request_id, reason=reason)
        await self.bus.publish(
            self.subjects.task_failed(self.cfg.engine_id),
            m.TaskFailed(request_id=task.request_id, engine_id=self.cfg.engine_id, reason=reason, attempt=task.attempt),
        )

    def report(self) -> m.EngineReport:
        """In the scheduler's units (see ``m.EngineReport``): ``seq_e``: requests here (running
        and waiting); ``tok_e``: Σ their prompt + max_tokens; free HBM: capacity minus the
        footprints reserved for them, waiting ones included."""
        done, self.finished = self._named.name(self.finished), []
        return m.EngineReport(
            engine_id=self.cfg.engine_id,
            role=m.Role.DECODE,
            node_id=self.node_id,
            seq=len(self.running) + len(self.waiting),
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
