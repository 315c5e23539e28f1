"""structlog JSON logs: one line per event, with the service name, request id and trace id.

Hot paths (per token, per block, per layer) never log; bind the request context once with
``bind_request`` and log at request granularity.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import structlog
from opentelemetry import trace

__all__ = ["bind_request", "configure_logging", "get_logger"]


def _add_trace_id(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event["trace_id"] = format(ctx.trace_id, "032x")
    return event


def configure_logging(service: str, *, level: str | None = None, stream=None) -> None:
    """Route structlog (and stdlib logging) to JSON lines on ``stream`` (stderr by default).

    ``level`` defaults to the ``DUALPATH_LOG_LEVEL`` environment variable, else ``info``.
    """
    level_name = (level or os.environ.get("DUALPATH_LOG_LEVEL", "info")).upper()
    numeric = getattr(logging, level_name, logging.INFO)
    logging.basicConfig(stream=stream or sys.stderr, level=numeric, format="%(message)s")
    for noisy in ("nats", "uvicorn.access", "httpx"):
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_trace_id,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str | None = None):
    """A structlog logger (``name`` becomes the ``logger`` field)."""
    # Lazy proxy: module-level loggers created before configure_logging still use its settings.
    return structlog.get_logger() if name is None else structlog.get_logger(component=name)


@contextmanager
def bind_request(request_id: str) -> Iterator[None]:
    """Attach ``request_id`` to every log line emitted inside the block (task-local)."""
    tokens = structlog.contextvars.bind_contextvars(request_id=request_id)
    try:
        yield
    finally:
        structlog.contextvars.reset_contextvars(**tokens)
