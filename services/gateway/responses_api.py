"""OpenAI's Responses API (``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items``) on the chat path: ``instructions`` and the input items become
chat messages (the checkpoint's template renders them), and the answer's reasoning, text and
tool calls become ``reasoning``, ``message`` and ``function_call`` output items.

- ``input``: a string, or items: messages (``input_text`` / ``output_text`` parts),
  ``function_call``, ``function_call_output``, ``reasoning`` (its text is given to the template
  as the next assistant turn's ``reasoning_content``; encrypted content is dropped).
- ``tools``: function tools. Hosted and grouped tools (``web_search``, ``file_search``,
  ``namespace``, ``mcp``, ...) are not run here: they are left out of the prompt, so agents that
  always send them (Codex) still work; ``tool_choice`` naming one is a 400.
- ``text.format``: ``json_schema`` / ``json_object`` are enforced by the grammar path.
- ``max_output_tokens`` is an upper bound (cut to the context's room).
- ``store`` (default true) keeps the response in the shared ``ResponseStore`` (found only by
  its tenant's requests);
  ``previous_response_id`` continues a stored conversation (its ``instructions`` are not carried
  over, as OpenAI has it). Such a conversation is one agent session (its first response's id),
  as is one carrying ``metadata.user_id``, ``prompt_cache_key`` or ``user``.

Not supported (a 400 naming the field): ``background``, ``conversation``, ``prompt``
templates, image / file / audio input parts, ``item_reference`` and hosted-tool call items,
``GET /v1/responses/{id}?stream=true``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from dualpath.telemetry.logs import get_logger
from services.gateway.answer import AnswerDeltas, Parsed, parse_answer, session_of
from services.gateway.api_types import CACHE_SALT_MAX, ERROR_RESPONSES, REQUEST_ERROR_RESPONSES, ChatCompletionRequest, JsonInt
from services.gateway.core import ApiError, Gateway, Prepared, Result
from services.gateway.response_store import ResponseStore, StoredResponse, StoreError
from services.gateway.tenancy import tenant_of

__all__ = ["ResponsesRequest", "add_routes"]

log = get_logger("gateway.responses")
_MAX_SESSION = 256
_UNSUPPORTED = ("background", "conversation", "prompt")
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


class ResponsesRequest(BaseModel):
    """A Responses API request (unknown fields, e.g. ``include`` or ``reasoning``, are accepted)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: Annotated[int, Field(ge=1), JsonInt] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: dict[str, Any] | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=CACHE_SALT_MAX)  # vLLM's: salts the prompt's KV hashes


@contextmanager
def _store_errors() -> Iterator[None]:
    """The shared store being unavailable is a 503 (the gateway keeps serving everything else)."""
    try:
        yield
    except StoreError as exc:
        raise ApiError(503, str(exc), etype="server_error") from None


def _bad(message: str, where: str) -> ApiError:
    return ApiError(400, f"{where}: {message}", param=where)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- input items ---------------------------------------------------------------------------------
