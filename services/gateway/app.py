"""The gateway's HTTP app: OpenAI ``/v1/completions`` and ``/v1/chat/completions`` (SSE or not),
``/v1/models``, ``/health``, and ``/metrics`` (Prometheus text, cluster-level figures); Anthropic's
``/v1/messages`` (``anthropic_api``) and OpenAI's ``/v1/responses`` (``responses_api``), which
translate to the same chat path.

A request is tokenized, its block hash chain looked up in kv-persistence (the hit), submitted
to the scheduler, and answered from its token stream. A chat answer with tools is parsed into
``tool_calls`` (streamed as OpenAI-style deltas, ``finish_reason: "tool_calls"``); with a
reasoning parser its ``<think>`` part becomes ``reasoning_content``. Errors use
OpenAI's JSON error body (Anthropic's on ``/v1/messages``), and every error status a route can answer is declared in the OpenAPI
document (``/openapi.json``), whose request ``model`` field is pinned to the served model.

With API keys set (``--api-key``, ``--api-key-file``: ``services.gateway.tenancy``), every route
but ``/health`` (liveness/readiness probes) needs ``Authorization: Bearer KEY`` or
``x-api-key: KEY``: ``/v1/*``, ``/metrics`` (Prometheus sends it with
``authorization.credentials``), ``/openapi.json`` and ``/docs`` alike; any other path too, so
that an unknown caller learns nothing, not even which routes exist. The key names the caller's
tenant: its own part of the KV cache, its limits (429 with Retry-After), its label on /metrics.
/metrics answers any tenant's key: it is the operator's page (give the scraper a key of its own).
"""

from __future__ import annotations

import inspect
import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from services.gateway import anthropic_api, responses_api
from services.gateway.answer import AnswerDeltas, parse_answer, session_of
from services.gateway.api_types import ERROR_RESPONSES, REQUEST_ERROR_RESPONSES, ChatCompletionRequest, CompletionRequest
from services.gateway.core import ApiError, Gateway, Prepared
from services.gateway.metrics_page import render_metrics
from services.gateway.tenancy import tenant_of

__all__ = ["build_app"]


OPEN_PATHS = frozenset({"/health"})  # answered without the API key: the probes' route
ANTHROPIC_PATHS = ("/v1/messages",)  # errors in Anthropic's shape

_STREAM_200: dict[int | str, dict[str, Any]] = {
    200: {"description": "the answer: JSON, or Server-Sent Events when stream is true", "content": {"text/event-stream": {}}}
}


def _error(
    status: int,
    message: str,
    *,
    etype: str = "invalid_request_error",
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
    path: str = "",
) -> JSONResponse:
    """The error answer in the shape of the route's protocol (Anthropic's under ``/v1/messages``)."""
    headers = dict(headers or {})
    if status in (429, 503):
        headers.setdefault("Retry-After", "1")  # overloaded or failing over: come back shortly (a tenant's limit says when)
    if path.startswith(ANTHROPIC_PATHS):
        return anthropic_api.error_response(status, message, headers)
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": etype, "param": param, "code": status}}, headers=headers
    )


