"""Request bodies for one agent's conversation, built incrementally.

Each turn's prompt is the previous prompt + the answer + the next append, so the server
can reuse the previous turn's KV. Re-serialising a 64K-token prompt every turn would
block the event loop for milliseconds (and inflate every other agent's timings), so the
JSON-escaped history is kept as bytes and only the new pieces are escaped.

``completions``: one growing ``prompt`` string. ``chat``: ``messages`` with the system
prompt (if any) as a system message and turns as alternating user/assistant messages.
Every body asks for exactly ``max_tokens`` tokens: ``"max_tokens": N`` plus vLLM's
``"ignore_eos": true, "min_tokens": N`` (omitted with ``exact=False`` for servers that
reject unknown fields), greedy sampling, streaming with ``include_usage``.
"""

from __future__ import annotations

import json

__all__ = ["Conversation"]


def _escaped(text: str) -> bytes:
    return json.dumps(text, ensure_ascii=False)[1:-1].encode("utf-8")


class Conversation:
    """The growing history of one agent and the request body for its next turn."""

    def __init__(self, *, chat: bool, model: str, exact: bool = True) -> None:
        self.chat = chat
        self.model_json = json.dumps(model).encode()
        self.exact = exact
        self.prompt = bytearray()  # completions: escaped prompt text so far
        self.messages: list[bytes] = []  # chat: serialised messages so far

    def add_system(self, text: str) -> None:
        """Start the history with a system prompt (no-op for empty text)."""
        if not text:
            return
        if self.chat:
            self.messages.append(b'{"role":"system","content":"%s"}' % _escaped(text))
        else:
            self.prompt += _escaped(text)

    def add_user(self, text: str) -> None:
        """Append the next turn's new input (a tool result, a user message)."""
        if self.chat:
            self.messages.append(b'{"role":"user","content":"%s"}' % _escaped(text))
        else:
            self.prompt += _escaped(text)

    def add_answer(self, text: str) -> None:
        """Append the server's answer to the previous turn."""
        if self.chat:
            self.messages.append(b'{"role":"assistant","content":"%s"}' % _escaped(text))
        else:
            self.prompt += _escaped(text)

    def body(self, max_tokens: int) -> bytes:
        """The JSON request body for the next turn, generating ``max_tokens`` tokens."""
        tail = b'"max_tokens":%d,"temperature":0,"stream":true,"stream_options":{"include_usage":true}' % max_tokens
        if self.exact:
            tail += b',"ignore_eos":true,"min_tokens":%d' % max_tokens
        if self.chat:
            history = b'"messages":[' + b",".join(self.messages) + b"]"
        else:
            history = b'"prompt":"' + bytes(self.prompt) + b'"'
        return b'{"model":%s,%s,%s}' % (self.model_json, history, tail)
