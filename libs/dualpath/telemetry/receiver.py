"""A small trace receiver: OTLP/HTTP in, a subset of Jaeger's query API out.

    dualpath trace receive [--host 127.0.0.1] [--otlp-port 4318] [--query-port 16686]
                           [--health-port 14269] [--file spans.jsonl] [--max-spans 200000]

It takes what every DualPath service exports (``POST /v1/traces``, protobuf or JSON, gzip or
not, as the OpenTelemetry SDK sends it) and answers the two query routes that ``dualpath trace
show --jaeger`` and a deployment check use: ``GET /api/services`` and ``GET /api/traces`` with
``service``, ``tags`` (a JSON object every matching span's trace must carry on one span) and
``limit``, in Jaeger's JSON shape. ``GET /`` on the health port answers 200, like Jaeger's admin
port. It stands in for Jaeger where no Jaeger image can be had (a machine without an image
registry, a test); it keeps the newest ``max_spans`` spans in memory and, with ``file``, appends
each span to a JSON-lines file that ``dualpath trace show --file`` reads.
"""

from __future__ import annotations

import gzip
import json
import threading
from collections import OrderedDict, deque
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import IO, Any
from urllib.parse import parse_qs, urlsplit

from dualpath.telemetry.traceview import SpanRecord

__all__ = ["TraceReceiver", "otlp_spans", "to_jaeger"]

MAX_BODY = 64 << 20  # an OTLP export larger than this is refused (413)


