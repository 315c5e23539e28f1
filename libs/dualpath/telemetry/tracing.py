"""OpenTelemetry tracing set-up shared by every service.

Exporters, chosen by standard environment variables:

- ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set: OTLP over HTTP
  (what Jaeger ingests);
- ``DUALPATH_TRACE_FILE`` set: one JSON object per span appended to that file (both when both
  are set);
- neither: tracing stays a no-op (spans cost almost nothing, nothing goes on the wire).

Sampling follows ``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG`` and batching the
``OTEL_BSP_*`` variables (the SDK reads them).

Trace context crosses NATS in message headers (W3C ``traceparent``), see ``dualpath.bus``.
Work that waits in a queue (scheduler, engine batches) outlives the message that brought it,
so the messages that start such work also carry their request's context in a ``trace`` field:
``carrier()`` fills it, ``context_from()`` turns it back into a parent for new spans.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import cast

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

__all__ = [
    "JsonLinesSpanExporter",
    "carrier",
    "configure_tracing",
    "context_from",
    "flush_tracing",
    "get_tracer",
    "shutdown_tracing",
    "tracing_enabled",
]

_provider: TracerProvider | None = None


class JsonLinesSpanExporter(SpanExporter):
    """Appends finished spans to a file as JSON lines (the collector-less default)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for s in spans:
            ctx = cast(trace.SpanContext, s.get_span_context())  # set on every finished span
            lines.append(
                json.dumps(
                    {
                        "trace_id": format(ctx.trace_id, "032x"),
                        "span_id": format(ctx.span_id, "016x"),
                        "parent_id": format(s.parent.span_id, "016x") if s.parent else None,
                        "name": s.name,
                        "service": s.resource.attributes.get("service.name"),
                        "start_ns": s.start_time,
                        "end_ns": s.end_time,
                        "attributes": dict(s.attributes or {}),
                        "links": [format(link.context.span_id, "016x") for link in s.links],
                        "status": s.status.status_code.name,
                    },
                    default=str,
                )
            )
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
    if path:
        provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(path)))
    trace.set_tracer_provider(provider)
    _provider = provider
    return True


def shutdown_tracing() -> None:
    """Flush and stop the exporter (call on service exit so no span is lost)."""
    if _provider is not None:
        _provider.shutdown()


def flush_tracing(timeout_ms: int = 5000) -> None:
    """Export every finished span now (for a process about to end without ``shutdown_tracing``)."""
    if _provider is not None:
        _provider.force_flush(timeout_ms)


def tracing_enabled() -> bool:
    """True when this process exports spans (gate for gathering span-only figures)."""
    return _provider is not None


def get_tracer(name: str = "dualpath"):
    """The tracer for ``name`` (a no-op one until ``configure_tracing`` installs a provider)."""
    return trace.get_tracer(name)


def carrier(span: trace.Span | None = None) -> dict[str, str]:
    """W3C trace context (``traceparent``/``tracestate``) of ``span``, default the current span.

    Empty when nothing is traced, so messages stay as small as without tracing.
    """
    out: dict[str, str] = {}
    propagate.inject(out, context=trace.set_span_in_context(span) if span is not None else None)
    return out


def context_from(trace_carrier: dict[str, str] | None) -> Context:
    """The parent context a ``carrier()`` describes; an empty context (a new root) when it is empty.

    Never the caller's current context: queued work must not hang under whatever message
    happened to wake the loop that runs it.
    """
    return propagate.extract(trace_carrier or {})
