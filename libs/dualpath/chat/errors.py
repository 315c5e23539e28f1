"""Errors of the chat layer (templates, tools, structured outputs).

Hierarchy::

    ChatError (also a ValueError)     bad client input to the chat API; ``param`` names the field
    ├── ChatTemplateError             the chat template cannot render the messages (or does not compile)
    ├── ToolSpecError                 ``tools`` / ``tool_choice`` / tool messages are inconsistent
    └── GrammarError                  a ``response_format`` or tool schema does not compile to a grammar

The gateway answers each with HTTP 400 naming ``param``.
"""

from __future__ import annotations

__all__ = ["ChatError", "ChatTemplateError", "GrammarError", "ToolSpecError"]


class ChatError(ValueError):
    """Base class; ``param`` is the request field at fault (OpenAI's error ``param``)."""

    default_param = "messages"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param or self.default_param


class ChatTemplateError(ChatError):
    """Raised when the checkpoint's chat template refuses or cannot render the messages, or
    when a template does not compile at load time."""


class ToolSpecError(ChatError):
    """Raised for an invalid tool definition, a ``tool_choice`` naming no tool, or a ``tool``
    message whose ``tool_call_id`` matches no earlier assistant tool call."""

    default_param = "tools"


class GrammarError(ChatError):
    """Raised when a ``response_format`` schema or a tool's parameters cannot be compiled into
    a grammar for constrained decoding."""

    default_param = "response_format"
