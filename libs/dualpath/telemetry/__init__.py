"""Observability: structured JSON logs (``logs``) and OpenTelemetry traces (``tracing``)."""

from dualpath.telemetry.logs import bind_request, configure_logging, get_logger
from dualpath.telemetry.tracing import configure_tracing, get_tracer

__all__ = ["bind_request", "configure_logging", "configure_tracing", "get_logger", "get_tracer"]
