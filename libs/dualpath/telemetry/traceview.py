"""Read recorded spans and print one request's trace as a tree with durations.

Two sources: the JSON-lines file ``JsonLinesSpanExporter`` writes (``load_jsonl``) and Jaeger's
HTTP query API (``from_jaeger`` parses ``GET /api/traces`` answers). ``find_trace`` picks the
trace whose spans carry ``request_id`` (the gateway's root span has it), ``render_tree``
prints it: start offset and duration in milliseconds, span name, service, key attributes.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from dualpath.telemetry.errors import TraceNotFoundError, TraceSourceError

__all__ = ["SpanRecord", "find_trace", "from_jaeger", "linked_spans", "load_jsonl", "render_tree"]

_SKIP_ATTRS = {"request_id", "request_ids", "region", "prefill_candidates", "decode_candidates"}


@dataclass(frozen=True, slots=True, kw_only=True)
class SpanRecord:
    """One finished span, whatever the source (ids are lowercase hex)."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict
    links: tuple[str, ...] = ()
    status: str = "UNSET"

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def load_jsonl(path: str | Path) -> list[SpanRecord]:
    """Every span in a JSON-lines span file; lines that are not spans (a torn last line) are skipped.

    Raises:
        TraceSourceError: the file cannot be read.
    """
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise TraceSourceError(str(path), exc.strerror or str(exc)) from None
    spans = []
    for line in text.splitlines():
        try:
            d = json.loads(line)
            spans.append(
                SpanRecord(
                    trace_id=d["trace_id"],
                    span_id=d["span_id"],
                    parent_id=d.get("parent_id"),
                    name=d["name"],
                    service=d.get("service") or "?",
                    start_ns=int(d["start_ns"]),
                    end_ns=int(d["end_ns"]),
                    attributes=dict(d.get("attributes") or {}),
                    links=tuple(d.get("links") or ()),
                    status=d.get("status", "UNSET"),
                )
            )
        except (ValueError, KeyError, TypeError):
            continue
    return spans


def from_jaeger(payload: dict) -> list[SpanRecord]:
    """Spans of a Jaeger ``/api/traces`` answer (``{"data": [{"spans": [...], "processes": {...}}]}``).

    Raises:
        TraceSourceError: the answer does not have that shape.
    """
    try:
        out = []
        for tr in payload.get("data") or []:
            services = {pid: p.get("serviceName", "?") for pid, p in (tr.get("processes") or {}).items()}
            for s in tr["spans"]:
                refs = s.get("references") or []
                parent = next((r["spanID"] for r in refs if r.get("refType") == "CHILD_OF"), None)
                links = tuple(r["spanID"] for r in refs if r.get("refType") == "FOLLOWS_FROM")
                start = int(s["startTime"]) * 1000  # microseconds
                attrs = {t["key"]: t.get("value") for t in s.get("tags") or []}
                out.append(
                    SpanRecord(
                        trace_id=s["traceID"].rjust(32, "0"),
                        span_id=s["spanID"].rjust(16, "0"),
                        parent_id=parent.rjust(16, "0") if parent else None,
                        name=s["operationName"],
                        service=services.get(s.get("processID"), "?"),
                        start_ns=start,
                        end_ns=start + int(s.get("duration", 0)) * 1000,
                        attributes=attrs,
                        links=links,
                        status="ERROR" if attrs.get("error") is True else "UNSET",
                    )
                )
        return out
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise TraceSourceError("jaeger", f"unexpected answer shape ({type(exc).__name__}: {exc})") from None


def find_trace(spans: list[SpanRecord], request_id: str, source: str = "the spans") -> list[SpanRecord]:
    """The spans of ``request_id``'s trace (the one its gateway root span starts), by start time.

    Raises:
        TraceNotFoundError: no span carries that ``request_id``.
    """
    tagged = [s for s in spans if s.attributes.get("request_id") == request_id]
    if not tagged:
        raise TraceNotFoundError(request_id, source)
    roots = [s for s in tagged if s.parent_id is None]
    trace_id = (roots[0] if roots else min(tagged, key=lambda s: s.start_ns)).trace_id
    return sorted((s for s in spans if s.trace_id == trace_id), key=lambda s: (s.start_ns, s.name))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(str, value[:6])) + (",…" if len(value) > 6 else "") + "]"
    return str(value)


def _attrs(span: SpanRecord, width: int) -> str:
    text = " ".join(f"{k}={_fmt(v)}" for k, v in span.attributes.items() if k not in _SKIP_ATTRS)
    return text if len(text) <= width else text[: width - 1] + "…"


def render_tree(spans: list[SpanRecord], *, attr_width: int = 160) -> str:
    """The trace as an indented tree, one span a line: offset ms, duration ms, name [service] attributes.

    A span whose parent is not among ``spans`` (not exported, or dropped) is shown as a root
    marked ``(orphan)``; spans linked from another trace (a shared prefill batch) are listed last.
    """
    if not spans:
        return "(no spans)"
    ids = {s.span_id for s in spans}
    children: dict[str | None, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        children[s.parent_id if s.parent_id in ids else None].append(s)
    t0 = min(s.start_ns for s in spans)
    total = (max(s.end_ns for s in spans) - t0) / 1e6
    root = next((s for s in spans if s.parent_id is None), spans[0])
    lines = [
        f"trace {root.trace_id}  request {root.attributes.get('request_id', '?')}  {len(spans)} spans  {total:.1f} ms",
        f"{'start ms':>9} {'dur ms':>9}  span",
    ]

    def walk(span: SpanRecord, prefix: str, last: bool, top: bool) -> None:
        branch = "" if top else ("└─ " if last else "├─ ")
        flag = " (orphan)" if top and span.parent_id is not None else ""
        err = " !ERROR" if span.status == "ERROR" else ""
        lines.append(
            f"{(span.start_ns - t0) / 1e6:>9.2f} {span.duration_ms:>9.2f}  {prefix}{branch}{span.name} "
            f"[{span.service}]{flag}{err}  {_attrs(span, attr_width)}".rstrip()
        )
        kids = sorted(children.get(span.span_id, []), key=lambda s: (s.start_ns, s.name))
        for i, kid in enumerate(kids):
            walk(kid, prefix + ("" if top else ("   " if last else "│  ")), i == len(kids) - 1, False)

    for top in sorted(children[None], key=lambda s: (s.parent_id is not None, s.start_ns)):
        walk(top, "", True, True)
    return "\n".join(lines)


def linked_spans(spans: list[SpanRecord], trace: list[SpanRecord]) -> list[SpanRecord]:
    """Spans of other traces that link to a span of ``trace`` (a batch shared with other requests)."""
    ids = {s.span_id for s in trace}
    mine = {s.trace_id for s in trace}
    return [s for s in spans if s.trace_id not in mine and ids.intersection(s.links)]
