"""``dualpath trace``: read request traces, measure what tracing costs.

    dualpath trace show REQUEST_ID --file spans.jsonl       (DUALPATH_TRACE_FILE of the services)
    dualpath trace show REQUEST_ID --jaeger http://HOST:16686
    dualpath trace overhead [--model DIR] [--conversations 12] [--turns 4] [--json]
    dualpath trace batches --file spans.jsonl [--json]
    dualpath trace receive [--host 127.0.0.1] [--otlp-port 4318] [--query-port 16686] [--file spans.jsonl]

``batches`` bins every prefill batch's predicted time against the compute quota and checks
that none exceeds it but a lone minimal chunk (exit code 1 otherwise).

``receive`` runs a trace receiver where no Jaeger is at hand: OTLP/HTTP in, the part of
Jaeger's query API that ``show --jaeger`` uses out (see ``dualpath.telemetry.receiver``).

``show`` prints the request's trace as a tree: start offset and duration in ms per span, the
service that recorded it, key attributes (scheduling decision, per-layer transfers...).
The request id is the ``id`` of the OpenAI answer (also the ``X-Request-Id`` header).
``overhead`` runs the same kind of conversations with tracing on and off on one stack and
prints how much prefill time tracing adds (see ``dualpath.bench.trace_overhead``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dualpath.telemetry.errors import TraceError, TraceSourceError
from dualpath.telemetry.traceview import SpanRecord, find_trace, from_jaeger, linked_spans, load_jsonl, render_tree

__all__ = ["fetch_jaeger", "main", "show"]


def fetch_jaeger(url: str, request_id: str, *, timeout: float = 10.0) -> list[SpanRecord]:
    """The spans Jaeger's query API returns for traces whose gateway span has ``request_id``.

    Raises:
        TraceSourceError: Jaeger cannot be reached or answers with an error or garbage.
    """
    import httpx

    params = {"service": "gateway", "tags": json.dumps({"request_id": request_id}), "limit": "5"}
    try:
        r = httpx.get(url.rstrip("/") + "/api/traces", params=params, timeout=timeout)
        r.raise_for_status()
        payload = r.json()
    except httpx.HTTPError as exc:
        raise TraceSourceError(url, str(exc)) from None
    except ValueError:
        raise TraceSourceError(url, "the answer is not JSON") from None
    if not isinstance(payload, dict):
        raise TraceSourceError(url, "the answer is not a JSON object")
    return from_jaeger(payload)


def show(request_id: str, *, file: str = "", jaeger: str = "", attr_width: int = 160) -> str:
    """The rendered tree of ``request_id``'s trace from a span file or Jaeger.

    Raises:
        TraceSourceError: the source cannot be read.
        TraceNotFoundError: the request has no trace there.
    """
    source = file or jaeger
    spans = load_jsonl(file) if file else fetch_jaeger(jaeger, request_id)
    trace = find_trace(spans, request_id, source)
    out = render_tree(trace, attr_width=attr_width)
    shared = linked_spans(spans, trace)
    if shared:
        out += "\nlinked from other traces (shared work):\n" + "\n".join(
            f"  {s.name} [{s.service}] {s.duration_ms:.2f} ms  trace {s.trace_id}" for s in shared
        )
    return out


def _batches(path: str, *, as_json: bool) -> int:
    from dualpath.telemetry.batches import batch_report, render_batch_report

    if not os.path.isfile(path):
        print(f"dualpath trace: --file {path}: no such file", file=sys.stderr)
        return 2
    try:
        report = batch_report(load_jsonl(path))
    except TraceError as exc:
        print(f"dualpath trace: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if as_json else render_batch_report(report))
    return 1 if report["violations"] else 0


def _receive(ns: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT."""
    import signal
    import threading

    from dualpath.telemetry.receiver import TraceReceiver

    try:
        receiver = TraceReceiver(
            ns.host,
            otlp_port=ns.otlp_port,
            query_port=ns.query_port,
            health_port=ns.health_port or None,
            file=ns.file or None,
            max_spans=ns.max_spans,
        ).start()
    except (OSError, ValueError) as exc:
        print(f"dualpath trace receive: {exc}", file=sys.stderr)
        return 2
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"trace receiver: OTLP {receiver.otlp_url}/v1/traces, queries {receiver.query_url}/api/traces", flush=True)
    done.wait()
    receiver.stop()
    print(f"trace receiver: {len(receiver.spans)} spans held from {receiver.exports} exports", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpath trace", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("show", help="print one request's trace as a tree with durations")
    s.add_argument("request_id", help="the request id (OpenAI answer id, X-Request-Id header)")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--file", default="", help="JSON-lines span file (what DUALPATH_TRACE_FILE pointed the services to)")
    src.add_argument("--jaeger", default="", help="Jaeger query base URL, e.g. http://127.0.0.1:16686")
    s.add_argument("--width", type=int, default=160, help="most characters of attributes per line")
    b = sub.add_parser("batches", help="prefill batches' predicted times against the compute quota (histogram, check)")
    b.add_argument("--file", required=True, help="JSON-lines span file (what DUALPATH_TRACE_FILE pointed the services to)")
    b.add_argument("--json", action="store_true", help="print the figures as JSON")
    r = sub.add_parser("receive", help="receive OTLP spans and answer Jaeger-style queries (a stand-in for Jaeger)")
    r.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    r.add_argument("--otlp-port", type=int, default=4318, help="OTLP/HTTP port (POST /v1/traces)")
    r.add_argument("--query-port", type=int, default=16686, help="query port (GET /api/services, /api/traces)")
    r.add_argument("--health-port", type=int, default=14269, help="health port (GET / answers 200; 0: none)")
    r.add_argument("--file", default="", help="also append every span to this JSON-lines file")
    r.add_argument("--max-spans", type=int, default=200_000, help="spans held for queries (the oldest go first)")
    o = sub.add_parser("overhead", help="tracing on vs off, same run: how much prefill time tracing adds")
    o.add_argument("--model", default="", help="checkpoint directory (default: a tiny 8-layer model made in a temp dir)")
    o.add_argument("--conversations", type=int, default=12, help="conversations (each is traced or not, at random)")
    o.add_argument("--turns", type=int, default=4, help="turns per conversation")
    o.add_argument("--turn-tokens", type=int, default=384, help="new prompt tokens per turn")
    o.add_argument("--max-tokens", type=int, default=8, help="tokens generated per turn")
    o.add_argument("--run-dir", default="", help="logs and span file go here (default: a temp dir)")
    o.add_argument("--json", action="store_true", help="print the figures as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.cmd == "show":
        if ns.file and not os.path.isfile(ns.file):
            print(f"dualpath trace: --file {ns.file}: no such file", file=sys.stderr)
            return 2
        try:
            print(show(ns.request_id, file=ns.file, jaeger=ns.jaeger, attr_width=ns.width))
        except TraceError as exc:
            print(f"dualpath trace: {exc}", file=sys.stderr)
            return 1
        return 0
    if ns.cmd == "batches":
        return _batches(ns.file, as_json=ns.json)
    if ns.cmd == "receive":
        return _receive(ns)
    from dualpath.bench.trace_overhead import format_report, measure

    try:
        report = measure(
            model=ns.model,
            conversations=ns.conversations,
            turns=ns.turns,
            turn_tokens=ns.turn_tokens,
            max_tokens=ns.max_tokens,
            run_dir=ns.run_dir,
        )
    except Exception as exc:  # noqa: BLE001 - a benchmark reports why it could not run
        print(f"dualpath trace overhead: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if ns.json else format_report(report))
    return 0
