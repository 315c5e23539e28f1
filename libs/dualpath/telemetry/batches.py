"""Prefill batches against the compute quota, from ``prefill.batch`` spans.

Each ``prefill.batch`` span carries the batcher's ``predicted_s``, ``quota_s``, ``chunked``,
``over_quota`` and the requests' ``request_new_tokens`` (see ``services.prefill_engine``).
``batch_report`` bins predicted times as a share of the quota and checks the paper's rule:
no batch is predicted over the quota unless it is one minimal chunk alone (one block, or a
prompt's shorter remainder). On the modeled backend it also compares the prediction with
``charged_s``, what the backend charged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dualpath.telemetry.traceview import SpanRecord

__all__ = ["BINS", "batch_report", "render_batch_report"]

BINS: tuple[tuple[float, float, str], ...] = (
    (0.0, 0.10, "0-10%"),
    (0.10, 0.25, "10-25%"),
    (0.25, 0.50, "25-50%"),
    (0.50, 0.75, "50-75%"),
    (0.75, 0.90, "75-90%"),
    (0.90, 0.95, "90-95%"),
    (0.95, 1.0, "95-100%"),
    (1.0, float("inf"), ">100%"),
)


def _bin(share: float) -> int:
    for i, (lo, hi, _) in enumerate(BINS):
        if lo <= share < hi or (hi == 1.0 and share == 1.0):
            return i
    return len(BINS) - 1


def batch_report(spans: Iterable[SpanRecord], *, block_tokens: int = 64) -> dict[str, Any]:
    """Histogram of predicted batch time / quota, the quota check and prediction vs charge."""
    attrs = [s.attributes for s in spans if s.name == "prefill.batch" and "predicted_s" in s.attributes and "quota_s" in s.attributes]
    rows: list[dict[str, Any]] = [{"bin": label, "batches": 0, "chunked": 0, "requests": 0} for _, _, label in BINS]
    violations = []
    for a in attrs:
        row = rows[_bin(a["predicted_s"] / a["quota_s"])]
        row["batches"] += 1
        row["chunked"] += bool(a.get("chunked"))
        row["requests"] += int(a.get("requests", 0))
        minimal = a.get("requests") == 1 and bool(a.get("over_quota")) and list(a.get("request_new_tokens") or [0])[0] <= block_tokens
        if a["predicted_s"] > a["quota_s"] and not minimal:
            violations.append(a.get("request_ids"))
    charged = [(a["predicted_s"], a["charged_s"]) for a in attrs if "charged_s" in a]
    predicted = sorted(a["predicted_s"] for a in attrs)
    return {
        "batches": len(attrs),
        "quota_s": sorted({a["quota_s"] for a in attrs}),
        "predicted_by": sorted({str(a.get("predicted_by", "")) for a in attrs}),
        "histogram": rows,
        "over_quota": sum(a["predicted_s"] > a["quota_s"] for a in attrs),
        "violations": len(violations),
        "chunked": sum(bool(a.get("chunked")) for a in attrs),
        "predicted_s": {"min": predicted[0], "median": predicted[len(predicted) // 2], "max": predicted[-1]} if predicted else {},
        "charged_vs_predicted_max_abs_s": max((abs(p - c) for p, c in charged), default=None),
        "charged_batches": len(charged),
    }


def render_batch_report(r: dict[str, Any]) -> str:
    """The report as a text table."""
    lines = [
        f"prefill batches: {r['batches']}  quota_s: {r['quota_s']}  predicted_by: {', '.join(r['predicted_by'])}",
        "predicted/quota  batches  chunked  mean requests",
    ]
    top = max((row["batches"] for row in r["histogram"]), default=0) or 1
    for row in r["histogram"]:
        mean = row["requests"] / row["batches"] if row["batches"] else 0.0
        lines.append(f"{row['bin']:>15}  {row['batches']:7d}  {row['chunked']:7d}  {mean:13.1f}  {'#' * round(40 * row['batches'] / top)}")
    lines.append(f"over the quota: {r['over_quota']} (allowed: a lone minimal chunk); violations: {r['violations']}")
    if r["predicted_s"]:
        p = r["predicted_s"]
        lines.append(f"predicted_s: min {1e3 * p['min']:.2f} ms, median {1e3 * p['median']:.2f} ms, max {1e3 * p['max']:.2f} ms")
    if r["charged_batches"]:
        diff = r["charged_vs_predicted_max_abs_s"]
        lines.append(f"charged vs predicted ({r['charged_batches']} modeled batches): max |diff| {diff:.3g} s")
    return "\n".join(lines)
