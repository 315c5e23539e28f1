"""What tracing costs prefill: tracing on vs off in the same run, on one stack.

The stack's services export spans to a JSON-lines file with the standard sampler
``parentbased_traceidratio`` at 0.5, so each request is traced or not at random and both
kinds run interleaved on the same processes and the same machine load. Conversations are
token-id prompts of the same shape (``turns`` turns of ``turn_tokens`` new tokens each, the
earlier turns hits), run one request at a time. Figures:

- prefill time per request (the prefill engine's ``prefill_done`` log line: task arrival to
  hand-off, storage load included), traced vs untraced, compared turn by turn;
- the layer spans' own cost: the ``layer_trace_s`` of each ``prefill.batch`` span (building
  and ending its ``kv.fetch``/``kv.store`` spans) over the batches' durations.
A benchmark, not a test: it prints what it measured.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import httpx

from dualpath.telemetry.traceview import load_jsonl

__all__ = ["format_report", "measure"]


def _conversation(
    client: httpx.Client, model: str, rng: random.Random, *, turns: int, turn_tokens: int, max_tokens: int, vocab: int
) -> list[str]:
    """One conversation; returns its request ids in turn order."""
    prompt: list[int] = []
    rids = []
    for _ in range(turns):
        prompt = prompt + [rng.randrange(vocab) for _ in range(turn_tokens)]
        r = client.post(
            "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        )
        r.raise_for_status()
        rids.append(r.json()["id"])
    return rids


def _prefill_seconds(log: Path) -> dict[str, float]:
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if d.get("event") == "prefill_done":
            out[d["request_id"]] = float(d["seconds"])
    return out


def measure(
    *,
    model: str = "",
    conversations: int = 12,
    turns: int = 4,
    turn_tokens: int = 384,
    max_tokens: int = 8,
    run_dir: str = "",
    seed: int = 0,
) -> dict:
    """Run the conversations on a fresh 1P1D stack and return the figures (see the module docstring).

    Raises:
        StackError: the stack did not start.
        httpx.HTTPError: a request failed.
    """
    from dualpath.bus.embedded import free_port
    from dualpath.cli.launcher.stack import Stack, StackConfig
    from dualpath.cli.launcher.topology import parse_topology
    from dualpath.model import ModelConfig, make_tiny_model

    run = Path(run_dir or tempfile.mkdtemp(prefix="dualpath-trace-overhead-"))
    run.mkdir(parents=True, exist_ok=True)
    if not model:
        model = str(make_tiny_model(run / "tiny8", layers=8, hidden=64, heads=4, kv_heads=2, vocab=512, seed=0))
    vocab = ModelConfig.from_dir(model).vocab_size
    spans_file = run / "spans.jsonl"
    spans_file.unlink(missing_ok=True)
    env = {"DUALPATH_TRACE_FILE": str(spans_file), "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5"}
    cfg = StackConfig(
        model=model, topology=parse_topology("1P1D"), storage=str(run / "storage"), run_dir=str(run), port=free_port(), extra_env=env
    )
    rng = random.Random(seed)
    by_turn: list[list[str]] = [[] for _ in range(turns)]
    stack = Stack(cfg).start()
    try:
        with httpx.Client(base_url=stack.url, timeout=120) as client:
            name = client.get("/v1/models").json()["data"][0]["id"]
            _conversation(client, name, rng, turns=turns, turn_tokens=turn_tokens, max_tokens=max_tokens, vocab=vocab)  # warm-up
            for _ in range(conversations):
                for t, rid in enumerate(
                    _conversation(client, name, rng, turns=turns, turn_tokens=turn_tokens, max_tokens=max_tokens, vocab=vocab)
                ):
                    by_turn[t].append(rid)
    finally:
        stack.stop()
    return _figures(by_turn, _prefill_seconds(run / "logs" / "prefill-p0e0.log"), load_jsonl(spans_file), run)


def _figures(by_turn: list[list[str]], prefill_s: dict[str, float], spans, run: Path) -> dict:
    traced = {s.attributes.get("request_id") for s in spans if s.name == "request"}
    per_turn = []
    for t, rids in enumerate(by_turn):
        on = [prefill_s[r] for r in rids if r in prefill_s and r in traced]
        off = [prefill_s[r] for r in rids if r in prefill_s and r not in traced]
        if on and off:
            per_turn.append(
                {
                    "turn": t + 1,
                    "traced": len(on),
                    "untraced": len(off),
                    "median_on_ms": 1e3 * statistics.median(on),
                    "median_off_ms": 1e3 * statistics.median(off),
                    "overhead_pct": 100 * (statistics.median(on) / statistics.median(off) - 1),
                }
            )
    batches = [s for s in spans if s.name == "prefill.batch"]
    batch_s = sum(s.duration_ms for s in batches) / 1e3
    layer_s = sum(float(s.attributes.get("layer_trace_s", 0.0)) for s in batches)
    layer_spans = sum(int(s.attributes.get("layer_spans", 0)) for s in batches)
    counts: defaultdict[str, int] = defaultdict(int)
    for s in spans:
        counts[s.name] += 1
    return {
        "requests_traced": sum(1 for rids in by_turn for r in rids if r in traced),
        "requests_untraced": sum(1 for rids in by_turn for r in rids if r not in traced),
        "per_turn": per_turn,
        "prefill_overhead_pct": statistics.mean(p["overhead_pct"] for p in per_turn) if per_turn else None,
        "batches": len(batches),
        "layer_spans": layer_spans,
        "batch_s": batch_s,
        "layer_span_s": layer_s,
        "layer_span_pct": 100 * layer_s / batch_s if batch_s else None,
        "layer_span_us_each": 1e6 * layer_s / layer_spans if layer_spans else None,
        "spans": dict(counts),
        "run_dir": str(run),
    }


def format_report(r: dict) -> str:
    """The figures as a short table."""
    lines = [
        f"requests: {r['requests_traced']} traced, {r['requests_untraced']} untraced (same run, sampler ratio 0.5)",
        f"{'turn':>4} {'on':>4} {'off':>4} {'median on ms':>13} {'median off ms':>14} {'overhead':>9}",
    ]
    for p in r["per_turn"]:
        lines.append(
            f"{p['turn']:>4} {p['traced']:>4} {p['untraced']:>4} {p['median_on_ms']:>13.2f} {p['median_off_ms']:>14.2f} "
            f"{p['overhead_pct']:>8.1f}%"
        )
    if r["prefill_overhead_pct"] is not None:
        lines.append(f"prefill time, traced vs untraced (mean over turns of the median ratio): {r['prefill_overhead_pct']:+.1f}%")
    if r["layer_span_pct"] is not None:
        lines.append(
            f"layer spans: {r['layer_spans']} in {r['batches']} batches cost {1e3 * r['layer_span_s']:.2f} ms of "
            f"{1e3 * r['batch_s']:.1f} ms of traced prefill batches = {r['layer_span_pct']:.2f}% "
            f"({r['layer_span_us_each']:.1f} us per span)"
        )
    lines.append(f"spans and logs in {r['run_dir']}")
    return "\n".join(lines)
