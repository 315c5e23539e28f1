"""``dualpath experiment online``: agents arrive as a Poisson process; the highest agents per
second (APS) each mode sustains within the SLO (TTFT <= 4 s, TPOT <= 50 ms by default).

The paper's regime: agents are met deep into long trajectories (``--start-at``, as offline),
their earlier turns' KV already in storage (one untimed warm-up turn per agent, on a
fast-forwarded stack, shared by every probe), so each turn mostly loads cached KV and storage
bandwidth decides how many agents per second fit. The run is in slow motion (``--slowdown``:
arrival rates, durations and the SLO are scaled to host time and reported back in modeled
time), so the host's own cost is a small share of every latency.

``--untimed-turns N`` (default 1 with ``--prefetch``, else 0) runs each agent's first N turns
on the measured stack untimed: its first timed turn then follows a turn and a tool gap this
stack served, as every turn but the first does in a 60-157-turn rollout. Agent-aware
prefetch needs it: a copy is staged when the previous turn ends, and the warm-up ran on
another stack, so without a lead-in every agent's first timed turn reads from storage.
Every mode of the run gets the same lead-in.

``--sweep`` searches the highest passing APS per mode (ramp, then geometric bisection; every
probe is a fresh stack on a copy of the warmed storage, running the same agents) and prints
the dualpath/basic ratio next to the paper's (the modes' probes alternate, so a shared host's
changing load falls on both alike), with the TTFT split into queueing (admission ->
first prefill batch, KV load wait included) and execution at each mode's best rate. Without
it, one run at ``--rate``. Writes result.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any, cast

from dualpath.cli.experiment.plots import plot_online
from dualpath.cli.experiment.runner import (
    TestbedSpec,
    add_cluster_arguments,
    prepare,
    run_mode,
)

__all__ = ["main"]

PAPER = {"ds27b": 1.67, "ds660b": 2.25}  # max APS within SLO, dualpath over basic


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dualpath experiment online", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_cluster_arguments(p)
    p.set_defaults(engines_per_node=1)  # one engine per node: the SNIC shrinks to that GPU's share of it
    p.add_argument("--dataset", default="64k", help="32k, 48k, 64k or a trajectory JSONL file")
    p.add_argument("--modes", default="basic,dualpath")
    p.add_argument("--rate", type=float, default=1.0, help="APS (modeled) of a single run, or the sweep's starting rate")
    p.add_argument("--duration", type=float, default=40.0, help="modeled seconds of arrivals per run/probe")
    p.add_argument("--turns", type=int, default=3, help="timed turns per agent (after its warm-up turn)")
    p.add_argument(
        "--untimed-turns",
        type=int,
        default=None,
        help="lead-in turns per agent on the measured stack before its timed ones (default: 1 with --prefetch, else 0): "
        "a timed turn then always follows a turn, and a tool gap, that this stack served, as in a long rollout",
    )
    p.add_argument("--agents", type=int, default=0, help="agents that may arrive (0: enough for twice the start rate)")
    p.add_argument(
        "--start-at", type=float, default=0.5, help="meet every agent this far through its trajectory (0.5: the set's average context)"
    )
    p.add_argument(
        "--slowdown",
        type=float,
        default=4.0,
        help="slow motion: modeled times x, NIC rates /, rates and SLO scaled (4: the host's own cost a small share of TTFT on 2 cores)",
    )
    p.add_argument(
        "--tool-gap", type=float, default=0.0, help="modeled mean seconds an agent runs a tool between turns (exponential; 0: back to back)"
    )
    p.add_argument("--sweep", action="store_true", help="find the highest APS meeting the SLO")
    p.add_argument("--sweep-probes", type=int, default=5)
    p.add_argument("--sweep-tolerance", type=float, default=0.15)
    p.add_argument("--slo-ttft", type=float, default=4.0)
    p.add_argument("--slo-tpot", type=float, default=0.05)
    p.add_argument("--out", default="runs/online")
    p.add_argument("--json", action="store_true")
    return p


def _lat(d: dict | None, key: str, k: float) -> float | None:
    return d[key] / k if d and d.get(key) is not None else None


def _point(mode: str, rate: float, report: dict, k: float) -> dict:
    """One run's figures in modeled time (host figures divided by the slowdown ``k``)."""
    run = report.get("run") or {}
    lat = run.get("latency_s", {})
    errors = sum(n for kind, n in (run.get("turns") or {}).get("errors", {}).items() if kind != "cancelled")
    slo = run.get("slo") or {}
    ttft, queue = lat.get("ttft"), lat.get("ttft_queue")
    share = queue["mean"] / ttft["mean"] if ttft and queue and ttft.get("mean") else None
    return {
        "mode": mode,
        "rate": rate,
        "attainment": slo.get("attainment"),
        "met": slo.get("met"),
        "failed_turns": errors,
        "passed": errors == 0 and bool(slo.get("met")),
        "turns": (run.get("turns") or {}).get("completed"),
        "hit_rate": (run.get("cache") or {}).get("hit_rate"),
        "ttft_p50": _lat(ttft, "p50", k),
        "ttft_p99": _lat(ttft, "p99", k),
        "ttft_queue_p50": _lat(queue, "p50", k),
        "ttft_exec_p50": _lat(lat.get("ttft_exec"), "p50", k),
        "ttft_queue_share": share,
        "ttst_p50": _lat(lat.get("ttst"), "p50", k),
        "tpot_p50": _lat(lat.get("tpot"), "p50", k),
    }


