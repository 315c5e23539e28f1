"""``Gateway``: request preparation, submission and token-stream consumption (no HTTP here)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import anyio
from anyio.abc import TaskGroup
from opentelemetry import trace

from dualpath.bus import Bus, BusTimeoutError
from dualpath.chat.errors import ChatError
from dualpath.chat.plan import ChatPlan, plan_chat
from dualpath.chat.reasoning import ReasoningFormat, reasoning_format
from dualpath.chat.tools import ToolFormat, format_for_template, tool_format
from dualpath.config import BusConfig, GatewayConfig, ModelConfigSpec
from dualpath.kv import block_hashes, chain_root, model_digest, pack_hashes, readable_hit_blocks
from dualpath.model import ModelConfig, Tokenizer
from dualpath.protocol import ProtocolError, RemoteError, decode
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from dualpath.protocol.timeouts import TIMEOUTS
from dualpath.structured.grammar import vocabulary
from dualpath.telemetry.logs import get_logger
from dualpath.telemetry.tracing import carrier, flush_tracing, get_tracer
from dualpath.tenant import RateLimitedError
from services.gateway.api_types import ChatCompletionRequest, CompletionRequest
from services.gateway.detok import Detokenizer
from services.gateway.observe import RequestTelemetry
from services.gateway.response_store import ResponseStore
from services.gateway.streams import Restarted, StreamOverflowError, TokenStreams, stream_key
from services.gateway.tenancy import Tenancy, scoped_session

__all__ = ["ApiError", "Gateway", "Prepared", "StreamPart"]

log = get_logger("gateway")
tracer = get_tracer("dualpath.gateway")
_FAILOVER_S = 6.0  # a standby scheduler takes over within its lease TTL (3 s) plus its poll (dualpath.ha.lease)
# After a failover, once the new scheduler has heard every live engine (they report every
# 0.2 s; one silent this long would be expelled): the started requests whose decode engine it
# does not list, and that sent no token for as long, died with their engine before it took
# over, and are resubmitted (``_resubmit_orphans``).
_ORPHAN_CHECK_S = 3.0
_KNOWN_SCHEDULERS = 64  # scheduler instances remembered (a late heartbeat of one of them is not a restart)
_READ_PATHS = {"auto": m.ReadPath.AUTO, "pe": m.ReadPath.PE, "de": m.ReadPath.DE}


class ApiError(Exception):
    """An HTTP error answer: status, OpenAI error type, the offending parameter, extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        etype: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.etype, self.param = status, message, etype, param
        self.headers = headers or {}


@dataclass(slots=True, kw_only=True)
class Prepared:
    prompt_tokens: list[int]
    sampling: dict
    stops: list[str]
    stream: bool
    include_usage: bool
    want_logprobs: bool
    read_path: int
    t_start_ns: int = 0  # arrival (epoch ns): the request's root span starts here
    t_tokenized_ns: int = 0
    tool_format: ToolFormat | None = None  # parse the answer into tool_calls with it (chat with tools)
    session: str = ""  # agent session id: dualpath_session, else the X-Session-ID header (app), else the OpenAI user field
    user: str = ""  # the OpenAI user field
    constrained: bool = False  # a grammar constrains the answer (structured output or forced tool call)
    reasoning: ReasoningFormat | None = None  # split <think>…</think> off the answer with it (chat, unconstrained)
    in_reasoning: bool = False  # the answer starts inside the reasoning (the prompt opened it)
    hit_tokens: int = 0  # prompt tokens found persisted at admission (the engines report the final figure)
    cache_salt: str = ""  # the request's cache_salt (vLLM's name): its prompt hashes apart from other salts
    tenant: str = ""  # the caller's tenant (its API key's; "" on an open gateway), set by ``Gateway.submit``


@dataclass(slots=True, kw_only=True)
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    finish_reason: str = "stop"
    stop_string: str = ""  # the stop string that ended the answer ("" : none did)
    cached_tokens: int = 0
    info: dict = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class StreamPart:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list
    finish_reason: str | None = None
    error: str = ""
    error_code: int = 0
    info: dict = field(default_factory=dict)
    result: Result | None = None


