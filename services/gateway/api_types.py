"""OpenAI request bodies accepted by the gateway (pydantic: a bad field is named in the 422/400).

Extensions follow vLLM's names: ``ignore_eos``, ``min_tokens``, ``chat_template_kwargs``
(extra chat-template variables), ``chat_template_name`` (one of the checkpoint's named
templates), ``cache_salt`` (the request's prompt hashes apart from every other salt: no KV cache
hit on, or from, a request without the same salt, as in vLLM), and ``dualpath_read_path``
(``auto``/``pe``/``de``) to force a read side for one request. Tools, ``tool_choice`` and
``response_format`` are checked in ``dualpath.chat.plan`` (a bad one is a 400 naming the field).

Validation is strict (JSON types as declared: ``false`` is no token id, ``"5"`` no max_tokens;
``300.0`` is an integer, as in JSON Schema), so what the OpenAPI document says is invalid is
refused with a 422, and what it says is valid passes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

__all__ = [
    "CACHE_SALT_MAX",
    "ERROR_RESPONSES",
    "REQUEST_ERROR_RESPONSES",
    "ChatCompletionRequest",
    "CompletionRequest",
    "ErrorBody",
    "JsonInt",
    "Message",
]


CACHE_SALT_MAX = 1024  # characters of a cache_salt (vLLM suggests 43: 256 random bits in base64)


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer as JSON Schema has it: 3 or 3.0, never true or "3" (the models are strict).
_INTEGRAL = BeforeValidator(_integral)
JsonInt = Annotated[int, _INTEGRAL]


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: Annotated[int, Field(ge=1), _INTEGRAL] | None = None  # bounds inside Annotated: JSON Schema "minimum"
    max_completion_tokens: Annotated[int, Field(ge=1), _INTEGRAL] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: JsonInt = Field(default=0, ge=0)
    seed: JsonInt | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    n: JsonInt = Field(default=1, ge=1, le=1)
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: JsonInt = Field(default=0, ge=0)
    dualpath_read_path: Literal["auto", "pe", "de"] | None = None
    dualpath_session: str | None = Field(default=None, max_length=256)  # agent session id (prefetch); else X-Session-ID, else user
    cache_salt: str | None = Field(default=None, min_length=1, max_length=CACHE_SALT_MAX)  # salts the prompt's KV block hashes

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Base):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20), _INTEGRAL] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template_name: str | None = None


class CompletionRequest(_Base):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0), _INTEGRAL]], Field(min_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=20), _INTEGRAL] | None = None
    echo: bool = False


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorBody(BaseModel):
    """OpenAI's error body: every non-2xx answer of the gateway has this shape."""

    error: ErrorDetail


def _err(description: str) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description}


# The error answers every route may give, declared in the OpenAPI document (schemathesis checks
# that each status a route answers is declared). 401 only when an API key is set; 405 carries Allow.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: _err("missing or wrong API key (only when the gateway has one)"),
    404: _err("no such route"),
    405: _err("method not allowed on this route (the Allow header lists those that are)"),
}
REQUEST_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    400: _err("malformed JSON, a missing field, an empty or too long prompt, or a bad tool/response_format"),
    404: _err("unknown model"),
    422: _err("a field with an invalid value (the field is named in error.param)"),
    429: _err("over the tenant's limit (max_concurrency, tokens_per_minute) or overloaded; retry after Retry-After seconds"),
    503: _err("no scheduler or engine available right now; retry after Retry-After seconds"),
}
