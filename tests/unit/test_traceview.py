"""Reading recorded traces (JSON lines, Jaeger answers), the request tree, trace context carriers."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from dualpath.cli.trace import show
from dualpath.telemetry.errors import TraceNotFoundError, TraceSourceError
from dualpath.telemetry.traceview import find_trace, from_jaeger, load_jsonl, render_tree
from dualpath.telemetry.tracing import carrier, context_from

T1, T2 = "a" * 32, "b" * 32


def _span(trace_id, span_id, parent, name, service, start_ms, dur_ms, **attrs) -> dict:
    return {
        "trace_id": trace_id,
        "span_id": span_id,
        "parent_id": parent,
        "name": name,
        "service": service,
        "start_ns": int(start_ms * 1e6),
        "end_ns": int((start_ms + dur_ms) * 1e6),
        "attributes": attrs,
        "links": [],
        "status": "UNSET",
    }


@pytest.fixture()
def span_file(tmp_path):
    spans = [
        _span(T1, "0000000000000001", None, "request", "gateway", 1000, 50, request_id="r1"),
        _span(T1, "0000000000000002", "0000000000000001", "scheduler.decision", "scheduler", 1002, 3, request_id="r1", read_side="de"),
        _span(T1, "0000000000000003", "0000000000000001", "prefill.request", "prefill-engine-p0e0", 1005, 20),
        _span(T1, "0000000000000004", "0000000000000003", "kv.fetch", "prefill-engine-p0e0", 1010, 1.5, layer=0, wait_s=0.0002),
        _span(T1, "0000000000000005", "00000000000000ff", "storage.read", "traffic-manager", 1006, 2),
        _span(T2, "0000000000000006", None, "request", "gateway", 900, 10, request_id="r2"),
    ]
    shared = _span(T2, "0000000000000007", "0000000000000006", "prefill.batch", "prefill-engine-p0e0", 1008, 4)
    shared["links"] = ["0000000000000003"]
    path = tmp_path / "spans.jsonl"
    path.write_text("\n".join(json.dumps(s) for s in [*spans, shared]) + '\n{"trace_id": "torn')
    return path


def test_the_span_file_loader_skips_a_torn_last_line(span_file):
    assert len(load_jsonl(span_file)) == 7


def test_find_trace_keeps_only_the_requests_trace_in_start_order(span_file):
    spans = find_trace(load_jsonl(span_file), "r1")
    assert {s.trace_id for s in spans} == {T1}
    assert [s.name for s in spans][:2] == ["request", "scheduler.decision"]


def test_the_tree_nests_children_under_parents_with_offsets_and_marks_orphans(span_file):
    out = render_tree(find_trace(load_jsonl(span_file), "r1"))
    lines = out.splitlines()
    assert lines[0].startswith(f"trace {T1}  request r1  5 spans  50.0 ms")
    request = next(line for line in lines if "request [gateway]" in line)
    assert request.split()[:2] == ["0.00", "50.00"]
    fetch = next(line for line in lines if "kv.fetch" in line)
    assert fetch.split()[:2] == ["10.00", "1.50"] and "   └─ kv.fetch" in fetch and "layer=0 wait_s=0.0002" in fetch
    assert "├─ scheduler.decision [scheduler]  read_side=de" in out
    assert "storage.read [traffic-manager] (orphan)" in out  # its parent was never exported


def test_show_lists_batches_of_other_traces_that_link_to_the_request(span_file):
    out = show("r1", file=str(span_file))
    assert "linked from other traces" in out and f"prefill.batch [prefill-engine-p0e0] 4.00 ms  trace {T2}" in out


def test_an_unknown_request_or_a_missing_file_raise_named_errors(span_file, tmp_path):
    with pytest.raises(TraceNotFoundError):
        find_trace(load_jsonl(span_file), "nope")
    with pytest.raises(TraceSourceError):
        load_jsonl(tmp_path / "absent.jsonl")


JAEGER = {
    "data": [
        {
            "traceID": T1,
            "processes": {"p1": {"serviceName": "gateway"}, "p2": {"serviceName": "scheduler"}},
            "spans": [
                {
                    "traceID": T1,
                    "spanID": "0000000000000001",
                    "operationName": "request",
                    "references": [],
                    "startTime": 1_000_000,
                    "duration": 50_000,
                    "processID": "p1",
                    "tags": [{"key": "request_id", "type": "string", "value": "r1"}],
                },
                {
                    "traceID": T1,
                    "spanID": "0000000000000002",
                    "operationName": "scheduler.decision",
                    "processID": "p2",
                    "references": [{"refType": "CHILD_OF", "traceID": T1, "spanID": "0000000000000001"}],
                    "startTime": 1_002_000,
                    "duration": 3_000,
                    "tags": [{"key": "policy", "type": "string", "value": "dualpath"}],
                },
            ],
        }
    ]
}


def test_jaeger_answers_become_the_same_tree():
    spans = from_jaeger(JAEGER)
    out = render_tree(find_trace(spans, "r1"))
    assert "└─ scheduler.decision [scheduler]  policy=dualpath" in out
    assert next(line for line in out.splitlines() if "scheduler.decision" in line).split()[:2] == ["2.00", "3.00"]
    with pytest.raises(TraceSourceError):
        from_jaeger({"data": [{"spans": [{"spanID": "1"}]}]})


def test_show_queries_jaeger_by_the_request_id_tag():
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            seen.append(self.path)
            body = json.dumps(JAEGER).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = show("r1", jaeger=f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
    assert "request [gateway]" in out
    assert seen and seen[0].startswith("/api/traces?service=gateway&tags=") and "r1" in seen[0]


def test_a_carrier_round_trips_the_span_context_and_an_empty_one_starts_a_new_trace():
    tracer = TracerProvider().get_tracer("test")
    span = tracer.start_span("root")
    c = carrier(span)
    assert c["traceparent"].split("-")[1] == format(span.get_span_context().trace_id, "032x")
    parent = trace.get_current_span(context_from(c)).get_span_context()
    assert parent.span_id == span.get_span_context().span_id and parent.is_remote
    assert not trace.get_current_span(context_from({})).get_span_context().is_valid
    assert carrier() == {}  # nothing current, nothing traced: messages carry nothing