class Gateway:
    def __init__(self, cfg: GatewayConfig, bus_cfg: BusConfig, model: ModelConfigSpec) -> None:
        if not model.model:
            raise ValueError("the gateway needs --model (a checkpoint directory, for its tokenizer and config)")
        self.cfg, self.bus_cfg = cfg, bus_cfg
        self.subjects = Subjects(bus_cfg.namespace)
        self.tokenizer = Tokenizer.from_dir(model.model)
        self.model_config = ModelConfig.from_dir(model.model)
        self.model_spec = model
        self.model_dir = str(Path(model.model).resolve())
        if cfg.tool_parser in ("", "auto"):
            try:
                self.tool_format = format_for_template(self.tokenizer.chat_template.pick(tools=True))
            except ChatError:  # several named templates and no default: requests name theirs
                self.tool_format = tool_format("hermes")
        else:
            self.tool_format = tool_format(cfg.tool_parser)  # ValueError names the known ones
        self.reasoning_format = reasoning_format(cfg.reasoning_parser)  # ValueError names the known ones
        self.model_name = model.model_name or Path(model.model).resolve().name
        self.model_digest = model_digest(self.model_name)
        self.block_tokens = model.block_tokens
        self.max_context = cfg.max_prompt_tokens or self.model_config.max_position_embeddings
        self.started = int(time.time())
        self.streams = TokenStreams()
        self.telemetry = RequestTelemetry()
        self.tenancy = Tenancy.from_config(cfg)  # KeyFileError names a bad line of the key file
        self.bus: Bus | None = None
        self._tasks: TaskGroup | None = None
        self._responses: ResponseStore | None = None  # stored /v1/responses answers (JetStream KV), once connected
        self._submitted: dict[str, m.SubmitRequest] = {}  # admitted and not finished: resubmitted after a failover
        self._schedulers: dict[str, None] = {}  # scheduler instances heard from, oldest first (``_scheduler_seen``)

    @asynccontextmanager
    async def lifespan(self, _app):
        async with (
            Bus.open(self.bus_cfg.urls(), f"gateway-{self.cfg.gateway_id}", **self.bus_cfg.connect_options()) as bus,
            anyio.create_task_group() as tasks,
        ):
            self.bus, self._tasks = bus, tasks
            self._responses = ResponseStore(bus.nc.jetstream(), self.subjects.responses, ttl_s=self.cfg.responses_ttl_s)
            await bus.subscribe_raw(self.subjects.tokens_wildcard(self.cfg.gateway_id), self.streams.on_message)
            await bus.subscribe_raw(self.subjects.sched_alive, self._on_scheduler_alive)
            await bus.subscribe_raw(self.subjects.engine_lost, self._on_engine_lost)
            try:  # the grammar vocabulary (~1 s per 100K tokens), built now rather than in the first structured request
                await asyncio.to_thread(vocabulary, self.model_dir, self.model_config.vocab_size)
            except Exception as exc:  # noqa: BLE001 - structured outputs then fail per request with a clear error
                log.warning("grammar_vocabulary_failed", error=str(exc))
            log.info("gateway_ready", model=self.model_name, port=self.cfg.port)
            try:
                yield
            finally:
                tasks.cancel_scope.cancel()
                # uvicorn re-raises SIGTERM once shut down, ending the process before main's
                # shutdown_tracing: the last requests' spans must be out by now.
                flush_tracing()

    def _connected(self) -> Bus:
        """The bus (connected in ``lifespan``).

        Raises:
            ApiError: 503 before the gateway is connected.
        """
        if self.bus is None:
            raise ApiError(503, "the gateway is not connected to the bus yet", etype="server_error")
        return self.bus

    def response_store(self) -> ResponseStore:
        """The shared store of ``/v1/responses`` answers.

        Raises:
            ApiError: 503 before the gateway is connected.
        """
        self._connected()
        assert self._responses is not None  # set with the bus
        return self._responses

    def store_limit(self) -> int:
        """Bytes of input a stored response may hold: a share of the server's max payload, so
        the entry (input, output, response fields) fits in one JetStream message."""
        return int(self._connected().nc.max_payload * 0.75)

    # ---- preparation -----------------------------------------------------------------------
    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(
                404, f"model {name!r} does not exist; this server serves {self.model_name!r}", etype="not_found_error", param="model"
            )

    def _sampling(self, body, max_new: int, top_logprobs: int, logprobs: bool, grammar: str | None) -> dict:
        out = {
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "max_tokens": max_new,
            "min_tokens": min(body.min_tokens, max_new),
            "ignore_eos": body.ignore_eos,
            "seed": body.seed,
            "logprobs": logprobs,
            "top_logprobs": top_logprobs,
        }
        if grammar:
            out["grammar"] = grammar
        return out

    def _finish_prepare(
        self,
        body,
        tokens: list[int],
        logprobs: bool,
        top: int,
        t_start_ns: int = 0,
        *,
        grammar: str | None = None,
        tool_fmt: ToolFormat | None = None,
        clamp: bool = False,
    ) -> Prepared:
        if not tokens:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if len(tokens) >= self.max_context:
            raise ApiError(
                400,
                f"this model's maximum context length is {self.max_context} tokens, but the prompt has "
                f"{len(tokens)} tokens; shorten the prompt",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            )
        room = self.max_context - len(tokens)
        asked = body.max_completion_tokens or body.max_tokens
        if clamp and asked is not None:
            asked = min(asked, room)  # an upper bound (Messages, Responses): agents ask for more than a context holds
        if asked is not None and asked > room:
            raise ApiError(
                400,
                f"max_tokens={asked} plus the prompt's {len(tokens)} tokens exceeds the maximum context "
                f"length of {self.max_context} tokens",
                param="max_tokens",
            )
        max_new = asked or min(room, 256)
        return Prepared(
            prompt_tokens=tokens,
            sampling=self._sampling(body, max_new, top, logprobs, grammar),
            stops=body.stops(),
            stream=body.stream,
            include_usage=bool((body.stream_options or {}).get("include_usage")),
            want_logprobs=logprobs,
            read_path=_READ_PATHS[body.dualpath_read_path or "auto"],
            t_start_ns=t_start_ns,
            t_tokenized_ns=time.time_ns(),
            tool_format=tool_fmt,
            constrained=bool(grammar),
            session=body.dualpath_session or "",
            user=body.user or "",
            cache_salt=body.cache_salt or "",
        )

    def prepare_completion(self, body: CompletionRequest) -> Prepared:
        t_start_ns = time.time_ns()
        self._check_model(body.model)
        if isinstance(body.prompt, list):
            if any(not (0 <= t < self.model_config.vocab_size) for t in body.prompt):
                raise ApiError(400, f"prompt token ids must lie in [0, {self.model_config.vocab_size})", param="prompt")
            tokens = list(body.prompt)
        else:
            tokens = self.tokenizer.encode(body.prompt)
        top = body.logprobs or 0
        return self._finish_prepare(body, tokens, body.logprobs is not None, top, t_start_ns)

    def prepare_chat(self, body: ChatCompletionRequest, *, clamp: bool = False) -> Prepared:
        """Render the conversation with the checkpoint's template and plan tools / structured output.

        ``clamp``: a ``max_tokens`` beyond the context's room is cut to it instead of refused.

        Raises:
            ApiError: 400 naming the field for a bad message, tool, tool_choice or schema.
        """
        t_start_ns = time.time_ns()
        plan = self._plan_chat(body)
        prep = self._finish_prepare(
            body,
            self.tokenizer.encode(plan.prompt),
            body.logprobs,
            body.top_logprobs or 0,
            t_start_ns,
            grammar=plan.grammar,
            tool_fmt=plan.tool_format,
            clamp=clamp,
        )
        if self.reasoning_format is not None and plan.grammar is None:  # a grammar's answer has no reasoning part
            prep.reasoning, prep.in_reasoning = self.reasoning_format, self.reasoning_format.opens_in_reasoning(plan.prompt)
        return prep

    def count_chat(self, body: ChatCompletionRequest) -> int:
        """The prompt tokens ``body`` renders to, however long (``/v1/messages/count_tokens``).

        Raises:
            ApiError: as ``prepare_chat`` for a bad message, tool or schema.
        """
        return len(self.tokenizer.encode(self._plan_chat(body).prompt))

    def _plan_chat(self, body: ChatCompletionRequest) -> ChatPlan:
        self._check_model(body.model)
        messages = [msg.model_dump(exclude_none=True) for msg in body.messages]
        for msg, raw in zip(messages, body.messages):
            if raw.content is None and raw.role == "assistant" and raw.tool_calls:
                msg["content"] = None  # DeepSeek-style templates test ``content is none``
        needs_grammar = bool(body.response_format and body.response_format.get("type") not in (None, "text")) or (
            bool(body.tools) and body.tool_choice not in (None, "none", "auto")
        )
        try:
            vocab = vocabulary(self.model_dir, self.model_config.vocab_size) if needs_grammar else None
        except Exception as exc:  # noqa: BLE001 - llguidance cannot read this tokenizer
            raise ApiError(
                500, f"structured outputs are unavailable for this checkpoint's tokenizer: {exc}", etype="server_error"
            ) from None
        try:
            plan = plan_chat(
                messages,
                template=self.tokenizer.chat_template,
                tool_format=self.tool_format,
                vocab=vocab,
                tools=body.tools,
                tool_choice=body.tool_choice,
                parallel_tool_calls=body.parallel_tool_calls,
                response_format=body.response_format,
                template_name=body.chat_template_name,
                template_kwargs=body.chat_template_kwargs,
            )
        except ChatError as exc:
            raise ApiError(400, exc.message, param=exc.param) from None
        return plan

    # ---- submission ------------------------------------------------------------------------
    async def _lookup(self, hashes: list[int]) -> int:
        if not hashes or not self.cfg.prefix_cache:
            return 0
        try:
            reply = await self._connected().request(
                self.subjects.kv_lookup,
                m.LookupRequest(model_digest=self.model_digest, hashes=pack_hashes(hashes)),  # the index decodes only what it probes
                m.LookupReply,
                timeout=TIMEOUTS.kv_lookup,
            )
            return reply.hit_blocks
        except (BusTimeoutError, RemoteError) as exc:
            log.warning("kv_lookup_failed", error=str(exc))  # serve anyway, as a full recompute
            return 0

    async def submit(self, rid: str, prep: Prepared, *, tenant: str) -> None:
        """Admit ``rid`` under ``tenant``'s limits, look up the hit in the tenant's part of the
        cache, hand the request to the scheduler, open its token stream.

        Opens the request's root span; ``finish`` closes it (and ends the tenant's lease).

        Raises:
            ApiError: 429 with Retry-After when the tenant is over a limit or the scheduler is
                full, 503 when no scheduler answers, 400/409 when it refuses the request (empty
                or larger than any decode engine's KV memory / a duplicate id).
        """
        prep.tenant = tenant
        try:
            self.tenancy.admit(rid, tenant, len(prep.prompt_tokens))
        except RateLimitedError as exc:
            self.telemetry.figures.limited[(tenant, exc.limit)] += 1
            log.info("tenant_rate_limited", tenant=tenant, limit=exc.limit, retry_after_s=exc.retry_after_s)
            raise ApiError(429, str(exc), etype="rate_limit_exceeded", headers={"Retry-After": str(exc.retry_after_s)}) from None
        root = self.telemetry.start(
            rid,
            prompt_tokens=len(prep.prompt_tokens),
            read_path=prep.read_path,
            stream=prep.stream,
            t_start_ns=prep.t_start_ns,
            t_tokenized_ns=prep.t_tokenized_ns,
            tenant=tenant,
        )
        try:
            await self._admit(rid, prep, root)
        except Exception as exc:
            self._forget(rid)
            self.telemetry.outcome(rid, "error", error=exc.message if isinstance(exc, ApiError) else str(exc))
            self.telemetry.end(rid)
            raise

    async def _admit(self, rid: str, prep: Prepared, root: trace.Span) -> None:
        attrs = {"request_id": rid, "prompt_tokens": len(prep.prompt_tokens)}
        with tracer.start_as_current_span("gateway.admit", context=trace.set_span_in_context(root), attributes=attrs) as span:
            # The tenant and cache_salt seed the chain: no block hash (so no hit, and no faster
            # first token) is shared with another tenant or salt; both empty: today's chains.
            seed = chain_root(prep.tenant, prep.cache_salt)
            hashes = block_hashes(self.model_name, prep.prompt_tokens, block_tokens=self.block_tokens, parent=seed)
            hit = await self._lookup(hashes)
            hit = readable_hit_blocks(len(prep.prompt_tokens), hit, self.block_tokens)  # the last prompt token is computed
            prep.hit_tokens = hit * self.block_tokens
            if span.is_recording():
                span.set_attributes({"blocks": len(hashes), "hit_blocks": hit})
            self.streams.open(rid, restartable=not prep.stream)  # nothing is shown before the end: a new run may start over
            req = m.SubmitRequest(
                request_id=rid,
                model=self.model_name,
                model_digest=self.model_digest,
                prompt_tokens=prep.prompt_tokens,
                block_hashes=hashes,
                hit_blocks=hit,
                sampling=prep.sampling,
                reply_subject=self.subjects.tokens(self.cfg.gateway_id, rid),
                read_path=int(prep.read_path),
                block_tokens=self.block_tokens,
                arrival_ts=time.time(),
                trace=carrier(root),
                session=scoped_session(prep.tenant, prep.session),
                chain_root=seed,
            )
            self._submitted[rid] = req  # from now on a scheduler failover resubmits it (``_scheduler_seen``)
            try:
                await self._submit(req)
            except BusTimeoutError as exc:
                self._forget(rid)
                raise ApiError(503, f"no scheduler available: {exc}", etype="server_error") from None
            except RemoteError as exc:
                if exc.code == 409:  # ids are unique: a resubmission after a failover got there first
                    return
                self._forget(rid)
                if exc.code == 400:  # the scheduler refused this request (empty, larger than any decode engine)
                    raise ApiError(exc.code, exc.message) from None
                raise ApiError(429 if exc.code == 429 else 503, exc.message, etype="server_error") from None

    def _forget(self, rid: str) -> None:
        self._submitted.pop(rid, None)
        self.streams.close(rid)
        self.tenancy.release(rid)

    async def _submit(self, req: m.SubmitRequest) -> None:
        """Submit, waiting out a scheduler failover: while no scheduler listens (the active one died
        and a standby is taking the lease over), or the one that received it died before answering
        (no reply), the submit is sent again for up to ``_FAILOVER_S`` after the first try. Sending
        it again is safe: a scheduler that already has the request answers 409, which the callers
        take as accepted. It is not sent again once superseded (answered, or submitted anew after
        a failover meanwhile): a scheduler that had run the newer submission to its end would
        take the old one for a new request and run it for nobody. Raises BusTimeoutError and
        RemoteError like ``Bus.request``."""
        deadline = time.monotonic() + _FAILOVER_S
        while True:
            try:
                reply = await self._connected().request(self.subjects.submit, req, m.SubmitReply, timeout=TIMEOUTS.submit)
                self._scheduler_seen(reply.instance)
                return
            except BusTimeoutError as exc:
                if time.monotonic() >= deadline:
                    raise
                if exc.no_responders:
                    await asyncio.sleep(0.2)
                else:  # its scheduler may have died holding it: ask the next one at once
                    log.warning("submit_unanswered", request_id=req.request_id)
            if self.streams.superseded(req.request_id, req.submission):
                log.info("submit_superseded", request_id=req.request_id, submission=req.submission)
                return

    # ---- scheduler failover -----------------------------------------------------------------
    async def _on_scheduler_alive(self, raw) -> None:
        """The active scheduler's heartbeat (``Subjects.sched_alive``)."""
        try:
            beat = decode(raw.data, m.SubmitReply)
        except ProtocolError as exc:
            log.warning("bad_scheduler_heartbeat", error=exc.reason)
            return
        self._scheduler_seen(beat.instance)

    def _scheduler_seen(self, instance: str) -> None:
        """A scheduler instance answered a submit or sent its heartbeat (the active one only: a
        standby is silent; under a lease the instance is ``holder@revision`` of its acquisition).
        One never heard from before, after another was, is a new leader or a restarted
        scheduler: the requests the old one held died with it, so every request that no run has
        started is resubmitted (409 from one that knows it: nothing runs twice). A late beat of
        an old instance changes nothing."""
        if not instance or instance in self._schedulers:
            return
        restarted = bool(self._schedulers)
        self._schedulers[instance] = None
        while len(self._schedulers) > _KNOWN_SCHEDULERS:
            del self._schedulers[next(iter(self._schedulers))]
        if restarted and self._tasks is not None:
            log.warning("scheduler_restarted", instance=instance)
            self._resubmit_unstarted()
            self._tasks.start_soon(self._resubmit_orphans)

    def _resubmit_unstarted(self) -> None:
        assert self._tasks is not None  # only ``_scheduler_seen`` (in the lifespan) calls this
        for rid, req in list(self._submitted.items()):
            if not self.streams.started(rid):
                self._tasks.start_soon(self._resubmit, rid, req)

    # ---- started requests whose decode engine was lost ------------------------------------------
    # The scheduler that placed a started request retries it when its engine dies; one that took
    # over after a failover never heard of it (only unstarted requests are resubmitted at once),
    # so the gateway resubmits it when its engine is lost. A scheduler that knows it answers 409;
    # the new run's tokens resume the answer exactly where it stopped (``TokenStreams``).
    async def _on_engine_lost(self, raw) -> None:
        """The active scheduler stopped using an engine (``Subjects.engine_lost``)."""
        try:
            lost = decode(raw.data, m.EngineLost)
        except ProtocolError as exc:
            log.warning("bad_engine_lost", error=exc.reason)
            return

        def served_by_lost(name: str, incarnation: str) -> bool:
            return name == lost.engine_id and (not incarnation or not lost.incarnation or incarnation == lost.incarnation)

        self._resubmit_served_by(served_by_lost, why=f"engine lost: {lost.reason}")

    async def _resubmit_orphans(self) -> None:
        """After a failover: resubmit the started requests whose decode engine the new scheduler
        does not list (dead before it took over, or restarted since: another incarnation)."""
        await asyncio.sleep(_ORPHAN_CHECK_S)
        state = await self.cluster_state()
        if state is None:
            log.warning("orphan_check_skipped", reason="no scheduler answered")
            return
        live = {e.get("engine_id", ""): e.get("incarnation", "") for e in state.engines}

        def not_live(name: str, incarnation: str) -> bool:
            return name not in live or bool(incarnation and live[name] and live[name] != incarnation)

        self._resubmit_served_by(not_live, why="engine not listed after the failover", idle_s=_ORPHAN_CHECK_S)

    def _resubmit_served_by(self, lost: Callable[[str, str], bool], why: str, idle_s: float = 0.0) -> None:
        """Resubmit every started, unfinished request whose decode engine ``lost(name, incarnation)``
        (and that sent no token for ``idle_s``)."""
        if self._tasks is None:
            return
        for rid, req in list(self._submitted.items()):
            name, _, incarnation = self.streams.serving(rid, idle_s).partition("@")
            if name and lost(name, incarnation):
                log.warning("request_engine_lost", request_id=rid, engine=name, why=why)
                self._tasks.start_soon(self._resubmit, rid, req)

    async def _resubmit(self, rid: str, req: m.SubmitRequest) -> None:
        """Submit ``rid`` again under a new reply subject (its runs are told apart by it)."""
        n = self.streams.next_submission(rid)
        if not n:
            return  # finished meanwhile
        again = replace(req, reply_subject=self.subjects.tokens(self.cfg.gateway_id, stream_key(rid, n)), submission=n)
        try:
            await self._submit(again)
        except RemoteError as exc:
            if exc.code == 409:  # the active scheduler has it already
                log.info("resubmission_known", request_id=rid, submission=n)
            else:
                self.streams.fail(rid, f"resubmission after a scheduler failover refused: {exc.message}", 429 if exc.code == 429 else 503)
            return
        except BusTimeoutError as exc:
            self.streams.fail(rid, f"no scheduler available after a failover: {exc}", 503)
            return
        log.warning("request_resubmitted", request_id=rid, submission=n)

    async def cancel(self, rid: str, reason: str) -> None:
        if self.bus is not None:
            await self.bus.publish(self.subjects.cancel, m.CancelRequest(request_id=rid, reason=reason))

    def finish(self, rid: str) -> None:
        """The answer went out (or the client left): close the stream and the request's span."""
        self._forget(rid)
        self.telemetry.end(rid)

    async def cluster_state(self) -> m.StateReply | None:
        try:
            return await self._connected().request(self.subjects.sched_state, m.StateRequest(), m.StateReply, timeout=TIMEOUTS.sched_state)
        except (BusTimeoutError, RemoteError):
            return None

    # ---- answers ---------------------------------------------------------------------------
    async def stream(self, rid: str, prep: Prepared) -> AsyncIterator[StreamPart]:
        """Text deltas as tokens arrive; the last part has ``finish_reason`` and ``result``."""
        detok = Detokenizer(self.tokenizer, prep.stops)
        res = Result()
        try:
            async for ev in self.streams.events(rid, self.cfg.request_timeout):
                if isinstance(ev, Restarted):  # a new run of a non-streamed request: its answer starts over
                    detok, res = Detokenizer(self.tokenizer, prep.stops), Result()
                    continue
                self.telemetry.on_event(rid, ev)
                if ev.error:
                    res.finish_reason = "error"
                    yield StreamPart(
                        text="",
                        token_ids=[],
                        logprobs=[],
                        top_logprobs=[],
                        finish_reason="error",
                        error=ev.error,
                        error_code=ev.error_code,
                        info=ev.info,
                        result=res,
                    )
                    return
                ids = list(ev.token_ids)
                self.tenancy.charge(rid, len(ids))
                text = detok.add(ids)
                res.token_ids += ids
                res.logprobs += ev.logprobs
                res.top_logprobs += ev.top_logprobs
                if detok.stopped:
                    self.telemetry.outcome(rid, "stop", info=ev.info, cached_tokens=ev.cached_tokens)
                    await self.cancel(rid, "stop string")
                    res.text, res.stop_string = detok.emitted, detok.matched
                    res.cached_tokens, res.info = ev.cached_tokens, ev.info
                    yield StreamPart(
                        text=text,
                        token_ids=ids,
                        logprobs=ev.logprobs,
                        top_logprobs=ev.top_logprobs,
                        finish_reason="stop",
                        info=ev.info,
                        result=res,
                    )
                    return
                if ev.finish_reason is None:
                    yield StreamPart(text=text, token_ids=ids, logprobs=ev.logprobs, top_logprobs=ev.top_logprobs)
                    continue
                text += detok.flush()
                res.text, res.finish_reason = detok.emitted, ev.finish_reason
                res.cached_tokens, res.info = ev.cached_tokens, ev.info
                yield StreamPart(
                    text=text,
                    token_ids=ids,
                    logprobs=ev.logprobs,
                    top_logprobs=ev.top_logprobs,
                    finish_reason=ev.finish_reason,
                    info=ev.info,
                    result=res,
                )
                return
        except StreamOverflowError:
            self.telemetry.outcome(rid, "error", error="overflow")
            await self.cancel(rid, "client too slow")
            yield StreamPart(
                text="",
                token_ids=[],
                logprobs=[],
                top_logprobs=[],
                finish_reason="error",
                error="the client read the stream too slowly; the request was cancelled",
                error_code=503,
                result=res,
            )
        except TimeoutError:
            self.telemetry.outcome(rid, "error", error="timeout")
            await self.cancel(rid, "timeout")
            yield StreamPart(
                text="",
                token_ids=[],
                logprobs=[],
                top_logprobs=[],
                finish_reason="error",
                error=f"request did not finish within {self.cfg.request_timeout:.0f}s",
                error_code=504,
                result=res,
            )

    async def collect(self, rid: str, prep: Prepared) -> Result:
        """Wait for the whole answer (non-streaming).

        Raises:
            ApiError: the request failed in the cluster or timed out.
        """
        async for part in self.stream(rid, prep):
            if part.finish_reason == "error":
                raise ApiError(part.error_code or 500, part.error, etype="server_error")
            if part.finish_reason is not None and part.result is not None:
                return part.result
        raise ApiError(500, "token stream ended without a final event", etype="server_error")
