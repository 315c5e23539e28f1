"""``StreamingToolParser``: a chat answer's text deltas -> OpenAI stream deltas (content, then
tool calls: a header delta per call and pieces of its arguments as the model writes them)."""

from __future__ import annotations

import json
from typing import Any

from dualpath.chat.tools import ToolCall, ToolFormat, value_end

__all__ = ["StreamingToolParser"]


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
        self._sent = 0  # content characters looked at (released, or whitespace held before a call)
        self._released = 0  # end of the content released so far
        self._in_calls = False
        self._text_only = False  # what looked like a call was not one: the rest of the answer is content
        self._pos = 0  # calls region: where the next call (or the current call's close) is looked for
        self._state = "seek"  # seek (a call header) | args (streaming its arguments) | close (its end marker)
        self._args_from = 0  # the current call's arguments: start, and how far they were sent
        self._args_sent = 0
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """Deltas (``{"content": ...}`` or ``{"tool_calls": [...]}``) releasable after ``delta``."""
        self.text += delta
        if self._text_only:
            self._sent = self._released = len(self.text)
            return [{"content": delta}] if delta else []
        out: list[dict[str, Any]] = []
        if not self._in_calls:
            out += self._content()
        if self._in_calls:
            out += self._calls()
        return out

    def finish(self) -> list[dict[str, Any]]:
        """The remaining deltas once the answer ended."""
        if not self._in_calls or self._text_only:
            rest = self.text[self._sent :]
            self._sent = self._released = len(self.text)
            return [{"content": rest}] if rest else []
        out = self._calls()
        rest = self.text[self._pos :]
        if self._state == "seek" and rest.strip():
            _, calls = self.fmt.parse(rest)
            if calls:
                out += [self._whole(c) for c in calls]
            elif not self.calls:  # never a well-formed call: it was text after all
                out += self._as_text()
            self._pos = len(self.text)
        return out

    def _as_text(self) -> list[dict[str, Any]]:
        """What was held as a possible call is text (as ``ToolFormat.parse`` decides when the
        first call is malformed): release it, whitespace before it included, and every later
        delta as content."""
        self._text_only = True
        rest = self.text[self._released :]
        self._sent = self._released = len(self.text)
        return [{"content": rest}] if rest else []

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
            self._released = self._sent
            return [{"content": piece}] if piece else []
        at = self.text.find(start, self._sent)
        if at != -1:
            self._in_calls = True
            piece = self.text[self._sent : at].rstrip() if at > self._sent else ""
            self._released = self._sent + len(piece)
            self._sent = self._pos = at
            return [{"content": piece}] if piece else []
        hold = next((k for k in range(min(len(start) - 1, len(self.text) - self._sent), 0, -1) if self.text.endswith(start[:k])), 0)
        ready = len(self.text) - hold
        ready = self._sent + len(self.text[self._sent : ready].rstrip())  # whitespace before a call is not content
        if ready <= self._sent:
            return []
        piece, self._sent = self.text[self._sent : ready], ready
        self._released = ready
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
                    calls = self.fmt.parse(text[self._pos : segment_end])[1]
                    if not calls and not self.calls:  # not a call at all: the answer is text
                        return out + self._as_text()
                    out += [self._whole(c) for c in calls]
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
                args_end = value_end(text, self._args_from)
                upto = args_end if args_end is not None else len(text)
                if upto > self._args_sent:
                    piece = text[self._args_sent : upto]
                    piece = piece.lstrip() if self._args_sent == self._args_from else piece
                    self._args_sent = upto
                    if piece:
                        self.calls[-1].arguments += piece
                        out.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]})
                if args_end is None:
                    return out
                self._state, self._pos = "close", args_end
            if self._state == "close":
                m = self.fmt.close.match(text, self._pos)
                if m is None:
                    return out
                self._state, self._pos = "seek", m.end()
