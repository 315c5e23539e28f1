"""OpenTelemetry tracing set-up shared by every service.

Exporters, chosen by standard environment variables:

- ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set: OTLP over HTTP
  (what Jaeger ingests);
- else ``DUALPATH_TRACE_FILE`` set: one JSON object per span appended to that file;
- else tracing stays a no-op (spans cost almost nothing).

Sampling follows ``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG`` (the SDK reads them).
Trace context crosses NATS in message headers (W3C ``traceparent``), see ``dualpath.bus``.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

__all__ = ["JsonLinesSpanExporter", "configure_tracing", "get_tracer", "shutdown_tracing"]

_provider: TracerProvider | None = None


class JsonLinesSpanExporter(SpanExporter):
    """Appends finished spans to a file as JSON lines (the collector-less default)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for s in spans:
            ctx = s.get_span_context()
            lines.append(json.dumps({
                "trace_id": format(ctx.trace_id, "032x"),
                "span_id": format(ctx.span_id, "016x"),
                "parent_id": format(s.parent.span_id, "016x") if s.parent else None,
                "name": s.name,
                "service": s.resource.attributes.get("service.name"),
                "start_ns": s.start_time,
                "end_ns": s.end_time,
                "attributes": dict(s.attributes or {}),
                "status": s.status.status_code.name,
            }, default=str))
        with self._lock, open(self._path, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def configure_tracing(service: str) -> bool:
    """Install the tracer provider for this process; returns True when spans are exported."""
    global _provider
    otlp = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    path = os.environ.get("DUALPATH_TRACE_FILE")
    if not otlp and not path:
        return False
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if otlp:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(path)))
    trace.set_tracer_provider(provider)
    _provider = provider
    return True


def shutdown_tracing() -> None:
    """Flush and stop the exporter (call on service exit so no span is lost)."""
    if _provider is not None:
        _provider.shutdown()


def get_tracer(name: str = "dualpath"):
    return trace.get_tracer(name)
