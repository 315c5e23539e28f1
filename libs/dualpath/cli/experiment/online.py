"""``dualpath experiment online``: agents arrive as a Poisson process; the highest agents per
second (APS) each mode sustains within the SLO (TTFT <= 4 s, TPOT <= 50 ms by default).

For each mode a fresh testbed stack (modeled compute, emulated NICs) runs the load generator:
``--sweep`` searches the highest passing APS (ramp then bisection, every probe reported);
without it one run at ``--rate`` reports latency and SLO attainment. Writes result.json.
"""

from __future__ import annotations

import argparse
import json
import sys

from dualpath.cli.experiment.runner import add_cluster_arguments, prepare, run_mode

__all__ = ["main"]

PAPER = {"ds27b": "1.67x APS over Basic", "ds660b": "2.25x APS over Basic"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpath experiment online", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_arguments(p)
    p.add_argument("--dataset", default="32k")
    p.add_argument("--modes", default="basic,dualpath")
    p.add_argument("--rate", type=float, default=0.5, help="APS of a single run, or the sweep's starting rate")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run/probe")
    p.add_argument("--turns", type=int, default=8, help="turns per agent")
    p.add_argument("--agents", type=int, default=2000, help="agents available to arrive (upper bound)")
    p.add_argument("--sweep", action="store_true", help="find the highest APS meeting the SLO")
    p.add_argument("--sweep-probes", type=int, default=6)
    p.add_argument("--slo-ttft", type=float, default=4.0)
    p.add_argument("--slo-tpot", type=float, default=0.05)
    p.add_argument("--out", default="runs/online")
    p.add_argument("--json", action="store_true")
    return p


def _row(mode: str, report: dict) -> dict:
    run, sweep = report.get("run") or {}, report.get("sweep") or {}
    lat = run.get("latency_s", {})
    return {"mode": mode, "max_aps": sweep.get("max_aps"), "probes": sweep.get("points"),
            "attainment": (run.get("slo") or {}).get("attainment"), "met": (run.get("slo") or {}).get("met"),
            "ttft": lat.get("ttft"), "ttft_queue": lat.get("ttft_queue"), "ttft_exec": lat.get("ttft_exec"),
            "ttst": lat.get("ttst"), "tpot": lat.get("tpot"),
            "achieved_aps": (run.get("aps") or {}).get("achieved"), "status": report.get("status")}


def format_table(result: dict) -> str:
    lines = [f"online {result['target']} {result['topology']} {result['dataset']}: SLO TTFT <= {result['slo_ttft']}s, "
             f"TPOT <= {result['slo_tpot'] * 1000:.0f}ms",
             f"{'mode':<9} {'max APS':>8} {'attain':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'queue p50':>9} {'exec p50':>9} "
             f"{'TTST p50':>9} {'TPOT p50':>9}"]
    for r in result["modes"].values():
        g = lambda d, k: f"{d[k]:.3f}" if d and d.get(k) is not None else "-"  # noqa: E731
        aps = f"{r['max_aps']:.3f}" if r["max_aps"] else "-"
        att = f"{r['attainment']:.2f}" if r["attainment"] is not None else "-"
        lines.append(f"{r['mode']:<9} {aps:>8} {att:>7} {g(r['ttft'], 'p50'):>9} {g(r['ttft'], 'p99'):>9} "
                     f"{g(r['ttft_queue'], 'p50'):>9} {g(r['ttft_exec'], 'p50'):>9} {g(r['ttst'], 'p50'):>9} {g(r['tpot'], 'p50'):>9}")
    ratio = result.get("aps_ratio")
    lines.append(f"dualpath/basic max APS: {ratio:.2f}x" if ratio else "dualpath/basic max APS: - (needs --sweep)")
    lines.append(f"paper: {result['paper']}. TTFT = queueing (admission -> first prefill batch, incl. KV load wait) "
                 "+ execution (first batch -> first token), as the server reports it.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    extra = ["--slo-ttft", str(ns.slo_ttft), "--slo-tpot", str(ns.slo_tpot)]
    if ns.sweep:
        extra += ["--sweep", "--sweep-probes", str(ns.sweep_probes)]
    prepared = prepare(ns, "dualpath experiment online", online_rate=ns.rate, duration=ns.duration, extra_loadgen=tuple(extra))
    if prepared is None:
        return 2
    spec, modes = prepared
    out = spec.out
    say = (lambda msg: print(msg, file=sys.stderr, flush=True))
    rows = {m: _row(m, run_mode(spec, m, say=say).report) for m in modes}
    b, d = rows.get("basic", {}).get("max_aps"), rows.get("dualpath", {}).get("max_aps")
    result = {"target": ns.target, "topology": ns.topology, "dataset": ns.dataset, "slo_ttft": ns.slo_ttft, "slo_tpot": ns.slo_tpot,
              "modes": rows, "aps_ratio": (d / b) if b and d else None, "paper": PAPER.get(ns.target, "-")}
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result, indent=2, default=str) if ns.json else format_table(result))
    return 0