def _next_rate(points: list[dict], start: float, probes: int, tolerance: float) -> float | None:
    """Double after a pass, halve after a failure, then bisect geometrically (loadgen's search)."""
    if len(points) >= probes or any(p["failed_turns"] for p in points):
        return None
    passed = [p["rate"] for p in points if p["passed"]]
    failed = [p["rate"] for p in points if not p["passed"]]
    lo, hi = (max(passed) if passed else None), (min(failed) if failed else None)
    if lo is None and hi is None:
        return start
    if lo is None:
        assert hi is not None  # both None returned above
        return hi / 2
    if hi is None:
        return lo * 2
    return None if hi / lo - 1 <= tolerance else math.sqrt(lo * hi)


def _probe(spec: TestbedSpec, mode: str, rate: float, index: int, k: float, say) -> dict:
    probe_spec = dataclasses.replace(spec, online_rate=rate / k, out=spec.out / f"{mode}-{index}", warm_dir=spec.out)
    say(f"[{mode}] probe {index}: {rate:g} APS (modeled)")
    r = run_mode(probe_spec, mode, say=say)
    point = _point(mode, rate, r.report, k)
    cpu = r.extra.get("cpu_s") or {}
    point["host_cores_busy"] = sum(cpu.values()) / r.wall_s if r.wall_s else None  # the stack's and loadgen's CPU
    point["prefetch"] = prefetch_stats(probe_spec.out / mode / "run" / "logs")
    point["loadavg"] = r.extra.get("loadavg")
    say(
        f"[{mode}] {rate:g} APS: {'pass' if point['passed'] else 'fail'} (attainment {point['attainment']}, "
        f"TTFT p50 {point['ttft_p50']}, hit {point['hit_rate']})"
    )
    return point


def prefetch_stats(logs: Path) -> dict | None:
    """The traffic managers' last ``prefetch_stats`` lines, summed over nodes (None: prefetch off)."""
    total: dict[str, float] = {}
    for path in sorted(logs.glob("*.log")) if logs.is_dir() else ():
        last = None
        for line in path.read_text(errors="replace").splitlines():
            if '"prefetch_stats"' in line:
                last = line
        if last is not None:
            for key, value in json.loads(last).items():
                if key.startswith("prefetch_") and isinstance(value, (int, float)):
                    total[key] = total.get(key, 0) + value
    if not total:
        return None
    kept = total.get("prefetch_staged_bytes", 0) + total.get("prefetch_retained_bytes", 0)  # read while idle, or kept
    total["prefetch_used_fraction"] = total.get("prefetch_used_bytes", 0) / kept if kept else 0.0
    return total


