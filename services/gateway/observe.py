"""``RequestTelemetry``: each request's root span and the gateway's latency metrics.

The gateway is where a request starts and ends, so it owns the request's root span
(``request``, attribute ``request_id``: ``dualpath trace show`` finds the trace by it) and
measures what the client sees: TTFT (arrival to first token) and TPOT (mean gap between the
following tokens), exported as histograms, plus prompt and cached tokens (the KV hit rate),
also logged once per request (``request_finished``). Counters carry the request's ``tenant``
(its API key's) as an attribute when it has one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode

from dualpath.protocol.messages import TokenEvent
from dualpath.telemetry.logs import get_logger
from dualpath.telemetry.metrics import SECONDS_BUCKETS, get_meter, observe
from dualpath.telemetry.tracing import get_tracer
from services.gateway.metrics_page import ClusterFigures

__all__ = ["RequestTelemetry"]

tracer = get_tracer("dualpath.gateway")
log = get_logger("gateway")
_READ_PATH_NAMES = {0: "auto", 1: "pe", 2: "de"}


@dataclass(slots=True, kw_only=True)
class _Live:
    span: trace.Span
    t_start_ns: int
    prompt_tokens: int
    tenant: str = ""
    t_first_ns: int = 0
    t_last_ns: int = 0
    tokens: int = 0
    outcome: dict = field(default_factory=dict)


class RequestTelemetry:
    """Root spans of live requests and the gateway's metrics (no-ops when both are off)."""

    def __init__(self) -> None:
        meter = get_meter("dualpath.gateway")
        self.ttft = meter.create_histogram(
            "dualpath.ttft",
            unit="s",
            description="time to first token, arrival at the gateway to first token",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        self.tpot = meter.create_histogram(
            "dualpath.tpot",
            unit="s",
            description="time per output token after the first (mean per request)",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        self.finished = meter.create_counter("dualpath.requests", description="requests answered, by finish reason")
        self.figures = ClusterFigures()  # what GET /metrics on the API port shows (and the OTel counters read)
        self._live: dict[str, _Live] = {}
        figures = self.figures
        observe("dualpath.gateway.in_flight", "requests admitted and not yet answered", lambda: [(len(self._live), {})])
        observe("dualpath.prompt_tokens", "prompt tokens of answered requests", lambda: _by_tenant(figures.prompt_tokens), kind="counter")
        observe(
            "dualpath.cached_tokens",
            "prompt tokens whose KV was read from storage",
            lambda: _by_tenant(figures.cached_tokens),
            kind="counter",
        )
        observe("dualpath.kv.hit_rate", "cached / prompt tokens over all answered requests", self._hit_rate, unit="1")

    def _hit_rate(self):
        prompt, cached = sum(self.figures.prompt_tokens.values()), sum(self.figures.cached_tokens.values())
        return [(cached / prompt if prompt else 0.0, {})]

    def start(
        self, rid: str, *, prompt_tokens: int, read_path: int, stream: bool, t_start_ns: int, t_tokenized_ns: int, tenant: str = ""
    ) -> trace.Span:
        """Open the request's root span (a new trace) at its arrival; the tokenization is its first child."""
        t_start_ns = t_start_ns or time.time_ns()
        span = tracer.start_span("request", context=Context(), start_time=t_start_ns)
        if span.is_recording():
            span.set_attributes(
                {
                    "request_id": rid,
                    "prompt_tokens": prompt_tokens,
                    "stream": stream,
                    "dualpath.read_path.requested": _READ_PATH_NAMES.get(int(read_path), str(read_path)),
                }
            )
            tok = tracer.start_span(
                "gateway.tokenize",
                context=trace.set_span_in_context(span),
                start_time=t_start_ns,
                attributes={"prompt_tokens": prompt_tokens},
            )
            tok.end(end_time=t_tokenized_ns or t_start_ns)
        self._live[rid] = _Live(span=span, t_start_ns=t_start_ns, prompt_tokens=prompt_tokens, tenant=tenant)
        return span

    def on_event(self, rid: str, ev: TokenEvent) -> None:
        """Account one token event: first-token time, token count, the final outcome."""
        live = self._live.get(rid)
        if live is None:
            return
        if ev.token_ids:
            now = time.time_ns()
            if not live.t_first_ns:
                live.t_first_ns = now
            live.t_last_ns = now
            live.tokens += len(ev.token_ids)
        if ev.finish_reason is not None:
            self.outcome(rid, ev.finish_reason, info=ev.info, cached_tokens=ev.cached_tokens, error=ev.error)

    def outcome(self, rid: str, finish_reason: str, *, info: dict | None = None, cached_tokens: int = 0, error: str = "") -> None:
        """Record how the request ended (the span closes in ``end``)."""
        live = self._live.get(rid)
        if live is not None and not live.outcome:
            live.outcome = {"finish_reason": finish_reason, "info": info or {}, "cached_tokens": cached_tokens, "error": error}

    def end(self, rid: str) -> None:
        """Close the request: latency histograms, token counters, root span attributes and end."""
        live = self._live.pop(rid, None)
        if live is None:
            return
        out = live.outcome or {"finish_reason": "abandoned", "info": {}, "cached_tokens": 0, "error": ""}
        reason = out["finish_reason"]
        # one line per answered request: what a client's usage figures say, from the gateway's side
        log.info(
            "request_finished",
            request_id=rid,
            finish_reason=reason,
            prompt_tokens=live.prompt_tokens,
            cached_tokens=out["cached_tokens"],
            tenant=live.tenant,
        )
        attrs = {"finish_reason": reason, "completion_tokens": live.tokens}
        if live.t_first_ns:
            ttft = (live.t_first_ns - live.t_start_ns) / 1e9
            self.ttft.record(ttft)
            self.figures.ttft.observe(ttft)
            attrs["ttft_s"] = ttft
        if live.tokens > 1:
            tpot = (live.t_last_ns - live.t_first_ns) / 1e9 / (live.tokens - 1)
            self.tpot.record(tpot)
            self.figures.tpot.observe(tpot)
            attrs["tpot_s"] = tpot
        self.finished.add(1, {"finish_reason": reason, **({"tenant": live.tenant} if live.tenant else {})})
        self.figures.requests[(out["info"].get("read_path") or "none", reason, live.tenant)] += 1
        if reason != "error":
            self.figures.prompt_tokens[live.tenant] += live.prompt_tokens
            self.figures.cached_tokens[live.tenant] += out["cached_tokens"]
        span = live.span
        if span.is_recording():
            info = out["info"]
            attrs.update(
                {
                    "cached_tokens": out["cached_tokens"],
                    "dualpath.read_path": info.get("read_path", ""),
                    "prefill_engine": info.get("prefill_engine", ""),
                    "decode_engine": info.get("decode_engine", ""),
                }
            )
            span.set_attributes(attrs)
            if reason == "error":
                span.set_status(Status(StatusCode.ERROR, out["error"] or "request failed"))
        span.end()


def _by_tenant(counts) -> list[tuple[int, dict[str, str]]]:
    """OTel observations of a per-tenant counter: one per tenant, attributed when it has a name."""
    return [(n, {"tenant": t} if t else {}) for t, n in counts.items()] or [(0, {})]
