"""Errors of the telemetry package.

Hierarchy::

    TraceError
    ├── TraceSourceError     the span source (file, Jaeger) cannot be read
    └── TraceNotFoundError   no trace of the asked request in it
"""

from __future__ import annotations

__all__ = ["TraceError", "TraceNotFoundError", "TraceSourceError"]


class TraceError(Exception):
    """Base of the errors reading recorded traces."""


class TraceSourceError(TraceError):
    """Raised when a span file cannot be opened or a Jaeger query fails or answers garbage."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.source = source
        self.reason = reason


class TraceNotFoundError(TraceError):
    """Raised when no span of the source carries ``request_id`` (not traced, sampled out, or not flushed yet)."""

    def __init__(self, request_id: str, source: str) -> None:
        super().__init__(
            f"no trace of request {request_id!r} in {source} (was tracing on, the request sampled, the services stopped or flushed?)"
        )
        self.request_id = request_id
        self.source = source
