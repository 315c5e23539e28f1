"""Tool calls: the model's output formats, parsed into OpenAI ``tool_calls``, and the grammars
that force a call (streaming: ``dualpath.chat.stream``).

Formats (vLLM's tool-parser names):

- ``hermes``: Hermes / Qwen2.5 / Qwen3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  several in a row for parallel calls, after optional text.
- ``llama3_json``: Llama 3.1+: the whole answer is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``, which decodes to nothing), calls separated by ``;``.

``format_for_template`` picks one from the checkpoint's chat template; a ``--tool-parser``
flag overrides it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from dualpath.structured.grammar import lark_json_rule

__all__ = ["FORMATS", "ToolCall", "ToolFormat", "format_for_template", "tool_format", "value_end"]


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_from(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False) if not isinstance(args, str) else args)


class ToolFormat:
    """One output format: whole-text parsing, the start marker streaming waits for, forcing grammar."""

    name = ""
    start = ""  # text that opens a tool call ("" : the answer must begin with "{")
    header: re.Pattern  # a call up to its arguments value (group 1: the name), for streaming
    close: re.Pattern  # what follows a call's arguments value, up to the call's end
    end_marker = ""  # text that ends every call ("": none)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Split a finished answer into (content, tool calls); no calls: (text, [])."""
        raise NotImplementedError

    def grammar(self, tools: list[dict], *, parallel: bool) -> str:
        """A Lark grammar (llguidance dialect, rule ``start``) whose every sentence is one (or, if
        ``parallel``, several) valid calls of ``tools`` (OpenAI tool dicts) in this format."""
        raise NotImplementedError


class HermesFormat(ToolFormat):
    name = "hermes"
    start = "<tool_call>"
    header = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
    close = re.compile(r"\s*\}\s*</tool_call>\s*")
    end_marker = "</tool_call>"
    _call = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.start)
        if at == -1:
            return text, []
        calls: list[ToolCall] = []
        for match in self._call.finditer(text, at):
            try:
                call = _call_from(json.loads(match.group(1)), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is not None:  # the arguments as the model wrote them (what streaming sends)
                call.arguments = _raw_arguments(self.header, text, match.start()) or call.arguments
            if call is None:
                if not match.group(0).endswith("</tool_call>") and calls:
                    break  # the answer was cut inside its last call (max_tokens): keep the complete ones
                return text, []  # not a well-formed call: leave the text as it is
            calls.append(call)
        content = text[:at].strip()
        return (content or None), calls

    def grammar(self, tools: list[dict], *, parallel: bool) -> str:
        rules = [f"f{i}: {lark_json_rule(_call_schema(t, 'arguments'))}" for i, t in enumerate(tools)]
        fns = " | ".join(f"f{i}" for i in range(len(tools)))
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return "\n".join([start, f'call: "<tool_call>\\n" ({fns}) "\\n</tool_call>"', *rules]) + "\n"


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    start = ""
    header = re.compile(r'[\s;]*(?:<\|python_tag\|>)?\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:parameters|arguments)"\s*:\s*')
    close = re.compile(r"\s*\}\s*;?\s*")

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = _call_from(obj, "parameters")
            if call is None:
                return text, []
            call.arguments = _raw_arguments(self.header, body, pos) or call.arguments
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return None, calls

    def grammar(self, tools: list[dict], *, parallel: bool) -> str:
        rules = [f"f{i}: {lark_json_rule(_call_schema(t, 'parameters'))}" for i, t in enumerate(tools)]
        fns = " | ".join(f"f{i}" for i in range(len(tools)))
        start = 'start: call ("; " call)*' if parallel else "start: call"
        return "\n".join([start, f"call: {fns}", *rules]) + "\n"


def _call_schema(tool: dict, args_key: str) -> dict:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat())}


def tool_format(name: str) -> ToolFormat:
    """The format called ``name``.

    Raises:
        ValueError: unknown name.
    """
    if name not in FORMATS:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(FORMATS))}")
    return FORMATS[name]


def format_for_template(template: str) -> ToolFormat:
    """Guess the checkpoint's tool-call format from its chat template (Hermes when unsure)."""
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if '"parameters": ' in template or "<|python_tag|>" in template:
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


_SCALAR_END = re.compile(r"[,}\]\s]")


def _raw_arguments(header: re.Pattern, text: str, at: int) -> str | None:
    """The arguments value of the call at ``text[at:]`` exactly as written, if it has the usual shape."""
    m = header.match(text, at)
    if m is None:
        return None
    end = value_end(text, m.end())
    return text[m.end() : end].strip() if end is not None else None


def value_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON value starting at ``text[start:]`` (after whitespace), or None
    while it is incomplete."""
    i, n = start, len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    if i >= n:
        return None
    if text[i] not in '{["':
        stop = _SCALAR_END.search(text, i)
        return stop.start() if stop is not None else None
    depth, in_str, escaped = 0, False, False
    for j in range(i, n):
        c = text[j]
        if in_str:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_str = False
                if depth == 0:
                    return j + 1
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None
