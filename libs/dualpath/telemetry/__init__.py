"""Observability: structured JSON logs (``logs``), OpenTelemetry traces (``tracing``, read back by
``traceview``) and metrics with a Prometheus endpoint (``metrics``)."""

from dualpath.telemetry.logs import bind_request, configure_logging, get_logger
from dualpath.telemetry.tracing import configure_tracing, get_tracer

__all__ = ["bind_request", "configure_logging", "configure_tracing", "get_logger", "get_tracer"]
