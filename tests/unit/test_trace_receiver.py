"""The trace receiver against the OpenTelemetry SDK's own OTLP/HTTP exporter, queried as Jaeger is."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from dualpath.telemetry.receiver import TraceReceiver
from dualpath.telemetry.traceview import find_trace, from_jaeger


def _export(url: str, service: str, compression: Compression = Compression.NoCompression) -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=url + "/v1/traces", compression=compression)))
    tracer = provider.get_tracer("test")
    for rid in ("r1", "r2"):
        with tracer.start_as_current_span("request", attributes={"request_id": rid, "cached": 3, "hit": True}):
            with tracer.start_as_current_span("prefill.batch", attributes={"layers": [0, 1]}):
                pass
    provider.shutdown()


def test_spans_from_the_sdk_exporter_come_back_as_jaeger_traces_by_service_and_tag() -> None:
    with TraceReceiver(health_port=0) as receiver:
        _export(receiver.otlp_url, "gateway")
        _export(receiver.otlp_url, "scheduler", Compression.Gzip)
        assert receiver.exports == 8 and len(receiver.spans) == 8
        q = receiver.query_url
        assert httpx.get(q + "/api/services").json()["data"] == ["gateway", "scheduler"]
        answer = httpx.get(q + "/api/traces", params={"service": "gateway", "tags": json.dumps({"request_id": "r2"})}).json()
        spans = from_jaeger(answer)
        assert len(answer["data"]) == 1 and {s.name for s in spans} == {"request", "prefill.batch"}
        trace = find_trace(spans, "r2")
        root = next(s for s in trace if s.parent_id is None)
        child = next(s for s in trace if s.name == "prefill.batch")
        assert child.parent_id == root.span_id and root.service == "gateway" and root.end_ns >= root.start_ns
        assert root.attributes["cached"] == 3 and root.attributes["hit"] is True
        # "true" matches the boolean tag as Jaeger matches it; an unknown value matches nothing
        assert len(httpx.get(q + "/api/traces", params={"tags": json.dumps({"hit": "true"})}).json()["data"]) == 4
        assert httpx.get(q + "/api/traces", params={"tags": json.dumps({"request_id": "r9"})}).json()["data"] == []
        assert len(httpx.get(q + "/api/traces", params={"limit": "3"}).json()["data"]) == 3
        bad = httpx.get(q + "/api/traces", params={"tags": "[1]"})
        assert bad.status_code == 400 and "JSON object" in bad.json()["errors"][0]["msg"]


def test_a_body_that_is_no_export_is_refused_and_the_file_gets_every_span_taken(tmp_path) -> None:
    path = tmp_path / "spans.jsonl"
    with TraceReceiver(file=str(path), query_port=None, max_spans=3) as receiver:
        url = receiver.otlp_url + "/v1/traces"
        r = httpx.post(url, content=b"\xff\x00garbage", headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 400 and receiver.refused == 1
        r = httpx.post(url, content=gzip.compress(b"{not json"), headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
        assert r.status_code == 400 and receiver.refused == 2
        assert httpx.post(receiver.otlp_url + "/v1/logs", content=b"").status_code == 404
        _export(receiver.otlp_url, "engine")
        assert len(receiver.spans) == 3  # the newest max_spans are held
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 4 and {d["service"] for d in lines} == {"engine"}


def test_max_spans_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_spans"):
        TraceReceiver(max_spans=0)
