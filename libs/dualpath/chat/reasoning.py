"""Reasoning output: the ``<think>…</think>`` part of a reasoning model's answer, apart from its
content (vLLM's ``--reasoning-parser`` names).

- ``deepseek_r1``: DeepSeek-R1 / QwQ. Their templates may open ``<think>`` in the prompt, so the
  answer may start inside the reasoning and only contain ``</think>``: everything before
  ``</think>`` is reasoning (a leading ``<think>`` is dropped), everything after it content. An
  answer that never closes the reasoning is all reasoning.
- ``qwen3``: Qwen3 writes ``<think>`` itself when it thinks: reasoning only between ``<think>``
  and ``</think>``; an answer without ``<think>`` is all content.

Either way, when the rendered prompt itself ends inside an open ``<think>`` (a template that
starts the reasoning for the model), the answer starts in reasoning. Tool calls and structured
output are parsed from the content only.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["REASONING_PARSERS", "ReasoningFormat", "StreamingReasoningParser", "reasoning_format"]

START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """One parser: ``implicit_start``: text before any ``<think>`` is reasoning (deepseek_r1)."""

    name: str
    implicit_start: bool

    def opens_in_reasoning(self, prompt: str) -> bool:
        """Whether an answer to ``prompt`` starts inside the reasoning."""
        tail = prompt.rstrip()
        return self.implicit_start or (tail.rfind(START) > tail.rfind(END))

    def split(self, text: str, *, in_reasoning: bool) -> tuple[str | None, str]:
        """A finished answer -> (reasoning or None, content)."""
        parser = StreamingReasoningParser(self, in_reasoning=in_reasoning)
        parts = [*parser.feed(text), *parser.finish()]
        reasoning = "".join(t for kind, t in parts if kind == "reasoning")
        content = "".join(t for kind, t in parts if kind == "content")
        return (reasoning if parser.saw_reasoning else None), content


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    f.name: f for f in (ReasoningFormat("deepseek_r1", implicit_start=True), ReasoningFormat("qwen3", implicit_start=False))
}


def reasoning_format(name: str) -> ReasoningFormat | None:
    """The parser called ``name`` ("" or "none": no reasoning parsing).

    Raises:
        ValueError: unknown name.
    """
    if name in ("", "none"):
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]


def _held(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker``."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)


class StreamingReasoningParser:
    """Text deltas -> ``("reasoning", text)`` / ``("content", text)`` pieces, holding back only
    what could still become a ``<think>`` or ``</think>`` marker.

    States: ``start`` (nothing decided: a ``<think>`` may open the answer; any other text is
    reasoning when the answer starts inside it, else content), ``reasoning``, ``content``.
    Whitespace right after ``</think>`` is dropped (templates put a newline there).
    """

    def __init__(self, fmt: ReasoningFormat, *, in_reasoning: bool) -> None:
        self.fmt = fmt
        self._implicit = in_reasoning or fmt.implicit_start  # text before any <think> is reasoning
        self._state = "start"
        self._buf = ""
        self._trim = False  # drop whitespace at the start of the content
        self.saw_reasoning = False
        self.reasoning = ""  # everything released as reasoning

    def feed(self, delta: str) -> list[tuple[str, str]]:
        """The pieces ``delta`` releases."""
        self._buf += delta
        out: list[tuple[str, str]] = []
        while self._buf:
            if self._state == "start":
                head = self._buf.lstrip()
                if START.startswith(head):  # "", "<", "<th", ...: undecided
                    break
                if head.startswith(START):
                    self._buf, self._state, self.saw_reasoning = head[len(START) :].lstrip("\n"), "reasoning", True
                    continue
                self._state = "reasoning" if self._implicit else "content"
                self.saw_reasoning = self._implicit
                continue
            if self._state == "reasoning":
                at = self._buf.find(END)
                if at == -1:
                    keep = _held(self._buf, END)
                    piece, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
                    self._emit(out, "reasoning", piece)
                    break
                self._emit(out, "reasoning", self._buf[:at])
                self._buf, self._state, self._trim = self._buf[at + len(END) :], "content", True
                continue
            if self._trim:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._trim = False
            self._emit(out, "content", self._buf)
            self._buf = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What is still held once the answer ended."""
        rest, self._buf = self._buf, ""
        if not rest:
            return []
        if self._state == "start":  # an answer that is a prefix of "<think>" (or whitespace)
            kind = "reasoning" if self._implicit else "content"
            self.saw_reasoning = self._implicit
            if kind == "reasoning":
                self.reasoning += rest
            return [(kind, rest)]
        if self._state == "reasoning":
            self.reasoning += rest
            return [("reasoning", rest)]
        return [] if self._trim and not rest.strip() else [("content", rest.lstrip() if self._trim else rest)]

    def _emit(self, out: list[tuple[str, str]], kind: str, text: str) -> None:
        if text:
            if kind == "reasoning":
                self.reasoning += text
            out.append((kind, text))
