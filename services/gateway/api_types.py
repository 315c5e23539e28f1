"""OpenAI request bodies accepted by the gateway (pydantic: a bad field is named in the 422/400).

Extensions follow vLLM's names: ``ignore_eos``, ``min_tokens``, ``chat_template_kwargs``
(extra chat-template variables), ``chat_template_name`` (one of the checkpoint's named
templates), and ``dualpath_read_path`` (``auto``/``pe``/``de``) to force a read side for one
request. Tools, ``tool_choice`` and ``response_format`` are checked in ``dualpath.chat.plan``
(a bad one is a 400 naming the field).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ChatCompletionRequest", "CompletionRequest", "Message"]


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    dualpath_read_path: Literal["auto", "pe", "de"] | None = None
    dualpath_session: str | None = Field(default=None, max_length=256)  # agent session id (prefetch); else X-Session-ID, else user

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Base):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template_name: str | None = None


class CompletionRequest(_Base):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