def build_app(gw: Gateway) -> FastAPI:
    # FastAPI >= 0.16x traces every HTTP request on its own when a tracer provider is set: a
    # second trace per request beside the gateway's own root span (services.gateway.observe),
    # and one per health probe. Its HTTP metrics stay on.
    own: dict[str, Any] = (
        {"telemetry": {"tracing": False, "operation_spans": False}} if "telemetry" in inspect.signature(FastAPI).parameters else {}
    )
    app = FastAPI(title="DualPath gateway", lifespan=gw.lifespan, **own)

    @app.exception_handler(RequestValidationError)
    async def on_validation(req: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        field = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            return _error(400, f"malformed JSON body: {first.get('msg', '')}", path=req.url.path)
        return _error(
            422 if first.get("type") != "missing" else 400,
            f"{'field ' + repr(field) + ': ' if field else ''}{first.get('msg', 'invalid request')}",
            param=field,
            path=req.url.path,
        )

    @app.exception_handler(StarletteHTTPException)
    async def on_http(req: Request, exc: StarletteHTTPException) -> JSONResponse:
        etype = "not_found" if exc.status_code == 404 else "invalid_request_error"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Starlette's Allow names the first route on the path only: name every one
            headers["Allow"] = ", ".join(_allowed(app, req))
        return _error(exc.status_code, str(exc.detail), etype=etype, headers=headers, path=req.url.path)

    @app.exception_handler(ApiError)
    async def on_api_error(req: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, etype=exc.etype, param=exc.param, headers=exc.headers, path=req.url.path)

    @app.middleware("http")
    async def auth(request: Request, call_next):
        # Authorization: Bearer (OpenAI clients) or x-api-key (Anthropic clients), on every route
        if request.url.path not in OPEN_PATHS:
            tenant = gw.tenancy.authenticate(request.headers)
            if tenant is None:
                return _error(401, "invalid or missing API key", etype="authentication_error", path=request.url.path)
            request.state.tenant = tenant
        return await call_next(request)

    @app.get("/health", responses={503: {"description": "no scheduler, or no prefill or no decode engine"}, 405: ERROR_RESPONSES[405]})
    async def health() -> JSONResponse:
        state = await gw.cluster_state()
        ok = state is not None and state.prefill_engines > 0 and state.decode_engines > 0
        body: dict[str, Any] = {"status": "ok" if ok else "unavailable"}
        if state is not None:
            body.update(
                prefill_engines=state.prefill_engines,
                decode_engines=state.decode_engines,
                queued=state.queued,
                running=state.running,
                policy=state.policy,
                buffer_waits=state.buffer_waits,
            )
        return JSONResponse(status_code=200 if ok else 503, content=body)

    @app.get("/metrics", response_class=PlainTextResponse, responses=ERROR_RESPONSES)
    async def metrics() -> PlainTextResponse:
        state = await gw.cluster_state()
        return PlainTextResponse(render_metrics(gw.telemetry.figures, state), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": gw.model_name,
                    "object": "model",
                    "created": gw.started,
                    "owned_by": "dualpath",
                    "max_model_len": gw.max_context,
                    "dualpath": gw.model_config.describe(gw.model_config.serving_dtype(gw.model_spec.device, gw.model_spec.dtype)),
                }
            ],
        }

    @app.post("/v1/completions", responses={**REQUEST_ERROR_RESPONSES, **_STREAM_200})
    async def completions(body: CompletionRequest, request: Request):
        prep = await run_in_threadpool(gw.prepare_completion, body)  # tokenizing a long prompt: off the event loop
        return await _answer(gw, prep, request, chat=False)

    @app.post("/v1/chat/completions", responses={**REQUEST_ERROR_RESPONSES, **_STREAM_200})
    async def chat(body: ChatCompletionRequest, request: Request):
        prep = await run_in_threadpool(gw.prepare_chat, body)
        return await _answer(gw, prep, request, chat=True)

    anthropic_api.add_routes(app, gw)
    responses_api.add_routes(app, gw)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _pinned_openapi(
                app,
                gw.model_name,
                templates=sorted(gw.tokenizer.chat_template.templates),
                vocab=gw.model_config.vocab_size,
                secured=gw.tenancy.secured,
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _allowed(app: FastAPI, req: Request) -> list[str]:
    """Every method some route of ``app`` answers on ``req``'s path."""
    methods: set[str] = set()
    for route in app.router.routes:
        if isinstance(route, APIRoute) and route.matches({**req.scope, "method": "GET"})[0] != Match.NONE:
            methods |= route.methods or set()
    return sorted(methods)


_MODEL_PINNED = ("CompletionRequest", "MessagesRequest", "CountTokensRequest", "ResponsesRequest")


def _pinned_openapi(app: FastAPI, model_name: str, *, templates: list[str], vocab: int, secured: bool) -> dict[str, Any]:
    """FastAPI's document, with what this checkpoint decides pinned: each request's ``model`` an
    enum of the one served model (any other name is a 404: a client or fuzzer reading the
    document reaches the engines), ``chat_template_name`` one of the checkpoint's templates,
    prompt token ids below the vocabulary size; with an API key, a bearer security scheme on
    every route but the open ones. /metrics' errors are JSON beside its text/plain answer."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for name, comp in schema.get("components", {}).get("schemas", {}).items():
        props = comp.get("properties", {})
        if name.endswith(_MODEL_PINNED) and "model" in props:
            props["model"] = {"type": "string", "enum": [model_name], "title": "Model"}
        if "chat_template_name" in props:
            props["chat_template_name"] = {
                "anyOf": [{"type": "string", "enum": templates}, {"type": "null"}],
                "title": "Chat Template Name",
            }
        for alt in props.get("prompt", {}).get("anyOf", []):
            if alt.get("type") == "array":
                alt.setdefault("items", {})["maximum"] = vocab - 1
    for status, resp in schema.get("paths", {}).get("/metrics", {}).get("get", {}).get("responses", {}).items():
        if not status.startswith("2") and "text/plain" in resp.get("content", {}):
            resp["content"] = {"application/json": resp["content"].pop("text/plain")}
    if secured:
        schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, ops in schema.get("paths", {}).items():
            if path not in OPEN_PATHS:
                for op in ops.values():
                    op["security"] = [{"bearer": []}]
    return schema


async def _answer(gw: Gateway, prep: Prepared, request: Request, *, chat: bool):
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    prep.session = session_of(prep, request)
    await gw.submit(rid, prep, tenant=tenant_of(request))
    if prep.stream:
        return StreamingResponse(
            _sse(gw, rid, prep, request, chat), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Request-Id": rid}
        )
    try:
        result = await gw.collect(rid, prep)
    finally:
        gw.finish(rid)
    return JSONResponse(content=_full_body(gw, rid, prep, result, chat), headers={"X-Request-Id": rid})


def _usage(prep: Prepared, result) -> dict:
    return {
        "prompt_tokens": len(prep.prompt_tokens),
        "completion_tokens": len(result.token_ids),
        "total_tokens": len(prep.prompt_tokens) + len(result.token_ids),
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }


def _logprobs_chat(gw: Gateway, ids, lps, tops) -> dict:
    content = []
    for tid, lp, top in zip(ids, lps, tops):
        tok = gw.tokenizer.decode([tid])
        content.append(
            {
                "token": tok,
                "logprob": lp,
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {"token": gw.tokenizer.decode([t]), "logprob": lp_t, "bytes": list(gw.tokenizer.decode([t]).encode())}
                    for t, lp_t in top
                ],
            }
        )
    return {"content": content}


def _logprobs_completion(gw: Gateway, ids, lps, tops) -> dict:
    toks = [gw.tokenizer.decode([t]) for t in ids]
    return {
        "tokens": toks,
        "token_logprobs": list(lps),
        "top_logprobs": [{gw.tokenizer.decode([t]): lp_t for t, lp_t in top} for top in tops],
        "text_offset": [],
    }


def _finish_reason(finish: str, has_calls: bool) -> str:
    return "tool_calls" if has_calls and finish == "stop" else finish


def _full_body(gw: Gateway, rid: str, prep: Prepared, result, chat: bool) -> dict[str, Any]:
    created = int(time.time())
    if chat:
        parsed = parse_answer(prep, result.text)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
        if parsed.calls:
            message["tool_calls"] = [c.to_openai() for c in parsed.calls]
        choice = {
            "index": 0,
            "message": message,
            "finish_reason": _finish_reason(result.finish_reason, bool(parsed.calls)),
            "logprobs": _logprobs_chat(gw, result.token_ids, result.logprobs, result.top_logprobs) if prep.want_logprobs else None,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "logprobs": _logprobs_completion(gw, result.token_ids, result.logprobs, result.top_logprobs) if prep.want_logprobs else None,
        }
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": gw.model_name,
        "choices": [choice],
        "usage": _usage(prep, result),
        "dualpath": result.info,
    }


async def _sse(gw: Gateway, rid: str, prep: Prepared, request: Request, chat: bool):
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    tools = AnswerDeltas(prep) if chat and (prep.tool_format is not None or prep.reasoning is not None) else None

    def chunk(
        delta_text: str | None, finish: str | None, ids=(), lps=(), tops=(), extra: dict | None = None, delta: dict | None = None
    ) -> str:
        if chat:
            if delta is None:
                delta = {} if delta_text is None else {"content": delta_text}
            choice = {
                "index": 0,
                "delta": delta,
                "finish_reason": finish,
                "logprobs": _logprobs_chat(gw, ids, lps, tops) if prep.want_logprobs and ids else None,
            }
        else:
            choice = {
                "index": 0,
                "text": delta_text or "",
                "finish_reason": finish,
                "logprobs": _logprobs_completion(gw, ids, lps, tops) if prep.want_logprobs and ids else None,
            }
        body = {"id": rid, "object": obj, "created": created, "model": gw.model_name, "choices": [choice]}
        if extra:
            body.update(extra)
        return f"data: {json.dumps(body)}\n\n"

    try:
        if chat:
            first = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": gw.model_name,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}],
            }
            yield f"data: {json.dumps(first)}\n\n"
        async for part in gw.stream(rid, prep):
            if await request.is_disconnected():
                await gw.cancel(rid, "client disconnected")
                return
            if part.finish_reason is None:
                if tools is not None:
                    deltas = tools.feed(part.text)
                    if prep.want_logprobs and part.token_ids and not deltas:
                        deltas = [{}]  # text held back (a call may be starting): its tokens' logprobs go out now
                    for delta in deltas[:-1]:
                        yield chunk(None, None, delta=delta)
                    if deltas:  # the part's logprobs ride on its last delta
                        yield chunk(None, None, part.token_ids, part.logprobs, part.top_logprobs, delta=deltas[-1])
                elif part.text or part.token_ids:
                    yield chunk(part.text, None, part.token_ids, part.logprobs, part.top_logprobs)
                continue
            extra = {"dualpath": part.info}
            if prep.include_usage:
                extra["usage"] = _usage(prep, part.result)
            if part.finish_reason == "error":
                yield f"data: {json.dumps({'error': {'message': part.error, 'type': 'server_error', 'code': part.error_code or 500}})}\n\n"
            elif tools is not None:
                for delta in [*tools.feed(part.text), *tools.finish()]:
                    yield chunk(None, None, delta=delta)
                finish = _finish_reason(part.finish_reason, bool(tools.calls))
                yield chunk(None, finish, part.token_ids, part.logprobs, part.top_logprobs, extra=extra, delta={})
            else:
                yield chunk(part.text or None, part.finish_reason, part.token_ids, part.logprobs, part.top_logprobs, extra)
        yield "data: [DONE]\n\n"
    finally:
        gw.finish(rid)
