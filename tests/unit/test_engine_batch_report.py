"""``dualpath trace batches``: prefill batch spans binned against the quota, and the quota check."""

from __future__ import annotations

import json

from dualpath.cli.trace import main as trace_main
from dualpath.telemetry.batches import batch_report
from dualpath.telemetry.traceview import SpanRecord


def batch_span(predicted: float, *, new: list[int], over: bool = False, chunked: bool = False, charged: float | None = None) -> SpanRecord:
    attrs = {
        "predicted_s": predicted,
        "quota_s": 0.3,
        "requests": len(new),
        "request_new_tokens": new,
        "over_quota": over,
        "chunked": chunked,
        "predicted_by": "cost_model",
        "request_ids": [f"r{i}" for i in range(len(new))],
    }
    if charged is not None:
        attrs["charged_s"] = charged
    return SpanRecord(
        trace_id="t", span_id="s", parent_id=None, name="prefill.batch", service="prefill-engine", start_ns=0, end_ns=1, attributes=attrs
    )


def test_batches_are_binned_by_their_share_of_the_quota_and_a_lone_block_may_exceed_it():
    spans = [
        batch_span(0.01, new=[64]),
        batch_span(0.299, new=[700, 128], chunked=True, charged=0.299),
        batch_span(0.3, new=[500]),
        batch_span(0.64, new=[64], over=True),
    ]
    r = batch_report(spans)
    counts = {row["bin"]: row["batches"] for row in r["histogram"]}
    assert counts["0-10%"] == 1 and counts["95-100%"] == 2 and counts[">100%"] == 1
    assert r["over_quota"] == 1 and r["violations"] == 0 and r["chunked"] == 1
    assert r["charged_batches"] == 1 and r["charged_vs_predicted_max_abs_s"] == 0.0


def test_a_batch_of_several_requests_over_the_quota_is_a_violation_and_the_command_exits_1(tmp_path, capsys):
    spans = [batch_span(0.31, new=[64, 64], over=False)]
    assert batch_report(spans)["violations"] == 1
    path = tmp_path / "spans.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(
                {"trace_id": s.trace_id, "span_id": s.span_id, "name": s.name, "start_ns": 0, "end_ns": 1, "attributes": s.attributes}
            )
            for s in spans
        )
        + "\n"
    )
    assert trace_main(["batches", "--file", str(path)]) == 1
    assert "violations: 1" in capsys.readouterr().out
    assert trace_main(["batches", "--file", str(tmp_path / "missing.jsonl")]) == 2