def normalize_input(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as items, each with an id (what ``input_items`` lists)."""
    if isinstance(value, str):
        return [{"type": "message", "id": _new_id("msg"), "role": "user", "content": [{"type": "input_text", "text": value}]}]
    out = []
    for item in value:
        kind = item.get("type") or ("message" if "role" in item else None)
        out.append({"id": _new_id({"function_call": "fc", "reasoning": "rs"}.get(str(kind), "msg")), **item, "type": kind})
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("must be a string or a list of text parts", where)
    out = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _bad(f"only text parts are supported (this gateway serves a text-only model), got {kind!r}", f"{where}.{j}")
        out.append(part["text"])
    return "".join(out)


def items_to_messages(items: list[dict[str, Any]], where: str = "input") -> list[dict[str, Any]]:
    """Input items -> chat messages (consecutive calls join the assistant turn before them).

    Raises:
        ApiError: 400 naming the item that cannot be translated.
    """
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for k, item in enumerate(items):
        at, kind = f"{where}.{k}", item.get("type")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad("role must be user, assistant, system or developer", f"{at}.role")
            msg: dict[str, Any] = {
                "role": "system" if role == "developer" else role,
                "content": _text(item.get("content"), f"{at}.content"),
            }
            if role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = "".join(reasoning), []
            messages.append(msg)
        elif kind == "function_call":
            if not all(isinstance(item.get(f), str) for f in ("call_id", "name", "arguments")):
                raise _bad("a function_call needs string call_id, name and arguments", at)
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning:
                    messages[-1]["reasoning_content"], reasoning = "".join(reasoning), []
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad("a function_call_output needs a string call_id", at)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output", ""), f"{at}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning.append(_text(parts, f"{at}.content") if isinstance(parts, list) else "")
        else:
            raise _bad(f"input items of type {kind!r} are not supported", at)
    return messages


# ---- request -> chat request ---------------------------------------------------------------------
def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out = []
    for k, tool in enumerate(tools or []):
        if tool.get("type") != "function":
            continue  # hosted or grouped tools: not run here (see the module docstring)
        if not isinstance(tool.get("name"), str):
            raise _bad("a function tool needs a name", f"tools.{k}.name")
        fn = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...} (hosted tools are not run here)", "tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("must be {'type': 'text' | 'json_object' | 'json_schema', ...}", "text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    return {
        "type": "json_schema",
        "json_schema": {"name": fmt.get("name", "answer"), "schema": fmt.get("schema"), "strict": fmt.get("strict")},
    }


def to_chat(body: ResponsesRequest, history: list[dict[str, Any]], items: list[dict[str, Any]], session: str) -> ChatCompletionRequest:
    """The chat request for ``body`` after the stored conversation ``history`` (items).

    Raises:
        ApiError: 400 naming what cannot be translated.
    """
    for name in _UNSUPPORTED:
        if (body.model_extra or {}).get(name) not in (None, False):
            raise _bad("is not supported by this gateway", name)
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += items_to_messages(history, "previous_response_id") + items_to_messages(items)
    spec: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    tools, choice = _tools(body.tools), _tool_choice(body.tool_choice)
    if tools:
        spec["tools"] = tools
        if choice is not None:
            spec["tool_choice"] = choice
    elif choice not in (None, "auto", "none"):
        raise _bad("names a tool, but there are no function tools", "tool_choice")
    for name, value in (("max_tokens", body.max_output_tokens), ("temperature", body.temperature), ("top_p", body.top_p)):
        if value is not None:
            spec[name] = value
    if (fmt := _response_format(body.text)) is not None:
        spec["response_format"] = fmt
    if session:
        spec["dualpath_session"] = session[:_MAX_SESSION]
    if body.cache_salt is not None:
        spec["cache_salt"] = body.cache_salt
    try:
        return ChatCompletionRequest.model_validate(spec)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ApiError(400, f"cannot translate the request: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None


# ---- answer -> response ----------------------------------------------------------------------------
def _output(gw: Gateway, parsed: Parsed) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if parsed.reasoning is not None:
        out.append(_reasoning_item(_new_id("rs"), parsed.reasoning))
    if parsed.content or not parsed.calls:
        out.append(_message_item(_new_id("msg"), parsed.content or "", "completed"))
    for call in parsed.calls:
        out.append(_call_item(_new_id("fc"), call.id, call.name, call.arguments, "completed"))
    return out


def _reasoning_item(iid: str, text: str) -> dict[str, Any]:
    return {"id": iid, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _message_item(iid: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"id": iid, "type": "message", "role": "assistant", "status": status, "content": content}


def _call_item(iid: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": iid, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def _usage(gw: Gateway, prep: Prepared, result: Result, reasoning: str | None) -> dict[str, Any]:
    prompt, output = len(prep.prompt_tokens), len(result.token_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": result.cached_tokens},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": min(output, len(gw.tokenizer.encode(reasoning))) if reasoning else 0},
        "total_tokens": prompt + output,
    }


def _shell(gw: Gateway, rid: str, body: ResponsesRequest, created: int) -> dict[str, Any]:
    """The response object without output and usage (``response.created`` shows it so)."""
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "model": gw.model_name,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "text": body.text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "truncation": "disabled",
        "usage": None,
        "user": body.user,
    }


def _finished(shell: dict[str, Any], output: list[dict[str, Any]], usage: dict[str, Any], finish: str) -> dict[str, Any]:
    done = finish != "length"
    return {
        **shell,
        "status": "completed" if done else "incomplete",
        "incomplete_details": None if done else {"reason": "max_output_tokens"},
        "output": output,
        "usage": usage,
    }


class _Events:
    """Chat deltas -> the Responses API's semantic stream events, building the output items."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self._item: dict[str, Any] | None = None  # the open item
        self._text = ""  # its text or arguments so far

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _open(self, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self._item, self._text = item, ""
        out.append(self.event("response.output_item.added", output_index=len(self.output), item=item))
        if item["type"] != "function_call":
            part = (
                {"type": "output_text", "text": "", "annotations": []}
                if item["type"] == "message"
                else {"type": "reasoning_text", "text": ""}
            )
            out.append(
                self.event("response.content_part.added", item_id=item["id"], output_index=len(self.output), content_index=0, part=part)
            )
        return out

    def finish(self) -> list[str]:
        """Close the last item (an answer without any item gets one empty message)."""
        if self._item is None and not self.output:
            return self._open(_message_item(_new_id("msg"), None, "in_progress")) + self.close()
        return self.close()

    def close(self) -> list[str]:
        """Close the open item (``*.done`` events); it joins ``output``."""
        item, out = self._item, list[str]()
        if item is None:
            return out
        where = {"item_id": item["id"], "output_index": len(self.output)}
        if item["type"] == "function_call":
            item = {**item, "arguments": self._text, "status": "completed"}
            out.append(self.event("response.function_call_arguments.done", **where, arguments=self._text))
        else:
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            part = {"type": kind, "text": self._text, **({"annotations": []} if kind == "output_text" else {})}
            item = {**item, "content": [part], "status": "completed"}
            out.append(self.event(f"response.{kind}.done", **where, content_index=0, text=self._text))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        out.append(self.event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        self._item = None
        return out

    def feed(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if text := delta.get("reasoning_content"):
            if self._item is None or self._item["type"] != "reasoning":
                out += self._open({"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"})
            out.append(self._delta("response.reasoning_text.delta", text))
        if text := delta.get("content"):
            if self._item is None or self._item["type"] != "message":
                out += self._open(_message_item(_new_id("msg"), None, "in_progress"))
            out.append(self._delta("response.output_text.delta", text))
        for call in delta.get("tool_calls", []):
            fn = call.get("function", {})
            if "id" in call:
                out += self._open(_call_item(_new_id("fc"), call["id"], fn.get("name", ""), "", "in_progress"))
            if fn.get("arguments"):
                out.append(self._delta("response.function_call_arguments.delta", fn["arguments"]))
        return out

    def _delta(self, kind: str, text: str) -> str:
        assert self._item is not None
        self._text += text
        extra = {} if kind.startswith("response.function_call") else {"content_index": 0}
        return self.event(kind, item_id=self._item["id"], output_index=len(self.output), **extra, delta=text)


# ---- routes --------------------------------------------------------------------------------------
class _Turn:
    """One request's state between preparation and answer."""

    def __init__(
        self, gw: Gateway, body: ResponsesRequest, rid: str, items: list[dict[str, Any]], session: str, prep: Prepared, tenant: str
    ) -> None:
        self.gw, self.body, self.rid, self.items, self.session, self.prep = gw, body, rid, items, session, prep
        self.tenant = tenant
        self.shell = _shell(gw, rid, body, int(time.time()))

    async def keep(self, store: ResponseStore, response: dict[str, Any]) -> None:
        if self.body.store:
            entry = StoredResponse(
                response=response,
                input_items=self.items,
                previous_response_id=self.body.previous_response_id,
                session=self.session,
                tenant=self.tenant,
            )
            await store.put(self.rid, entry)


async def _prepare(gw: Gateway, store: ResponseStore, body: ResponsesRequest, request: Request) -> _Turn:
    rid, history, session, tenant = _new_id("resp"), [], "", tenant_of(request)
    if body.previous_response_id is not None:
        chain = await store.chain(body.previous_response_id, tenant=tenant)  # another tenant's is not found
        if chain is None:
            raise ApiError(
                404,
                f"previous response {body.previous_response_id!r} not found (never stored, deleted or expired)",
                param="previous_response_id",
                etype="not_found_error",
            )
        history = [item for entry in chain for item in (*entry.input_items, *entry.response.get("output", []))]
        session = chain[-1].session
    session = session or (body.metadata or {}).get("user_id", "") or body.prompt_cache_key or body.user or (rid if body.store else "")
    items = normalize_input(body.input)
    if body.store and len(json.dumps(items)) > gw.store_limit():
        raise _bad("is larger than a stored response may be; send it with store: false", "input")
    chat = to_chat(body, history, items, session)
    prep = await run_in_threadpool(lambda: gw.prepare_chat(chat, clamp=True))
    prep.session = session_of(prep, request)
    return _Turn(gw, body, rid, items, session, prep, tenant)


async def _stream(turn: _Turn, store: ResponseStore, request: Request):
    gw, prep, ev = turn.gw, turn.prep, _Events()
    deltas = AnswerDeltas(prep)
    try:
        yield ev.event("response.created", response=turn.shell)
        yield ev.event("response.in_progress", response=turn.shell)
        async for part in gw.stream(turn.rid, prep):
            if await request.is_disconnected():
                await gw.cancel(turn.rid, "client disconnected")
                return
            if part.finish_reason == "error":
                error = {"code": "server_error", "message": part.error}
                yield ev.event("response.failed", response={**turn.shell, "status": "failed", "error": error})
                return
            for delta in deltas.feed(part.text) + (deltas.finish() if part.finish_reason is not None else []):
                for line in ev.feed(delta):
                    yield line
            if part.finish_reason is None or part.result is None:
                continue
            for line in ev.finish():
                yield line
            reasoning = "".join(i["content"][0]["text"] for i in ev.output if i["type"] == "reasoning")
            response = _finished(turn.shell, ev.output, _usage(gw, prep, part.result, reasoning or None), part.result.finish_reason)
            try:
                await turn.keep(store, response)
            except StoreError as exc:
                yield ev.event(
                    "response.failed", response={**response, "status": "failed", "error": {"code": "server_error", "message": str(exc)}}
                )
                return
            yield ev.event("response.completed" if response["status"] == "completed" else "response.incomplete", response=response)
    finally:
        gw.finish(turn.rid)


def add_routes(app: FastAPI, gw: Gateway) -> None:
    """The Responses API routes, on ``gw``'s shared store."""
    responses = {
        **REQUEST_ERROR_RESPONSES,
        200: {"description": "the response: JSON, or Server-Sent Events when stream is true", "content": {"text/event-stream": {}}},
    }
    lookups = {
        **ERROR_RESPONSES,
        404: {**ERROR_RESPONSES[404], "description": "no such stored response (never stored, deleted or expired)"},
        422: REQUEST_ERROR_RESPONSES[422],  # a bad query parameter (limit, order, stream)
        503: REQUEST_ERROR_RESPONSES[503],
    }

    @app.post("/v1/responses", responses=responses)
    async def create(body: ResponsesRequest, request: Request):
        store = gw.response_store()
        with _store_errors():
            turn = await _prepare(gw, store, body, request)
        await gw.submit(turn.rid, turn.prep, tenant=turn.tenant)
        if turn.prep.stream:
            return StreamingResponse(
                _stream(turn, store, request),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": turn.rid},
            )
        try:
            result = await gw.collect(turn.rid, turn.prep)
        finally:
            gw.finish(turn.rid)
        parsed = parse_answer(turn.prep, result.text)
        response = _finished(turn.shell, _output(gw, parsed), _usage(gw, turn.prep, result, parsed.reasoning), result.finish_reason)
        with _store_errors():
            await turn.keep(store, response)
        return JSONResponse(content=response, headers={"X-Request-Id": turn.rid})

    async def stored(rid: str, tenant: str) -> StoredResponse:
        with _store_errors():
            entry = await gw.response_store().get(rid, tenant=tenant)
        if entry is None:
            raise ApiError(404, f"response {rid!r} not found (never stored, deleted or expired)", etype="not_found_error")
        return entry

    @app.get("/v1/responses/{response_id}", responses={**lookups, 400: REQUEST_ERROR_RESPONSES[400]})
    async def retrieve(response_id: str, request: Request, stream: bool = False) -> JSONResponse:
        if stream:
            raise _bad("replaying a stored response as a stream is not supported; retrieve it without stream", "stream")
        return JSONResponse(content=(await stored(response_id, tenant_of(request))).response)

    @app.delete("/v1/responses/{response_id}", responses=lookups)
    async def delete(response_id: str, request: Request) -> dict:
        with _store_errors():
            deleted = await gw.response_store().delete(response_id, tenant=tenant_of(request))
        if not deleted:
            raise ApiError(404, f"response {response_id!r} not found (never stored, deleted or expired)", etype="not_found_error")
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items", responses=lookups)
    async def input_items(
        response_id: str,
        request: Request,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
        after: str | None = None,
    ) -> dict:
        with _store_errors():
            chain = await gw.response_store().chain(response_id, tenant=tenant_of(request))
        if chain is None:
            raise ApiError(404, f"response {response_id!r} not found (never stored, deleted or expired)", etype="not_found_error")
        items = [item for entry in chain[:-1] for item in (*entry.input_items, *entry.response.get("output", []))] + chain[-1].input_items
        items = items[::-1] if order == "desc" else items
        if after is not None:
            at = next((i for i, item in enumerate(items) if item.get("id") == after), None)
            items = items[at + 1 :] if at is not None else []
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0].get("id") if page else None,
            "last_id": page[-1].get("id") if page else None,
            "has_more": len(items) > limit,
        }