def _value(v: Any) -> Any:
    """An OTLP ``AnyValue`` as a Python value."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind) if kind else None


def otlp_spans(body: bytes, content_type: str = "application/x-protobuf") -> list[SpanRecord]:
    """The spans of one OTLP/HTTP trace export (protobuf, or the JSON encoding).

    Raises:
        ValueError: the body is not an export request in that encoding.
    """
    from google.protobuf import json_format
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    req = ExportTraceServiceRequest()
    try:
        if content_type.split(";")[0].strip() == "application/json":
            json_format.Parse(body, req)
        else:
            req.ParseFromString(body)
    except (DecodeError, json_format.ParseError) as exc:
        raise ValueError(f"not an OTLP trace export: {exc}") from None
    out = []
    for rs in req.resource_spans:
        service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), None) or "?"
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    SpanRecord(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex() or None,
                        name=s.name,
                        service=str(service),
                        start_ns=int(s.start_time_unix_nano),
                        end_ns=int(s.end_time_unix_nano),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        links=tuple(link.span_id.hex() for link in s.links),
                        status="ERROR" if s.status.code == 2 else "UNSET",
                    )
                )
    return out


def _tag(key: str, value: Any) -> dict:
    kind = "bool" if isinstance(value, bool) else "int64" if isinstance(value, int) else "float64" if isinstance(value, float) else "string"
    return {"key": key, "type": kind, "value": value if kind != "string" else (value if isinstance(value, str) else json.dumps(value))}


def to_jaeger(traces: list[list[SpanRecord]]) -> dict:
    """Traces (each a list of its spans) as a Jaeger ``GET /api/traces`` answer."""
    data = []
    for spans in traces:
        processes: dict[str, dict] = {}
        pids: dict[str, str] = {}
        out = []
        for s in spans:
            pid = pids.setdefault(s.service, f"p{len(pids) + 1}")
            processes[pid] = {"serviceName": s.service, "tags": []}
            refs = [{"refType": "CHILD_OF", "traceID": s.trace_id, "spanID": s.parent_id}] if s.parent_id else []
            refs += [{"refType": "FOLLOWS_FROM", "traceID": s.trace_id, "spanID": link} for link in s.links]
            tags = [_tag(k, v) for k, v in s.attributes.items()]
            if s.status == "ERROR":
                tags.append(_tag("error", True))
            out.append(
                {
                    "traceID": s.trace_id,
                    "spanID": s.span_id,
                    "operationName": s.name,
                    "references": refs,
                    "startTime": s.start_ns // 1000,  # microseconds, as Jaeger gives them
                    "duration": max(0, s.end_ns - s.start_ns) // 1000,
                    "tags": tags,
                    "processID": pid,
                }
            )
        data.append({"traceID": spans[0].trace_id if spans else "", "spans": out, "processes": processes})
    return {"data": data, "total": len(data), "limit": 0, "offset": 0, "errors": None}


class TraceReceiver:
    """OTLP/HTTP receiver with Jaeger-shaped queries over the spans it holds (thread-safe).

    ``start()`` binds the ports (0 picks a free one: see ``otlp_url``, ``query_url``) and
    serves from daemon threads; ``stop()`` closes them and the span file.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        otlp_port: int = 0,
        query_port: int | None = 0,
        health_port: int | None = None,
        file: str | None = None,
        max_spans: int = 200_000,
    ) -> None:
        if max_spans < 1:
            raise ValueError(f"max_spans must be at least 1, got {max_spans}")
        self._lock = threading.Lock()
        self._spans: deque[SpanRecord] = deque(maxlen=max_spans)
        self.exports = 0  # export requests taken
        self.refused = 0  # export requests answered 4xx
        self._file: IO[str] | None = open(file, "a", encoding="utf-8") if file else None  # noqa: SIM115 - closed in stop()
        self._servers: list[ThreadingHTTPServer] = []
        self._threads: list[threading.Thread] = []
        self._bind = [(host, otlp_port, self._otlp_handler())]
        if query_port is not None:
            self._bind.append((host, query_port, self._query_handler()))
        if health_port is not None:
            self._bind.append((host, health_port, _health_handler()))

    # ---- what it holds -----------------------------------------------------------------
    @property
    def spans(self) -> list[SpanRecord]:
        with self._lock:
            return list(self._spans)

    def take(self, spans: list[SpanRecord]) -> None:
        with self._lock:
            self._spans.extend(spans)
            self.exports += 1
            if self._file is not None:
                self._file.writelines(json.dumps(asdict(s)) + "\n" for s in spans)
                self._file.flush()

    def services(self) -> list[str]:
        return sorted({s.service for s in self.spans})

    def traces(self, service: str | None = None, tags: dict | None = None, limit: int = 20) -> list[list[SpanRecord]]:
        """The newest ``limit`` traces that have a span of ``service`` and a span carrying every
        pair of ``tags`` (values compared as strings, as Jaeger does), spans in start order."""
        by_trace: OrderedDict[str, list[SpanRecord]] = OrderedDict()
        for s in self.spans:
            by_trace.setdefault(s.trace_id, []).append(s)
        want = {k: str(v) for k, v in (tags or {}).items()}

        def matches(spans: list[SpanRecord]) -> bool:
            if service and not any(s.service == service for s in spans):
                return False
            return not want or any(all(_tag_str(s.attributes.get(k)) == v for k, v in want.items()) for s in spans)

        found = [sorted(spans, key=lambda s: s.start_ns) for spans in by_trace.values() if matches(spans)]
        found.sort(key=lambda spans: spans[0].start_ns, reverse=True)
        return found[: max(0, limit)] if limit else found

    # ---- serving -----------------------------------------------------------------------
    def start(self) -> TraceReceiver:
        for host, port, handler in self._bind:
            server = ThreadingHTTPServer((host, port), handler)
            server.daemon_threads = True
            thread = threading.Thread(target=server.serve_forever, name=f"trace-receiver:{server.server_address[1]}", daemon=True)
            self._servers.append(server)
            self._threads.append(thread)
            thread.start()
        return self

    def _url(self, index: int) -> str:
        host, port = self._servers[index].server_address[:2]
        return f"http://{host.decode() if isinstance(host, bytes) else host}:{port}"

    @property
    def otlp_url(self) -> str:
        return self._url(0)

    @property
    def query_url(self) -> str:
        return self._url(1)

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        for thread in self._threads:
            thread.join(5)
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> TraceReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _otlp_handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Otlp(_Quiet):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                if urlsplit(self.path).path != "/v1/traces":
                    return self._send(404, b"only /v1/traces is served here\n", "text/plain")
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY:
                    receiver.refused += 1
                    return self._send(413, b"export too large\n", "text/plain")
                body = self.rfile.read(length)
                try:
                    if self.headers.get("Content-Encoding") == "gzip":
                        body = gzip.decompress(body)
                    spans = otlp_spans(body, self.headers.get("Content-Type") or "application/x-protobuf")
                except (OSError, ValueError) as exc:
                    receiver.refused += 1
                    return self._send(400, f"{exc}\n".encode(), "text/plain")
                receiver.take(spans)
                if (self.headers.get("Content-Type") or "").startswith("application/json"):
                    return self._send(200, b"{}", "application/json")
                return self._send(200, b"", "application/x-protobuf")  # an empty ExportTraceServiceResponse

        return Otlp

    def _query_handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Query(_Quiet):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                url = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                if url.path == "/api/services":
                    names = receiver.services()
                    return self._json({"data": names, "total": len(names), "limit": 0, "offset": 0, "errors": None})
                if url.path == "/api/traces":
                    try:
                        tags = json.loads(query.get("tags") or "{}")
                        limit = int(query.get("limit") or 20)
                        if not isinstance(tags, dict):
                            raise ValueError("tags must be a JSON object")
                    except ValueError as exc:
                        return self._json({"data": None, "errors": [{"code": 400, "msg": str(exc)}]}, 400)
                    return self._json(to_jaeger(receiver.traces(query.get("service"), tags, limit)))
                return self._send(404, b"served: /api/services, /api/traces\n", "text/plain")

            def _json(self, payload: dict, code: int = 200) -> None:
                self._send(code, json.dumps(payload).encode(), "application/json")

        return Query


def _tag_str(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else json.dumps(value) if isinstance(value, (list, dict)) else str(value)


class _Quiet(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *_args: object) -> None:
        pass

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _health_handler() -> type[BaseHTTPRequestHandler]:
    class Health(_Quiet):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            self._send(200, b'{"status":"Server available"}', "application/json")

    return Health
