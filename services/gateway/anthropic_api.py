"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) on the
chat path: a request becomes a chat request (the checkpoint's template renders it, tools as the
template expects them), and the answer's reasoning, text and tool calls become ``thinking``,
``text`` and ``tool_use`` blocks.

- ``system``: a string or text blocks; ``messages``: ``text``, ``tool_use``, ``tool_result``
  (string or text blocks, ``is_error``), ``thinking`` / ``redacted_thinking`` blocks (a
  ``system`` role inside ``messages``, as Claude Code sends, stays where it is).
- ``tool_choice``: ``auto``/``any``/``tool``/``none`` -> the chat ``auto``/``required``/named/
  ``none`` (``any`` and ``tool`` are forced by a grammar); ``disable_parallel_tool_use``.
- ``max_tokens`` is an upper bound: cut to the context's room, never refused for it.
- ``metadata.user_id`` is the agent session (scheduler history, prefetch).
- ``cache_control`` is accepted on any block and changes nothing: every full block of every
  prompt is persisted and reused anyway.
- Usage: ``cache_read_input_tokens`` are the prompt tokens whose KV was read from storage,
  ``cache_creation_input_tokens`` the prompt's other full blocks (persisted by this request),
  ``input_tokens`` the rest.

Not supported (a 400 ``invalid_request_error`` naming the block, tool or field): image, document
and search-result blocks, server tools (``web_search_*``, ``bash_*``, ...), ``mcp_servers``,
``container``.
Errors have Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from services.gateway.answer import AnswerDeltas, parse_answer, session_of
from services.gateway.api_types import CACHE_SALT_MAX, ChatCompletionRequest, JsonInt
from services.gateway.core import ApiError, Gateway, Prepared, Result
from services.gateway.tenancy import tenant_of

__all__ = ["ANTHROPIC_ERROR_RESPONSES", "MessagesRequest", "add_routes", "error_response"]

_MAX_SESSION = 256
_UNSUPPORTED_FIELDS = ("mcp_servers", "container")
_UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "container_upload", "server_tool_use", "web_search_tool_result")


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    """A Messages API request (unknown fields, e.g. Claude Code's ``context_management``, are accepted)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: Annotated[int, Field(ge=1), JsonInt]
    messages: list[_Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Annotated[int, Field(ge=0), JsonInt] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=CACHE_SALT_MAX)  # vLLM's: salts the prompt's KV hashes


class CountTokensRequest(BaseModel):
    """``/v1/messages/count_tokens``: a Messages request without ``max_tokens``."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    messages: list[_Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class _ErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error body: every non-2xx answer of ``/v1/messages``."""

    type: Literal["error"]
    error: _ErrorDetail


def _err(description: str) -> dict[str, Any]:
    return {"model": AnthropicError, "description": description}


