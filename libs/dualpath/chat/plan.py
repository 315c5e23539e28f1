"""``plan_chat``: an OpenAI chat request's messages, tools and response format -> the prompt
text, the grammar that constrains the answer, and how to read the answer back.

- ``tool_choice``: ``none`` (tools shown, output never parsed as calls), ``auto`` (parsed,
  not forced), ``required`` or ``{"type": "function", "function": {"name": ...}}`` (forced by
  a grammar: one call, or several when ``parallel_tool_calls``).
- ``response_format``: ``text``, ``json_object``, ``json_schema``; with tools on ``auto``
  the answer is either tool calls or that JSON (the grammar allows both).
- Content: a string, a list of text parts (joined), or ``None`` (empty text, except on an
  assistant turn with ``tool_calls``, where the template sees ``None``).
- History: assistant ``tool_calls`` (``arguments`` JSON text, given to the template as a
  mapping, HF's convention, unless the template concatenates it as text) and ``tool``
  messages, whose ``tool_call_id`` must answer an earlier call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import llguidance as llg

from dualpath.chat.errors import ChatTemplateError, GrammarError, ToolSpecError
from dualpath.chat.template import ChatTemplate
from dualpath.chat.tools import ToolFormat
from dualpath.structured.grammar import (
    check_grammar,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    lark_json_rule,
)

__all__ = ["ChatPlan", "plan_chat"]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_UNIMPLEMENTED = "Unimplemented keys"  # llguidance: valid JSON Schema it cannot turn into a grammar


@dataclass(slots=True, kw_only=True)
class ChatPlan:
    prompt: str
    grammar: str | None  # llguidance grammar string for the engines, None: unconstrained
    tool_format: ToolFormat | None  # parse the answer into tool_calls with it; None: plain content
    forced: bool = False  # a tool call is forced (tool_choice required / named)


def plan_chat(
    messages: list[dict[str, Any]],
    *,
    template: ChatTemplate,
    tool_format: ToolFormat,
    vocab: llg.LLTokenizer | None,
    tools: list[dict] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool = True,
    response_format: dict | None = None,
    template_name: str | None = None,
    template_kwargs: dict | None = None,
) -> ChatPlan:
    """Render the prompt and build the grammar (checked against ``vocab``).

    Raises:
        ToolSpecError: a malformed tool, a ``tool_choice`` naming no tool, a ``tool`` message
            answering no call, tool-call arguments that are not JSON.
        GrammarError: a schema (``response_format`` or a tool's parameters) that does not compile.
        ChatTemplateError: the chat template refuses the messages.
    """
    may_force = tool_choice not in (None, "none", "auto") or (response_format or {}).get("type") not in (None, "text")
    tools = _check_tools(tools, forcible=may_force)
    choice = _choice(tool_choice, tools)
    as_text = template.arguments_as_text(template_name, tools=bool(tools))
    history = _check_history(messages, as_text)
    prompt = template.render(history, tools=tools or None, add_generation_prompt=True, template=template_name, **(template_kwargs or {}))
    answer = _answer_grammar(response_format, vocab)
    grammar, forced = None, False
    if tools and choice not in ("none", "auto"):
        chosen = tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice]
        grammar, forced = lark_grammar(tool_format.grammar(chosen, parallel=parallel_tool_calls and choice == "required")), True
    elif tools and choice == "auto" and answer is not None and response_format is not None:
        grammar = _calls_or_answer(tool_format, tools, parallel_tool_calls, response_format)
    else:
        grammar = answer
    if grammar is not None:
        check_grammar(grammar, vocab, param="tools" if forced else "response_format")
    return ChatPlan(prompt=prompt, grammar=grammar, tool_format=tool_format if tools and choice != "none" else None, forced=forced)


def _check_tools(tools: list[dict] | None, *, forcible: bool) -> list[dict]:
    """The tools, checked; a parameters schema must compile, except that when no grammar will
    force a call (``forcible`` false) one using JSON Schema keywords the grammar engine does not
    implement is accepted (agents' tools use them: nothing needs enforcing)."""
    if not tools:
        return []
    seen = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolSpecError(f"{where} must be {{'type': 'function', 'function': {{...}}}}", param=where)
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolSpecError(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.'", param=f"{where}.function.name")
        if name in seen:
            raise ToolSpecError(f"{where}.function.name {name!r} is defined twice", param=f"{where}.function.name")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise ToolSpecError(f"{where}.function.parameters must be a JSON schema object", param=f"{where}.function.parameters")
            try:
                check_grammar(json_schema_grammar(params, param=f"{where}.function.parameters"), None, param=f"{where}.function.parameters")
            except GrammarError as exc:
                if forcible or _UNIMPLEMENTED not in exc.message:
                    raise
    return [{**t, "type": "function"} for t in tools]


def _choice(tool_choice: Any, tools: list[dict]) -> str:
    """``none``, ``auto``, ``required`` or a tool's name."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ToolSpecError(f"tool_choice must be 'none', 'auto', 'required' or a function, got {tool_choice!r}", param="tool_choice")
        if tool_choice == "required" and not tools:
            raise ToolSpecError("tool_choice 'required' needs tools", param="tool_choice")
        return tool_choice
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise ToolSpecError("tool_choice must name a function: {'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise ToolSpecError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return name


def _check_history(messages: list[dict[str, Any]], arguments_as_text: bool) -> list[dict[str, Any]]:
    """Copies of the messages with tool-call arguments decoded; every tool result answers a call."""
    called: set[str] = set()
    out = []
    for i, msg in enumerate(messages):
        msg = dict(msg)
        if msg.get("tool_calls") == []:
            del msg["tool_calls"]  # some clients send an empty list; templates test for the key
        content = msg.get("content")
        if content is None and not (msg.get("role") == "assistant" and msg.get("tool_calls")):
            msg["content"] = ""  # as the serving tokenizer always did (HF would drop the key)
        elif isinstance(content, list):
            msg["content"] = _text_of(content, i)
        elif content is not None and not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content")
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            msg["tool_calls"] = [_history_call(c, i, j, arguments_as_text, called) for j, c in enumerate(msg["tool_calls"])]
        elif msg.get("role") == "tool":
            cid = msg.get("tool_call_id")
            if not isinstance(cid, str) or cid not in called:
                raise ToolSpecError(
                    f"messages[{i}] is a tool result for {cid!r}, which no earlier assistant message called",
                    param=f"messages[{i}].tool_call_id",
                )
        out.append(msg)
    return out


def _history_call(call: Any, i: int, j: int, as_text: bool, called: set[str]) -> dict:
    where = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ToolSpecError(f"{where} needs function.name", param=where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str) and not as_text:
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError as exc:
            raise ToolSpecError(f"{where}.function.arguments is not JSON: {exc}", param=f"{where}.function.arguments") from None
    elif not isinstance(args, str) and as_text:
        args = json.dumps(args, ensure_ascii=False)
    if isinstance(call.get("id"), str):
        called.add(call["id"])
    return {**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}}


def _text_of(parts: list, i: int) -> str:
    texts = []
    for part in parts:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise ChatTemplateError(f"messages[{i}]: only text content parts are supported, got {part!r}", param=f"messages[{i}].content")
        texts.append(part["text"])
    return "".join(texts)


def _answer_schema(response_format: dict | None) -> dict | None:
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise GrammarError("response_format.json_schema must be an object with a 'schema'", param="response_format.json_schema")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise GrammarError(
                "response_format.json_schema.schema must be a JSON schema object", param="response_format.json_schema.schema"
            )
        return schema
    raise GrammarError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", param="response_format.type")


def _answer_grammar(response_format: dict | None, vocab: llg.LLTokenizer | None) -> str | None:
    schema = _answer_schema(response_format)
    if schema is None or response_format is None:
        return None
    if response_format.get("type") == "json_object":
        return json_object_grammar()
    grammar = json_schema_grammar(schema)
    check_grammar(grammar, vocab, param="response_format.json_schema.schema")
    return grammar


def _calls_or_answer(fmt: ToolFormat, tools: list[dict], parallel: bool, response_format: dict) -> str:
    """Tool calls in ``fmt`` or the JSON answer: the grammar of ``tool_choice: auto`` with a response format."""
    renamed = fmt.grammar(tools, parallel=parallel).replace("start:", "calls:", 1)
    return lark_grammar(f"start: calls | answer\nanswer: {lark_json_rule(_answer_schema(response_format) or {})}\n{renamed}")
