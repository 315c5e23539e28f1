"""A chat answer's text -> what every protocol shows of it: reasoning, content and tool calls.

``parse_answer`` splits a finished answer; ``AnswerDeltas`` does the same as the text streams,
as OpenAI chat deltas (``{"reasoning_content": ...}``, ``{"content": ...}``, ``{"tool_calls":
[...]}``). The chat route sends those deltas as they are; the Messages and Responses routes
translate them into their own events. The reasoning is split off first (``--reasoning-parser``),
and tool calls are parsed from the content after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from dualpath.chat.reasoning import StreamingReasoningParser
from dualpath.chat.stream import StreamingToolParser
from dualpath.chat.tools import ToolCall
from services.gateway.core import Prepared

__all__ = ["AnswerDeltas", "Parsed", "parse_answer", "session_of"]


@dataclass(slots=True)
class Parsed:
    reasoning: str | None  # None: the answer had no reasoning part (or no parser is set)
    content: str | None  # None: only tool calls
    calls: list[ToolCall] = field(default_factory=list)


def parse_answer(prep: Prepared, text: str) -> Parsed:
    """Split a finished answer into reasoning, content and tool calls."""
    reasoning, content = prep.reasoning.split(text, in_reasoning=prep.in_reasoning) if prep.reasoning is not None else (None, text)
    if prep.tool_format is None:
        return Parsed(reasoning, content)
    body, calls = prep.tool_format.parse(content)
    return Parsed(reasoning, body, calls)


class AnswerDeltas:
    """Text deltas of a streamed answer -> OpenAI chat deltas; ``calls`` once it ended."""

    def __init__(self, prep: Prepared) -> None:
        self._reasoning = StreamingReasoningParser(prep.reasoning, in_reasoning=prep.in_reasoning) if prep.reasoning is not None else None
        self._tools = StreamingToolParser(prep.tool_format) if prep.tool_format is not None else None

    @property
    def calls(self) -> list[ToolCall]:
        return self._tools.calls if self._tools is not None else []

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas ``text`` releases (text that may be a marker is held back)."""
        return self._route(self._reasoning.feed(text) if self._reasoning is not None else [("content", text)])

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still held once the answer ended."""
        out = self._route(self._reasoning.finish()) if self._reasoning is not None else []
        return out + (self._tools.finish() if self._tools is not None else [])

    def _route(self, pieces: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for kind, text in pieces:
            if kind == "reasoning":
                out.append({"reasoning_content": text})
            elif self._tools is not None:
                out += self._tools.feed(text)
            elif text:
                out.append({"content": text})
        return out


def session_of(prep: Prepared, request: Request) -> str:
    """The agent session: the ``dualpath_session`` extension, else ``X-Session-ID`` (aiperf
    ``--session-header``), else the OpenAI ``user`` field; "" when none says (at most 256 chars)."""
    return prep.session or request.headers.get("x-session-id", "")[:256] or prep.user[:256]