ANTHROPIC_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _err("a malformed body, a missing or invalid field, an unsupported block or tool, a too long prompt"),
    401: _err("missing or wrong API key (x-api-key or Authorization: Bearer; only when the gateway has one)"),
    404: _err("unknown model"),
    405: _err("method not allowed on this route"),
    429: _err("over the tenant's limit (max_concurrency, tokens_per_minute) or overloaded; retry after Retry-After seconds"),
    503: _err("no scheduler or engine available right now; retry after Retry-After seconds"),
}
_STREAM_200: dict[int | str, dict[str, Any]] = {
    200: {"description": "the message: JSON, or Server-Sent Events when stream is true", "content": {"text/event-stream": {}}}
}

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """Anthropic's error answer; a validation failure (422 elsewhere) is a 400 here, as Anthropic has it."""
    status = 400 if status == 422 else status
    etype = _TYPES.get(status) or ("overloaded_error" if status == 503 else "api_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(status_code=status, content={"type": "error", "error": {"type": etype, "message": message}}, headers=headers)


# ---- request -> chat request ---------------------------------------------------------------------
def _bad(message: str, where: str) -> ApiError:
    return ApiError(400, f"{where}: {message}", param=where)


def _text(blocks: Any, where: str) -> str:
    """The text of a string or a list of text blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad("must be a string or a list of text blocks", where)
    out = []
    for j, block in enumerate(blocks):
        if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise _bad(f"only text blocks are supported here, got {kind!r}", f"{where}.{j}")
        out.append(block["text"])
    return "".join(out)


def _block_message(role: str, blocks: list[dict[str, Any]], i: int) -> list[dict[str, Any]]:
    """One Anthropic message of blocks -> chat messages (tool results become ``tool`` messages)."""
    texts, calls, results, thinking = [], [], [], []
    for j, block in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if (
                not isinstance(block.get("id"), str)
                or not isinstance(block.get("name"), str)
                or not isinstance(block.get("input", {}), dict)
            ):
                raise _bad("a tool_use block needs a string id and name and an object input", where)
            args = json.dumps(block.get("input", {}), ensure_ascii=False)
            calls.append({"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": args}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise _bad("a tool_result block needs a string tool_use_id", where)
            text = _text(block.get("content", ""), f"{where}.content")
            results.append(
                {"role": "tool", "tool_call_id": block["tool_use_id"], "content": ("Error: " + text) if block.get("is_error") else text}
            )
        elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # encrypted by another server: nothing this model can read
        elif kind in _UNSUPPORTED_BLOCKS:
            raise _bad(f"{kind} blocks are not supported: this gateway serves a text-only model", where)
        else:
            raise _bad(f"a {role} message cannot hold a block of type {kind!r} (or the block is malformed)", where)
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
        if calls:
            msg["tool_calls"] = calls
        if thinking:
            msg["reasoning_content"] = "".join(thinking)  # the name HF reasoning templates read
        return [msg]
    return [*results, *([{"role": role, "content": "".join(texts)}] if texts or not results else [])]


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for k, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise _bad(f"server tools ({tool.get('type')!r}) are not supported; define the tool with name and input_schema", f"tools.{k}")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad("a tool needs an input_schema object", f"tools.{k}.input_schema")
        fn = {"name": tool.get("name"), "parameters": schema}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool]:
    """(chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, True
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _bad("must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}", "tool_choice")


def to_chat(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages request means.

    Raises:
        ApiError: 400 naming the block, tool or field that cannot be translated.
    """
    for name in _UNSUPPORTED_FIELDS:
        if (body.model_extra or {}).get(name):
            raise _bad("is not supported by this gateway (it runs no server-side tools or containers)", name)
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system, "system")})
    for i, msg in enumerate(body.messages):
        if isinstance(msg.content, str):
            messages.append({"role": msg.role, "content": msg.content})
        elif msg.role == "system":
            messages.append({"role": "system", "content": _text(msg.content, f"messages.{i}.content")})
        else:
            messages += _block_message(msg.role, msg.content, i)
    choice, parallel = _tool_choice(body.tool_choice)
    spec: dict[str, Any] = {"model": body.model, "messages": messages, "parallel_tool_calls": parallel}
    if (tools := _tools(body.tools)) is not None and choice != "none":
        spec["tools"], spec["tool_choice"] = tools, choice
    elif tools:
        spec["tools"], spec["tool_choice"] = tools, "none"
    if isinstance(body.thinking, dict) and body.thinking.get("type") in ("enabled", "adaptive", "disabled"):
        spec["chat_template_kwargs"] = {"enable_thinking": body.thinking["type"] != "disabled"}  # Qwen3's switch
    if isinstance(body, MessagesRequest):
        spec.update(max_tokens=body.max_tokens, stream=body.stream, temperature=body.temperature)
        if body.top_p is not None:
            spec["top_p"] = body.top_p
        if body.top_k is not None:
            spec["top_k"] = body.top_k
        if body.stop_sequences:
            spec["stop"] = body.stop_sequences
        user = (body.metadata or {}).get("user_id")
        if user is not None and not isinstance(user, str):
            raise _bad("must be a string", "metadata.user_id")
        if user:
            spec["dualpath_session"] = user[:_MAX_SESSION]
        if body.cache_salt is not None:
            spec["cache_salt"] = body.cache_salt
    try:
        return ChatCompletionRequest.model_validate(spec)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ApiError(400, f"cannot translate the request: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None


# ---- answer -> message ---------------------------------------------------------------------------
def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def usage(gw: Gateway, prep: Prepared, cached: int, output_tokens: int) -> dict[str, int]:
    prompt = len(prep.prompt_tokens)
    created = max(0, (prompt // gw.block_tokens) * gw.block_tokens - cached) if gw.cfg.prefix_cache else 0
    return {
        "input_tokens": prompt - cached - created,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


def stop_reason(finish: str, stop_string: str, has_calls: bool) -> tuple[str, str | None]:
    if has_calls and finish == "stop":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    return ("stop_sequence", stop_string) if stop_string else ("end_turn", None)


def message_body(gw: Gateway, rid: str, prep: Prepared, result: Result) -> dict[str, Any]:
    parsed = parse_answer(prep, result.text)
    content: list[dict[str, Any]] = []
    if parsed.reasoning is not None:
        content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content or not (parsed.calls or content):
        content.append({"type": "text", "text": parsed.content or ""})
    for call in parsed.calls:
        content.append({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": _input(call.arguments)})
    reason, seq = stop_reason(result.finish_reason, result.stop_string, bool(parsed.calls))
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": gw.model_name,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": usage(gw, prep, result.cached_tokens, len(result.token_ids)),
    }


def _input(arguments: str) -> Any:
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class _Blocks:
    """Chat deltas -> content block events (a block is closed when one of another kind opens)."""

    def __init__(self) -> None:
        self.index = -1
        self.kind = ""

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index, self.kind = self.index + 1, kind
        return [*out, _event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})]

    def finish(self) -> list[str]:
        """Close the last block (an answer without any block gets one empty text block)."""
        return self._open("text", {"type": "text", "text": ""}) + self.close() if self.index < 0 else self.close()

    def close(self) -> list[str]:
        if not self.kind:
            return []
        self.kind = ""
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def feed(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if text := delta.get("reasoning_content"):
            if self.kind != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": text}))
        if text := delta.get("content"):
            if self.kind != "text":
                out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls", []):
            fn = call.get("function", {})
            if "id" in call:
                out += self._open("tool_use", {"type": "tool_use", "id": tool_use_id(call["id"]), "name": fn.get("name", ""), "input": {}})
            if fn.get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out


async def _events(gw: Gateway, rid: str, prep: Prepared, request: Request):
    deltas, blocks = AnswerDeltas(prep), _Blocks()
    start: dict[str, Any] = {"id": rid, "type": "message", "role": "assistant", "model": gw.model_name, "content": []}
    start.update(stop_reason=None, stop_sequence=None, usage=usage(gw, prep, prep.hit_tokens, 0))
    try:
        yield _event("message_start", {"type": "message_start", "message": start})
        yield _event("ping", {"type": "ping"})
        async for part in gw.stream(rid, prep):
            if await request.is_disconnected():
                await gw.cancel(rid, "client disconnected")
                return
            if part.finish_reason == "error":
                etype = "overloaded_error" if part.error_code in (429, 503) else "api_error"
                yield _event("error", {"type": "error", "error": {"type": etype, "message": part.error}})
                return
            for delta in deltas.feed(part.text) + (deltas.finish() if part.finish_reason is not None else []):
                for line in blocks.feed(delta):
                    yield line
            if part.finish_reason is None or part.result is None:
                continue
            for line in blocks.finish():
                yield line
            res = part.result
            reason, seq = stop_reason(res.finish_reason, res.stop_string, bool(deltas.calls))
            end = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq}}
            end["usage"] = usage(gw, prep, res.cached_tokens, len(res.token_ids))
            yield _event("message_delta", end)
            yield _event("message_stop", {"type": "message_stop"})
    finally:
        gw.finish(rid)


# ---- routes --------------------------------------------------------------------------------------
def add_routes(app: FastAPI, gw: Gateway) -> None:
    """``POST /v1/messages`` and ``POST /v1/messages/count_tokens``."""

    @app.post("/v1/messages", responses={**ANTHROPIC_ERROR_RESPONSES, **_STREAM_200})
    async def messages(body: MessagesRequest, request: Request):
        chat = to_chat(body)
        prep = await run_in_threadpool(lambda: gw.prepare_chat(chat, clamp=True))
        rid = "msg_" + uuid.uuid4().hex
        prep.session = session_of(prep, request)
        await gw.submit(rid, prep, tenant=tenant_of(request))
        if prep.stream:
            return StreamingResponse(
                _events(gw, rid, prep, request), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Request-Id": rid}
            )
        try:
            result = await gw.collect(rid, prep)
        finally:
            gw.finish(rid)
        return JSONResponse(content=message_body(gw, rid, prep, result), headers={"X-Request-Id": rid})

    @app.post("/v1/messages/count_tokens", responses=ANTHROPIC_ERROR_RESPONSES)
    async def count_tokens(body: CountTokensRequest) -> dict:
        chat = to_chat(body)
        return {"input_tokens": await run_in_threadpool(gw.count_chat, chat)}
