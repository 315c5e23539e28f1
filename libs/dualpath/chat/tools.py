"""Tool calls: the model's output formats, parsed into OpenAI ``tool_calls`` (whole or streamed),
and the grammars that force a call.

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

__all__ = ["FORMATS", "StreamingToolParser", "ToolCall", "ToolFormat", "format_for_template", "tool_format"]


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
    end = _value_end(text, m.end())
    return text[m.end() : end].strip() if end is not None else None


def _value_end(text: str, start: int) -> int | None:
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


class StreamingToolParser:
    """Turns text deltas into OpenAI stream deltas, as the OpenAI API streams them: ``content``
    until a tool call may start; then per call a first delta with its ``index``, ``id``,
    ``type`` and ``function.name`` (``arguments: ""``) and further deltas with pieces of
    ``function.arguments`` as the model writes them.

    Text that could be the start of a call marker is held back until it is decided. A call
    written in another key order is sent whole once it closes (or at ``finish``).
    """

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.text = ""  # everything so far
        self._sent = 0  # content characters released
        self._in_calls = False
        self._pos = 0  # calls region: where the next call (or the current call's close) is looked for
        self._state = "seek"  # seek (a call header) | args (streaming its arguments) | close (its end marker)
        self._args_from = 0  # the current call's arguments: start, and how far they were sent
        self._args_sent = 0
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """Deltas (``{"content": ...}`` or ``{"tool_calls": [...]}``) releasable after ``delta``."""
        self.text += delta
        out: list[dict[str, Any]] = []
        if not self._in_calls:
            out += self._content()
        if self._in_calls:
            out += self._calls()
        return out

    def finish(self) -> list[dict[str, Any]]:
        """The remaining deltas once the answer ended."""
        if not self._in_calls:
            rest = self.text[self._sent :]
            self._sent = len(self.text)
            return [{"content": rest}] if rest else []
        out = self._calls()
        rest = self.text[self._pos :]
        if self._state == "seek" and rest.strip():
            _, calls = self.fmt.parse(rest)
            if calls:
                out += [self._whole(c) for c in calls]
            elif not self.calls:  # never a well-formed call: it was text after all
                out.append({"content": self.text[self._sent :]})
            self._pos = len(self.text)
        return out

    def _content(self) -> list[dict[str, Any]]:
        start = self.fmt.start
        if not start:  # llama3_json: a call is the whole answer, starting with "{"
            stripped = self.text.lstrip().removeprefix("<|python_tag|>").lstrip()
            if stripped.startswith("{"):
                self._in_calls, self._pos = True, 0
                return []
            if not stripped:
                return []
            piece, self._sent = self.text[self._sent :], len(self.text)
            return [{"content": piece}] if piece else []
        at = self.text.find(start, self._sent)
        if at != -1:
            self._in_calls = True
            piece = self.text[self._sent : at].rstrip() if at > self._sent else ""
            self._sent = self._pos = at
            return [{"content": piece}] if piece else []
        hold = next((k for k in range(min(len(start) - 1, len(self.text) - self._sent), 0, -1) if self.text.endswith(start[:k])), 0)
        ready = len(self.text) - hold
        ready = self._sent + len(self.text[self._sent : ready].rstrip())  # whitespace before a call is not content
        if ready <= self._sent:
            return []
        piece, self._sent = self.text[self._sent : ready], ready
        return [{"content": piece}]

    def _whole(self, call: ToolCall) -> dict[str, Any]:
        index = len(self.calls)
        self.calls.append(call)
        return {
            "tool_calls": [
                {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ]
        }

    def _calls(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        text = self.text
        while True:
            if self._state == "seek":
                m = self.fmt.header.match(text, self._pos)
                if m is None:
                    end = text.find(self.fmt.end_marker, self._pos) if self.fmt.end_marker else -1
                    if end == -1:
                        return out
                    # A call in another shape (keys reordered): send it whole.
                    segment_end = end + len(self.fmt.end_marker)
                    out += [self._whole(c) for c in self.fmt.parse(text[self._pos : segment_end])[1]]
                    self._pos = segment_end
                    continue
                call = ToolCall(name=json.loads('"' + m.group(1) + '"'), arguments="")
                index = len(self.calls)
                self.calls.append(call)
                out.append(
                    {"tool_calls": [{"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}]}
                )
                self._state, self._args_from = "args", m.end()
                self._args_sent = m.end()
            if self._state == "args":
                value_end = _value_end(text, self._args_from)
                upto = value_end if value_end is not None else len(text)
                if upto > self._args_sent:
                    piece = text[self._args_sent : upto]
                    piece = piece.lstrip() if self._args_sent == self._args_from else piece
                    self._args_sent = upto
                    if piece:
                        self.calls[-1].arguments += piece
                        out.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]})
                if value_end is None:
                    return out
                self._state, self._pos = "close", value_end
            if self._state == "close":
                m = self.fmt.close.match(text, self._pos)
                if m is None:
                    return out
                self._state, self._pos = "seek", m.end()