def format_table(result: dict) -> str:
    lines = [
        (
            f"online {result['target']} {result['topology']} {result['dataset']} (start-at {result['start_at']}): "
            f"SLO TTFT <= {result['slo_ttft']}s, TPOT <= {result['slo_tpot'] * 1000:.0f}ms; modeled seconds; "
            f"{result['turns']} timed turns per agent"
            + (f" after {result['untimed_turns']} untimed" if result.get("untimed_turns") else "")
        ),
        (
            f"{'mode':<9} {'max APS':>8} {'attain':>7} {'hit %':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'queue p50':>9} "
            f"{'exec p50':>9} {'queue %':>8} {'TTST p50':>9} {'TPOT p50':>9}"
        ),
    ]
    for r in result["modes"].values():
        b = r["best"] or {}
        g = lambda key, b=b: f"{b[key]:.3f}" if b.get(key) is not None else "-"
        aps = f"{r['max_aps']:.3f}" if r["max_aps"] else "-"
        att = f"{b['attainment']:.2f}" if b.get("attainment") is not None else "-"
        hit = f"{100 * b['hit_rate']:.1f}" if b.get("hit_rate") is not None else "-"
        share = f"{100 * b['ttft_queue_share']:.0f}%" if b.get("ttft_queue_share") is not None else "-"
        lines.append(
            f"{r['mode']:<9} {aps:>8} {att:>7} {hit:>6} {g('ttft_p50'):>9} {g('ttft_p99'):>9} {g('ttft_queue_p50'):>9} "
            f"{g('ttft_exec_p50'):>9} {share:>8} {g('ttst_p50'):>9} {g('tpot_p50'):>9}"
        )
        for p in r["probes"]:
            f = lambda v: f"{v:.2f}" if isinstance(v, (int, float)) else "-"
            load = " ".join(f"{x:.1f}" for x in p.get("loadavg") or ())
            lines.append(
                f"    probe {p['rate']:.3f} APS: {'pass' if p['passed'] else 'fail'}  attainment {f(p['attainment'])}  "
                f"TTFT p50 {f(p['ttft_p50'])} p99 {f(p['ttft_p99'])}  queue share {f(p['ttft_queue_share'])}  hit {f(p['hit_rate'])}  "
                f"host cores busy {f(p.get('host_cores_busy'))}  load {load}"
            )
            pf = p.get("prefetch")
            if pf:
                lines.append(
                    f"      prefetch: staged {pf.get('prefetch_staged_bytes', 0) / 2**20:.1f} MiB from storage, retained "
                    f"{pf.get('prefetch_retained_bytes', 0) / 2**20:.1f} MiB of reads, used {f(pf['prefetch_used_fraction'])} of both, "
                    f"peak prefetch cache {pf.get('prefetch_peak_bytes', 0) / 2**20:.1f} MiB (all nodes), "
                    f"evictions {pf.get('prefetch_evictions', 0):.0f}, hints {pf.get('prefetch_hints', 0):.0f}"
                )
    ratio, paper = result.get("aps_ratio"), result.get("paper")
    lines.append(
        (f"dualpath/basic max APS: {ratio:.2f}x" if ratio else "dualpath/basic max APS: - (needs --sweep and both modes)")
        + (f"  (paper: {paper:.2f}x)" if paper else "")
    )
    lines.append(
        "TTFT = queueing (admission -> first prefill batch, incl. KV load wait) + execution (first batch -> first "
        "token), as the server reports it; queue % = mean queueing / mean TTFT at the mode's best rate"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if not ns.slowdown > 0 or not 0 <= ns.start_at < 1 or not ns.rate > 0 or not ns.duration > 0:
        print("dualpath experiment online: --slowdown, --rate and --duration must be positive, --start-at in [0, 1)", file=sys.stderr)
        return 2
    k = ns.slowdown
    if ns.untimed_turns is None:
        ns.untimed_turns = 1 if getattr(ns, "prefetch", False) or "prefetch" in ns.modes.split(",") else 0
    if ns.untimed_turns < 0 or ns.turns < 1:
        print("dualpath experiment online: --untimed-turns must be >= 0 and --turns >= 1", file=sys.stderr)
        return 2
    if not ns.agents:
        ns.agents = max(8, math.ceil(2 * ns.rate * ns.duration * (2 if ns.sweep else 1)))
    extra = (
        "--slo-ttft",
        str(ns.slo_ttft * k),
        "--slo-tpot",
        str(ns.slo_tpot * k),
        "--start-at",
        str(ns.start_at),
        "--tool-gap",
        str(max(ns.tool_gap, 0.0) * k),
    )
    prepared = prepare(
        ns,
        "dualpath experiment online",
        online_rate=ns.rate / k,
        duration=ns.duration * k,
        slowdown=k,
        warmup_turns=1,
        untimed_turns=ns.untimed_turns,
        stream_interval=1,
        extra_loadgen=extra,
    )
    if prepared is None:
        return 2
    spec, modes = prepared
    say = lambda msg: print(msg, file=sys.stderr, flush=True)
    rows: dict[str, dict[str, Any]] = {}
    # The modes' probes alternate (basic, dualpath, basic, ...), so a shared host's changing load
    # falls on every mode alike instead of on whichever ran last.
    probes: dict[str, list[dict]] = {mode: [] for mode in modes}
    active = list(modes)
    while active:
        for mode in list(active):
            rate = _next_rate(probes[mode], ns.rate, ns.sweep_probes if ns.sweep else 1, ns.sweep_tolerance)
            if rate is None:
                active.remove(mode)
                continue
            probes[mode].append(_probe(spec, mode, rate, len(probes[mode]), k, say))
    for mode, points in probes.items():
        passed = [p for p in points if p["passed"]]
        best = max(passed, key=lambda p: p["rate"]) if passed else (points[-1] if points else None)
        rows[mode] = {"mode": mode, "max_aps": cast(dict, best)["rate"] if passed and ns.sweep else None, "best": best, "probes": points}
    b, d = rows.get("basic", {}).get("max_aps"), rows.get("dualpath", {}).get("max_aps")
    result = {
        "target": ns.target,
        "topology": ns.topology,
        "dataset": ns.dataset,
        "start_at": ns.start_at,
        "turns": ns.turns,
        "untimed_turns": ns.untimed_turns,
        "agents": ns.agents,
        "duration_s": ns.duration,
        "slowdown": k,
        "slo_ttft": ns.slo_ttft,
        "slo_tpot": ns.slo_tpot,
        "modes": rows,
        "aps_ratio": (d / b) if b and d else None,
        "paper": PAPER.get(ns.target),
    }
    (spec.out / "result.json").write_text(json.dumps(result, indent=2, default=str))
    title = f"online {ns.target} {ns.topology} {ns.dataset}, start-at {ns.start_at}, slowdown {k:g}"
    plot_online(rows, spec.out / "online.png", slo_ttft=ns.slo_ttft, title=title)
    say(f"wrote {spec.out / 'result.json'}, {spec.out / 'online.png'}")
    print(json.dumps(result, indent=2, default=str) if ns.json else format_table(result))
    return 0
