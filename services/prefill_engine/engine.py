"""``PrefillEngine``: accepts tasks, loads their hits, batches, prefills layer-wise, hands off.

Life of a task here:
1. ``on_task`` acknowledges at once and starts the storage load on the read side's traffic
   manager (PE read path: into this node's buffer; DE read path: into the DE buffer slot),
   checking on that traffic manager while it waits (``tm_watch``: a load lost with a dead or
   restarted traffic manager fails in seconds, naming the node, not after ``TIMEOUTS.tm_load``);
2. ``run`` is the engine loop, in SGLang's phases: *receive* (loaded tasks join the
   ``PrefillBatcher``, the engine's core), *next batch* (the batcher packs FIFO under the
   compute quota, the paper's §6.2 rule, cutting the request that would exceed it to a
   block-aligned chunk), *run* (``run_prefill`` over a ``BatchLayerIO``: layer-wise fetch /
   compute / store), *process result* (chunks become cached KV; finished prompts hand off);
3. when a prompt is done: sample the first token, stream it, send ``DecodeTask`` to the DE.
A failure fails only the tasks involved: ``TaskFailed`` lets the scheduler retry them (a
batch that raises fails its tasks; sampling or handing off one request fails that one alone).

Attempts: which run of a request is current (newest attempt wins; a retry's newer attempt
replaces the run held here, older or retired ones are refused) is the attempt core's decision
(``dualpath.core.attempts.AttemptTable``), kept as this engine's one table of requests with
``PrefillPhase`` as each one's phase. A stopped run that is only queued goes at once; one
loading, computing or handing off leaves when that ends (its KV may still be written), then
its successor starts. A superseded run leaves silently; a client's cancel is told to the
scheduler as abandoned.

The quota is checked against a predicted batch time (``dualpath.engine.profile``): the
cost model on the modeled backend (exactly what ``ModeledDecoder`` then charges), a profile
timed at start-up on the torch backend.

Tracing: each task has a ``prefill.request`` span (child of the request's root, from the
task's ``trace`` carrier) with ``prefill.load`` and ``prefill.handoff`` under it. A batch
serves several requests, so its ``prefill.batch`` span is a child of its first request's
span and links to the others; the per-layer ``kv.fetch``/``kv.store`` spans are its children.
``prefill.batch`` carries ``predicted_s``, ``quota_s``, ``chunked``, ``over_quota`` and the
requests' ``request_cached_tokens`` / ``request_new_tokens`` (batch order); on the modeled
backend also ``charged_s``, the modeled seconds the batch was charged.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch
from anyio.abc import TaskGroup
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from dualpath.bus import Bus, BusTimeoutError
from dualpath.config import EngineConfig
from dualpath.core.attempts import Attempt, AttemptCommand, AttemptTable, Drop, Halt, Refuse, Start, Stop
from dualpath.core.batch_errors import BatcherError
from dualpath.core.prefill_batcher import BatchItem, PrefillBatch, PrefillBatcher
from dualpath.engine.common import EngineSetup, FinishedReports, read_path_name
from dualpath.engine.prefill import PrefillItem, run_prefill
from dualpath.engine.prefill_io import BatchLayerIO, IoItem
from dualpath.engine.profile import prefill_predictor
from dualpath.kv.hits import miss_tokens, planned_hit_blocks, readable_hit_blocks
from dualpath.model.sampling import SamplingParams, grammar_constraint, sample
from dualpath.protocol import RemoteError
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from dualpath.protocol.timeouts import TIMEOUTS
from dualpath.runtime import start_logged, wait_any
from dualpath.telemetry.logs import get_logger
from dualpath.telemetry.tracing import context_from, get_tracer
from dualpath.transfer import RegionDescriptor, UnknownRegionError
from services.prefill_engine.split import is_split, load_split
from services.prefill_engine.tm_watch import await_load, lost_load

__all__ = ["PrefillEngine"]

log = get_logger("prefill-engine")
tracer = get_tracer("dualpath.prefill")
_BUFFER_WAIT_S = 600.0  # longest a KV load waits for room in a full node buffer


def _planned(task: m.PrefillTask, block_tokens: int) -> int:
    """``kv.hits.planned_hit_blocks`` of ``task``: it reads when its read path is PE or DE."""
    reads = task.read_path in (m.ReadPath.PE, m.ReadPath.DE)
    return planned_hit_blocks(len(task.prompt_tokens), task.hit_blocks, block_tokens, reads=reads)


class PrefillPhase(Enum):
    """Where a task held by the prefill engine is (``AttemptTable``'s phase)."""

    LOADING = "loading"  # its hits are being read (the read may still write): tok_e counts the hits planned
    QUEUED = "queued"  # loaded, waiting for the batcher (or between two chunks)
    COMPUTING = "computing"  # in the running batch (its KV is being written)
    HANDING_OFF = "handing_off"  # first token sampled, the DecodeTask on its way

    @property
    def queued(self) -> bool:
        return self is PrefillPhase.QUEUED


@dataclass(slots=True, kw_only=True)
class Job:
    """The prefill engine's record of one run (``Attempt.state``)."""

    held: Attempt[m.PrefillTask]  # the attempt table's entry of this run
    hit_blocks: int = 0  # blocks loaded (set when the load ends)
    source: RegionDescriptor | None = None  # where the hits are (PE buffer or DE slot)
    source_offset: int = 0
    dest: RegionDescriptor  # the DE buffer slot
    pe_slot: bool = False
    split_tokens: int = -1  # split read: cached tokens [split_tokens, hits) were read into the DE slot
    read_split: list[int] = field(default_factory=list)  # [PE blocks, DE blocks] read (the response's dualpath record)
    t_submit: float = field(default_factory=time.perf_counter)
    t_first_batch: float = 0.0  # wall time its first prefill batch started (TTFT: queueing before, execution after)
    span: trace.Span = trace.INVALID_SPAN  # prefill.request: open from arrival to hand-off (or failure)

    @property
    def task(self) -> m.PrefillTask:
        return self.held.task

    @property
    def loading(self) -> bool:
        return self.held.phase is PrefillPhase.LOADING

    @property
    def stopping(self) -> bool:
        """Stopped while its load, batch or hand-off ran: it leaves when that ends."""
        return self.held.stop is not None

    @property
    def superseded(self) -> bool:
        """A newer attempt replaced it (or a retry retired it): it leaves without a report or TaskFailed."""
        return self.held.stop is Stop.SUPERSEDED


def vanished_node(exc: Exception, jobs: list[Job]) -> str:
    """The node whose DRAM buffer a failed batch found gone (``UnknownRegionError`` naming the
    DE slot's or the loaded hits' region of one of its requests: the node's traffic manager died,
    its buffer with it), else ""."""
    if not isinstance(exc, UnknownRegionError):
        return ""
    for job in jobs:
        for region in (job.dest, job.source):
            if region is not None and region.region_id == exc.region_id:
                return region.node_id
    return ""


class PrefillEngine:
    def __init__(self, bus: Bus, subjects: Subjects, cfg: EngineConfig, node_id: str, setup: EngineSetup, tasks: TaskGroup) -> None:
        self.bus, self.subjects, self.cfg, self.node_id, self.setup = bus, subjects, cfg, node_id, setup
        self.tasks = tasks  # the service's task group: KV loads run there
        # The one table of requests: each one's current attempt (its phase, its Job), the
        # successor waiting for it and the attempts retired (``dualpath.core.attempts``).
        self.requests: AttemptTable[m.PrefillTask] = AttemptTable(PrefillPhase.LOADING)
        self.loaded: deque[Job] = deque()  # KV loaded, not yet received by the batcher
        quota_s = cfg.compute_quota_ms / 1000.0
        predict, self.predicted_by = prefill_predictor(setup.decoder, quota_s)
        self.batcher = PrefillBatcher(predict, quota_s=quota_s, block_tokens=setup.layout.block_tokens)
        log.info(
            "prefill_predictor",
            engine=cfg.engine_id,
            predicted_by=self.predicted_by,
            quota_s=quota_s,
            profile=repr(predict) if self.predicted_by == "profile" else cfg.engine_id,
        )
        self._wake = asyncio.Event()
        self.finished: list[tuple[str, int]] = []  # (request, attempt) handed off since the last report
        self._named = FinishedReports()  # each finish is named in 3 reports in a row
        self.busy_s = 0.0  # wall time inside batches
        self.kv_wait_s = 0.0  # of which: waiting for cached KV to arrive
        self.buffer_waits = 0  # KV loads put off because the read side's buffer was full
        self.kv_in_bytes = 0  # cached KV fetched into the engine (metrics)
        self.kv_out_bytes = 0  # KV stored to decode buffers (metrics)

    # ---- intake ----------------------------------------------------------------------------
    async def on_task(self, task: m.PrefillTask) -> m.Ok:
        """Take a task: a new request starts its load; a newer attempt of a request held here
        replaces it (the old one must neither hand off nor write more KV into a decode slot that
        was given up: it stops silently); an older or retired attempt is refused (``superseded``)."""
        return m.Ok(detail=await self._apply(self.requests.arrive(task.request_id, task.attempt, task)))

    async def on_cancel(self, req: m.CancelRequest) -> None:
        """A client's cancel stops the request's task: a queued one is dropped now, one loading,
        computing or handing off when that ends. A scheduler's retry (``before_attempt``) stops
        older attempts only, silently."""
        await self._apply(self.requests.cancel(req.request_id, req.before_attempt))

    async def _apply(self, cmds: list[AttemptCommand[m.PrefillTask]]) -> str:
        """Carry out the attempt core's commands; the detail of a refusal, else ""."""
        detail = ""
        for c in cmds:
            if isinstance(c, Start):
                self._start(c.run)
            elif isinstance(c, Refuse):
                detail = c.detail
                log.info("prefill_task_refused", request_id=c.task.request_id, attempt=c.task.attempt, detail=c.detail)
            elif isinstance(c, Drop):  # loaded and queued: nothing of it runs
                job: Job = c.run.state
                if job in self.loaded:
                    self.loaded.remove(job)
                self.batcher.remove(c.run.request_id)
                await self._drop_stopped(job)
            elif isinstance(c, Halt):  # it leaves when its load, batch or hand-off ends
                why = c.run.stop.value if c.run.stop else ""
                log.info("prefill_task_stopping", request_id=c.run.request_id, attempt=c.run.attempt, why=why)
            # Discard: a successor that never started holds nothing here
        return detail

    def _start(self, held: Attempt[m.PrefillTask]) -> None:
        task = held.task
        job = held.state = Job(held=held, dest=RegionDescriptor.from_wire(task.de_region))
        job.span = tracer.start_span("prefill.request", context=context_from(task.trace))
        if job.span.is_recording():
            job.span.set_attributes(
                {
                    "request_id": task.request_id,
                    "engine": self.cfg.engine_id,
                    "prompt_tokens": len(task.prompt_tokens),
                    "hit_blocks": task.hit_blocks,
                    "read_path": read_path_name(task.read_path),
                    "attempt": task.attempt,
                }
            )
        start_logged(self.tasks, f"load:{task.request_id}", self._load, job)

    def job(self, request_id: str) -> Job | None:
        """The current run of ``request_id``, or None."""
        held = self.requests.get(request_id)
        return held.state if held is not None else None

    async def _load_when_room(self, node: str, req: m.LoadRequest) -> m.LoadReply:
        """Ask ``node``'s traffic manager to read the hits; while its buffer is full (the PE
        buffer holds the KV of requests queued here until they are computed), wait and ask
        again: back-pressure, not a failure. Gives up after ``_BUFFER_WAIT_S``."""
        deadline = time.monotonic() + _BUFFER_WAIT_S
        delay = 0.01
        while True:
            try:
                return await await_load(self.bus, self.subjects, node, req, lambda: self._request_load(node, req))
            except RemoteError as exc:
                if exc.code != m.BUFFER_FULL or time.monotonic() + delay > deadline:
                    raise
            self.buffer_waits += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    async def _request_load(self, node: str, req: m.LoadRequest) -> m.LoadReply:
        return await self.bus.request(self.subjects.tm(node, "load"), req, m.LoadReply, timeout=TIMEOUTS.tm_load)

    async def _load(self, job: Job) -> None:
        t = job.task
        lay = self.setup.layout
        want = _planned(t, lay.block_tokens)
        try:
            if self.setup.oracle:  # hits are free: nothing is read, nothing moves
                job.hit_blocks = readable_hit_blocks(len(t.prompt_tokens), t.hit_blocks, lay.block_tokens)
            elif want and is_split(t):  # both storage NICs read this request (policy.split)
                job.pe_slot = True  # the PE share's slot is freed with the job, even if a read fails
                got = await load_split(t, want, lay, self.setup.dtype, self._load_when_room)
                job.hit_blocks, job.source, job.source_offset = got.hit_blocks, got.source, got.source_offset
                job.split_tokens = got.pe_blocks * lay.block_tokens if got.de_blocks > 0 else -1
                job.read_split = [got.pe_blocks, got.de_blocks]
            elif want:
                node = t.prefill_node if t.read_path == m.ReadPath.PE else t.decode_node
                req = m.LoadRequest(
                    request_id=t.request_id,
                    model_digest=t.model_digest,
                    hashes=t.block_hashes[:want],
                    layers=lay.layers,
                    bytes_per_token_layer=lay.bytes_per_token_layer,
                    dtype=self.setup.dtype,
                    block_tokens=lay.block_tokens,
                    kv_layout=lay.kv_layout,
                    allocate=t.read_path == m.ReadPath.PE,
                    total_blocks=want,
                    attempt=t.attempt,
                )
                with tracer.start_as_current_span("prefill.load", context=trace.set_span_in_context(job.span)) as span:
                    reply = await self._load_when_room(node, req)
                    if span.is_recording():
                        span.set_attributes(
                            {
                                "node": node,
                                "read_path": read_path_name(t.read_path),
                                "blocks": want,
                                "loaded_blocks": reply.loaded,
                                "bytes": reply.bytes_read,
                                "queue_wait_s": reply.queue_wait_s,
                                "read_s": reply.read_s,
                            }
                        )
                job.pe_slot = t.read_path == m.ReadPath.PE
                job.hit_blocks = reply.loaded
                job.source, job.source_offset = RegionDescriptor.from_wire(reply.region), reply.offset
                job.read_split = [reply.loaded, 0] if job.pe_slot else [0, reply.loaded]
        except Exception as exc:  # noqa: BLE001 - any load failure fails this task only
            lost = lost_load(exc)  # a dead traffic manager: the scheduler leaves its node out until it reports again
            # cancelled by its client meanwhile: nothing to retry (the node's loss is still told)
            await self._fail(job, f"KV load failed: {lost or exc}", node_unreachable=lost.node if lost else "", abandoned=job.stopping)
            return
        if job.stopping:
            await self._drop_stopped(job)
            return
        self.requests.move(job.held, PrefillPhase.QUEUED)
        self.loaded.append(job)
        self._wake.set()

    # ---- the loop: receive -> next batch -> run -> process result ------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """The engine loop, until ``stop``."""
        while not stop.is_set():
            await self._receive()
            batch = self.batcher.next_batch()
            if batch is None:
                await self._idle(stop)
                continue
            t0 = time.perf_counter()
            jobs = self._batch_started(batch)
            try:
                result = await self._run_batch(batch, jobs)
            except Exception as exc:  # noqa: BLE001 - a failed batch fails its tasks, not the engine
                log.warning("prefill_batch_failed", error=f"{type(exc).__name__}: {exc}", requests=len(batch.items))
                jobs = [job for rid in self.batcher.fail_batch() if (job := self.job(rid)) is not None]
                gone = vanished_node(exc, jobs)  # a buffer gone with its traffic manager: that node leaves scheduling
                for job in jobs:
                    await self._fail(job, f"prefill failed: {type(exc).__name__}: {exc}", node_unreachable=gone)
            else:
                await self._process_result(batch, jobs, result)
            self.busy_s += time.perf_counter() - t0

    def _batch_started(self, batch: PrefillBatch) -> list[Job]:
        """The runs ``batch`` serves (not a later attempt's), now computing: a stop waits for the batch."""
        jobs = []
        for it in batch.items:
            job = self.job(it.request_id)
            assert job is not None, it.request_id
            self.requests.move(job.held, PrefillPhase.COMPUTING)
            jobs.append(job)
        return jobs

    async def _receive(self) -> None:
        """Loaded tasks join the batcher's FIFO queue (their hits are cached tokens)."""
        while self.loaded:
            job = self.loaded.popleft()
            try:
                self.batcher.add(
                    job.task.request_id, cached=job.hit_blocks * self.setup.layout.block_tokens, total=len(job.task.prompt_tokens)
                )
            except BatcherError as exc:  # e.g. hits covering the whole prompt: nothing left to compute
                await self._fail(job, str(exc))

    async def _idle(self, stop: asyncio.Event) -> None:
        """Wait for a loaded task or ``stop``."""
        self._wake.clear()
        if self.loaded:
            return
        await wait_any(self._wake, stop)

    def _io_item(self, job: Job, it: BatchItem) -> IoItem:
        t = job.task
        start = it.cached
        first_chunk = start == job.hit_blocks * self.setup.layout.block_tokens
        if first_chunk:
            source, s_off = job.source, job.source_offset
        else:  # earlier chunks (and forwarded hits) already sit in the DE slot
            source, s_off = job.dest, t.de_offset
        write_from = 0 if (first_chunk and job.pe_slot) else start
        item = PrefillItem(request_id=t.request_id, tokens=t.prompt_tokens, start=start, end=start + it.new)
        return IoItem(
            item=item,
            source=source if start else None,
            source_offset=s_off,
            dest=job.dest,
            dest_offset=t.de_offset,
            write_from=write_from,
            path=read_path_name(t.read_path),
            de_engine=t.decode_engine,
            de_from=job.split_tokens if first_chunk else -1,
        )

    def _batch_span(self, batch: PrefillBatch, jobs: list[Job]):
        """``prefill.batch``: child of the first request's span, linked to the others'."""
        first = jobs[0].span
        if not first.is_recording():
            return tracer.start_as_current_span("prefill.batch", context=trace.set_span_in_context(first))
        attrs = {
            "requests": len(batch.items),
            "cached_tokens": batch.cached_tokens,
            "new_tokens": batch.new_tokens,
            "engine": self.cfg.engine_id,
            "request_ids": [it.request_id for it in batch.items],
            "request_cached_tokens": [it.cached for it in batch.items],
            "request_new_tokens": [it.new for it in batch.items],
            "predicted_s": batch.predicted_s,
            "predicted_by": self.predicted_by,
            "quota_s": batch.quota_s,
            "chunked": batch.chunked,
            "over_quota": batch.over_quota,
        }
        links = [trace.Link(job.span.get_span_context()) for job in jobs[1:]]
        return tracer.start_as_current_span("prefill.batch", context=trace.set_span_in_context(first), links=links, attributes=attrs)

    @staticmethod
    def _ttft_split(job: Job) -> dict:
        """TTFT's parts: queueing (admission -> first prefill batch: scheduler queue, dispatch,
        KV load wait) and execution (first batch -> first token). Wall clocks of two processes."""
        if not job.task.arrival_ts or not job.t_first_batch:
            return {}
        now = time.time()
        return {"ttft_queue_s": max(0.0, job.t_first_batch - job.task.arrival_ts), "ttft_exec_s": max(0.0, now - job.t_first_batch)}

    async def _run_batch(self, batch: PrefillBatch, jobs: list[Job]):
        """Run ``batch`` (its items' ``jobs``) layer-wise; returns ``run_prefill``'s result. Raises what it raises."""
        s = self.setup
        items = [self._io_item(job, it) for job, it in zip(jobs, batch.items)]
        now = time.time()
        for job in jobs:
            job.t_first_batch = job.t_first_batch or now
        t0 = time.perf_counter()
        charged0 = s.decoder.compute_charged_s
        with self._batch_span(batch, jobs) as span:
            io = BatchLayerIO(
                s.dataplane,
                s.layout,
                items,
                dtype=s.decoder.dtype,
                spec=s.decoder.kv_spec,
                device=s.decoder.device,
                owner=f"b{id(items):x}",
                oracle=s.oracle,
                record=span.is_recording(),
                layerwise=self.cfg.layerwise,
            )
            try:
                result = await run_prefill(s.decoder, [it.item for it in items], io, layerwise=self.cfg.layerwise)
            finally:
                io.close()
            self.kv_wait_s += result.wait_s
            self.kv_in_bytes += io.stats.fetch_bytes
            self.kv_out_bytes += io.stats.store_bytes
            if span.is_recording():
                charged = s.decoder.compute_charged_s
                if charged is not None and charged0 is not None:  # modeled: the cost model's compute seconds this batch was charged
                    span.set_attribute("charged_s", charged - charged0)
                self._trace_batch(span, io, result, time.perf_counter() - t0)
        return result

    async def _process_result(self, batch: PrefillBatch, jobs: list[Job], result) -> None:
        """Chunks become cached KV; prompts done hand off (first token, ``DecodeTask``).
        Each item's job is the one the batch ran: a newer attempt of the same request that
        started meanwhile (its predecessor dropped during an earlier hand-off's await) is not
        handed this batch's logits."""
        self.batcher.finish_batch()
        row = 0
        for it, job in zip(batch.items, jobs):
            logits = None
            if it.last:  # one logits row per prompt-ending chunk, in batch order
                logits = result.logits[row : row + 1]
                row += 1
            if self.job(it.request_id) is not job:  # dropped meanwhile (and perhaps succeeded)
                continue
            if job.stopping:
                self.batcher.remove(it.request_id)
                await self._drop_stopped(job)
            elif logits is None:  # a chunk: the rest of its prompt waits for a later batch
                self.requests.move(job.held, PrefillPhase.QUEUED)
            else:
                self.requests.move(job.held, PrefillPhase.HANDING_OFF)
                try:
                    await self._handoff(job, logits)
                except Exception as exc:  # noqa: BLE001 - one request's bad sampling fails that request, not its batch
                    await self._fail(job, f"first token failed: {type(exc).__name__}: {exc}")

    def _trace_batch(self, span, io: BatchLayerIO, result, actual_s: float) -> None:
        """The batch's figures and its layer spans; ``layer_trace_s`` is what the layer spans cost."""
        t0 = time.perf_counter()
        layer_spans = io.emit_layer_spans(tracer, result.fetch_wait_s, result.store_wait_s)
        span.set_attributes(
            {
                "actual_s": actual_s,
                "compute_s": result.compute_s,
                "kv_wait_s": result.wait_s,
                "fetch_bytes": io.stats.fetch_bytes,
                "store_bytes": io.stats.store_bytes,
                "layer_spans": layer_spans,
                "layer_trace_s": time.perf_counter() - t0,
            }
        )

    # ---- handoff ---------------------------------------------------------------------------
    async def _handoff(self, job: Job, logits: torch.Tensor) -> None:
        t = job.task
        params = SamplingParams(**t.sampling)
        gen = torch.Generator(device="cpu").manual_seed(params.seed) if params.seed is not None else None
        suppress = params.ignore_eos or params.min_tokens > 0
        failure: Exception | None = None
        with tracer.start_as_current_span("prefill.handoff", context=trace.set_span_in_context(job.span)):
            tok = sample(
                logits.float().cpu(),
                [params],
                [gen],
                suppress_eos=[suppress],
                eos_ids=self.setup.eos_ids,
                constraints=[grammar_constraint(params, self.setup.model_dir)],
            )[0]
            top = [[i, lp] for i, lp in tok.top_logprobs]
            await self.bus.publish(
                t.reply_subject,
                m.TokenEvent(
                    request_id=t.request_id,
                    index=0,
                    token_ids=[tok.token_id],
                    logprobs=[tok.logprob],
                    top_logprobs=[top],
                    ts=time.time(),
                    attempt=t.attempt,
                    decode_engine=t.decode_engine,
                ),
            )
            task = m.DecodeTask(
                request_id=t.request_id,
                model=t.model,
                model_digest=t.model_digest,
                prompt_tokens=t.prompt_tokens,
                block_hashes=t.block_hashes,
                cached_blocks=job.hit_blocks,
                first_token=tok.token_id,
                first_logprob=tok.logprob,
                first_top_logprobs=top,
                sampling=t.sampling,
                reply_subject=t.reply_subject,
                de_region_id=job.dest.region_id,
                de_offset=t.de_offset,
                read_path=t.read_path,
                prefill_engine=self.cfg.engine_id,
                attempt=t.attempt,
                trace=t.trace,
                timing={**self._ttft_split(job), "read_split": job.read_split},
                chain_root=t.chain_root,
            )  # merged into the dualpath record
            answer: m.Ok | None = None
            try:
                answer = await self.bus.request(self.subjects.decode(t.decode_engine), task, m.Ok, timeout=TIMEOUTS.decode_dispatch)
            except Exception as exc:  # noqa: BLE001
                failure = exc
        if answer is not None and answer.detail == "superseded":
            # The decode engine holds (or ran) a newer run of the request: this attempt is over,
            # not done. Reported finished, it would leave its scheduler waiting for a decode
            # that never comes (a scheduler given an older submission after it ran the newer).
            await self._fail(job, f"handoff to {t.decode_engine} refused: a newer run of the request exists", abandoned=True)
            return
        if failure is not None:
            await self._fail(
                job,
                f"handoff to {t.decode_engine} failed: {failure}",
                unreachable=t.decode_engine if isinstance(failure, BusTimeoutError) else "",
            )
            return
        await self._drop(job)
        log.info(
            "prefill_done",
            request_id=t.request_id,
            decode_engine=t.decode_engine,  # where it decodes now
            read_path=read_path_name(t.read_path),
            read_split=job.read_split,  # [PE blocks, DE blocks] read
            hit_blocks=job.hit_blocks,
            tokens=len(t.prompt_tokens),
            seconds=round(time.perf_counter() - job.t_submit, 4),
        )

    async def _drop(self, job: Job, *, failed: bool = False) -> None:
        """Forget ``job``; reported finished (with its attempt) unless it was superseded or
        ``failed`` (its ``TaskFailed`` tells the scheduler: a failure is not a finish)."""
        rid = job.task.request_id
        finished = not job.superseded and not failed
        if finished:  # the scheduler counts it done here
            self.finished.append((rid, job.task.attempt))
        cmds = self.requests.leave(job.held, finished=finished)
        job.span.end()
        job.span = trace.INVALID_SPAN
        if job.pe_slot:
            job.pe_slot = False
            try:
                await self.bus.request(
                    self.subjects.tm(self.node_id, "free"),
                    m.FreeRequest(request_id=job.task.request_id, attempt=job.task.attempt),
                    m.Ok,
                    timeout=TIMEOUTS.tm_free,
                )
            except Exception as exc:  # noqa: BLE001
                log.warning("pe_slot_free_failed", request_id=job.task.request_id, error=str(exc))
        await self._apply(cmds)  # its successor starts

    async def _fail(self, job: Job, reason: str, unreachable: str = "", node_unreachable: str = "", abandoned: bool = False) -> None:
        """Forget ``job`` and tell the scheduler with a ``TaskFailed`` (none for a superseded
        job: it would make the scheduler retry the attempt that superseded it). ``abandoned``:
        the request needs nothing more (a newer run holds it, or its client cancelled it), so
        the scheduler drops it instead of retrying."""
        rid = job.task.request_id
        if abandoned:
            log.info("task_abandoned", request_id=rid, reason=reason)
        else:
            log.warning("task_failed", request_id=rid, reason=reason)
            job.span.set_status(Status(StatusCode.ERROR, reason))
        await self._drop(job, failed=True)
        if job.superseded:
            return
        await self.bus.publish(
            self.subjects.task_failed(self.cfg.engine_id),
            m.TaskFailed(
                request_id=rid,
                engine_id=self.cfg.engine_id,
                reason=reason,
                unreachable=unreachable,
                node_unreachable=node_unreachable,
                attempt=job.task.attempt,
                abandoned=abandoned,
            ),
        )

    async def _drop_stopped(self, job: Job) -> None:
        """Forget a job stopped before its hand-off: silently when superseded; a client's cancel
        is told as abandoned (reported finished, the request would wait at its scheduler for a
        decode that never comes, holding its decode engine's share)."""
        if job.superseded:
            await self._drop(job)
        else:
            await self._fail(job, "cancelled by its client", abandoned=True)

    # ---- reporting -------------------------------------------------------------------------
    def report(self) -> m.EngineReport:
        """In the scheduler's units (see ``m.EngineReport``): ``seq_e``: unfinished tasks here;
        ``tok_e``: the miss tokens they still have to compute (``tokens_left``)."""
        tok = self.tokens_left()
        held = self.requests.holding()
        done, self.finished = self._named.name(self.finished), []
        return m.EngineReport(
            engine_id=self.cfg.engine_id,
            role=m.Role.PREFILL,
            node_id=self.node_id,
            seq=len(self.requests),
            tok=tok,
            free_hbm_tokens=0,
            capacity_tokens=0,
            finished=[rid for rid, _ in done],
            finished_attempts=[attempt for _, attempt in done],
            holding=[rid for rid, _ in held],
            holding_attempts=[attempt for _, attempt in held],
            block_bytes=self.setup.layout.block_bytes,
            stats=self._stats(),
            ts=time.time(),
        )

    def tokens_left(self) -> int:
        """Miss tokens still to compute: the batcher's queue, plus the prompts not in it yet
        (loading: less the hits planned, as the scheduler charged them; loaded: less the
        blocks actually loaded)."""
        bt = self.setup.layout.block_tokens
        queued = 0
        for held in self.requests:
            j: Job = held.state
            if held.request_id not in self.batcher:
                queued += miss_tokens(len(j.task.prompt_tokens), _planned(j.task, bt) if j.loading else j.hit_blocks, bt)
        return queued + self.batcher.tokens_left()

    def _stats(self) -> dict:
        return {
            "busy_s": self.busy_s,
            "kv_wait_s": self.kv_wait_s,
            "buffer_waits": self.buffer_waits,
            **self.setup.decoder.stats(),  # testbed: modeled and attention seconds, model traffic, CNIC bytes
        }
