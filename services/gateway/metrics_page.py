"""``GET /metrics`` on the API port: the cluster-level figures a user looks for first, in
Prometheus text format, whether or not the OpenTelemetry exporter (per-service metrics on
``--metrics-port``) is on.

- ``dualpath_ttft_seconds`` / ``dualpath_tpot_seconds``: histograms as the clients saw them
  (arrival at the gateway to first token; mean gap between later tokens);
- ``dualpath_prompt_tokens_total{tenant}``, ``dualpath_cached_tokens_total{tenant}`` and
  ``dualpath_cached_token_ratio`` (the KV hit rate over answered requests, all tenants);
- ``dualpath_requests_total{read_path, finish_reason, tenant}``: answered requests by the read
  path the scheduler chose (``pe``/``de``, ``none`` when no blocks were read);
- ``dualpath_rate_limited_total{tenant, limit}``: requests refused with 429 by a tenant's limit;
- from the scheduler's state: ``dualpath_queue_length``, ``dualpath_running_requests``,
  ``dualpath_engines{role}``, ``dualpath_buffer_waits_total``, and ``dualpath_scheduler_up``.

``tenant`` is the API key's tenant; an open gateway (no keys) has none, and its series carry no
``tenant`` label (in Prometheus an empty label is no label).
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from dualpath.telemetry.metrics import SECONDS_BUCKETS

__all__ = ["ClusterFigures", "Histogram", "render_metrics"]


@dataclass(slots=True)
class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics: ``le`` upper bounds, plus +Inf)."""

    bounds: tuple[float, ...] = SECONDS_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, count in zip(self.bounds, self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{bound:g}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total:.9g}", f"{name}_count {self.n}"]
        return out


@dataclass(slots=True)
class ClusterFigures:
    """What the gateway measured over the requests it answered."""

    ttft: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    requests: Counter = field(default_factory=Counter)  # (read_path, finish_reason, tenant) -> count
    prompt_tokens: Counter = field(default_factory=Counter)  # tenant -> prompt tokens of answered requests
    cached_tokens: Counter = field(default_factory=Counter)  # tenant -> of those, read from storage
    limited: Counter = field(default_factory=Counter)  # (tenant, limit) -> requests refused with 429


def _esc(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    """``{a="x",b="y"}`` of the labels that have a value ("" when none has)."""
    inner = ",".join(f'{name}="{_esc(value)}"' for name, value in labels.items() if value)
    return f"{{{inner}}}" if inner else ""


def _per_tenant(name: str, help_text: str, by_tenant: Counter) -> list[str]:
    """A counter with one sample per tenant (one unlabelled sample on an open gateway)."""
    samples = sorted(by_tenant.items()) or [("", 0)]
    return [f"# HELP {name} {help_text}", f"# TYPE {name} counter", *(f"{name}{_labels(tenant=t)} {n}" for t, n in samples)]


def render_metrics(figures: ClusterFigures, state) -> str:
    """The page; ``state`` is the scheduler's ``StateReply`` or ``None`` when it did not answer."""
    lines = figures.ttft.lines("dualpath_ttft_seconds", "time to first token, arrival at the gateway to first token")
    lines += figures.tpot.lines("dualpath_tpot_seconds", "time per output token after the first (mean per request)")
    prompt, cached = sum(figures.prompt_tokens.values()), sum(figures.cached_tokens.values())
    ratio = cached / prompt if prompt else 0.0
    lines += _per_tenant("dualpath_prompt_tokens_total", "prompt tokens of answered requests", figures.prompt_tokens)
    lines += _per_tenant("dualpath_cached_tokens_total", "prompt tokens whose KV was read from storage", figures.cached_tokens)
    lines += [
        "# HELP dualpath_cached_token_ratio cached / prompt tokens over all answered requests",
        "# TYPE dualpath_cached_token_ratio gauge",
        f"dualpath_cached_token_ratio {ratio:.6g}",
        "# HELP dualpath_requests_total answered requests by read path and finish reason",
        "# TYPE dualpath_requests_total counter",
    ]
    for (path, reason, tenant), count in sorted(figures.requests.items()):
        lines.append(f"dualpath_requests_total{_labels(read_path=path, finish_reason=reason, tenant=tenant)} {count}")
    lines += [
        "# HELP dualpath_rate_limited_total requests refused with 429 by a tenant's limit",
        "# TYPE dualpath_rate_limited_total counter",
    ]
    for (tenant, limit), count in sorted(figures.limited.items()):
        lines.append(f"dualpath_rate_limited_total{_labels(tenant=tenant, limit=limit)} {count}")
    lines += [
        "# HELP dualpath_scheduler_up 1 when the scheduler answered this scrape",
        "# TYPE dualpath_scheduler_up gauge",
        f"dualpath_scheduler_up {0 if state is None else 1}",
    ]
    if state is not None:
        lines += [
            "# HELP dualpath_queue_length requests waiting in the scheduler's queue",
            "# TYPE dualpath_queue_length gauge",
            f"dualpath_queue_length {state.queued}",
            "# HELP dualpath_running_requests requests dispatched to engines and not finished",
            "# TYPE dualpath_running_requests gauge",
            f"dualpath_running_requests {state.running}",
            "# HELP dualpath_engines engines reporting to the scheduler",
            "# TYPE dualpath_engines gauge",
            f'dualpath_engines{{role="prefill"}} {state.prefill_engines}',
            f'dualpath_engines{{role="decode"}} {state.decode_engines}',
            "# HELP dualpath_buffer_waits_total dispatches put back because a node buffer was full",
            "# TYPE dualpath_buffer_waits_total counter",
            f"dualpath_buffer_waits_total {state.buffer_waits}",
        ]
    return "\n".join(lines) + "\n"
