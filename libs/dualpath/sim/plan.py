"""``dualpath sim plan``: the P/D split and read policy for a GPU budget (beyond the paper).

For ``--gpus N`` (``N // gpus_per_node`` nodes) it simulates every split into P prefill and D
decode nodes with each read policy (``dualpath``: both paths; ``basic``: prefill side only)
and ranks them by JCT (offline) or by the highest APS within the SLO (``--online``). It prints
the frontier and checks the best ratio against the paper's no-bottleneck range for
``g`` GPUs per node and ``s`` = SNIC/CNIC bandwidth ratio (§4.2): ``s/(g-s) <= P/D <=
min((g-2s)/s, (g-s)/(2s))`` — ``1/7 <= P/D <= 7/2`` for g = 8, s = 1.

Phases: a rollout's prefill pressure changes over time (early turns have short contexts and
many misses; late turns long, almost fully cached contexts). With ``--phases`` the agents'
first half of turns (from the start, cold) and second half (met mid-trajectory, warm
storage) are simulated separately for every split; when the best split of a phase differs
from the best static one, the report says which and by how much the phase's JCT would drop.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace

from dualpath.cost import CostModelError, cost_model, get_target
from dualpath.sim.config import SimConfig
from dualpath.sim.experiments import run_offline, sweep_online
from dualpath.sim.workload import Workload

__all__ = ["main", "no_bottleneck_range"]


def no_bottleneck_range(g: int, s: float) -> tuple[float, float]:
    """The paper's P/D range for ``g`` GPUs per node and SNIC = ``s`` x CNIC (§4.2)."""
    return s / (g - s), min((g - 2 * s) / s, (g - s) / (2 * s))


def _splits(nodes: int) -> list[tuple[int, int]]:
    return [(p, nodes - p) for p in range(1, nodes)]


def _offline_jct(cfg: SimConfig, workload: Workload) -> float:
    return run_offline(cfg, workload, [cfg.mode], progress=False)["modes"][cfg.mode]["jct_s"]


def evaluate(
    base: SimConfig, workload: Workload, nodes: int, *, online: bool, slo: tuple[float, float], probes: int, say: Callable[[str], None]
) -> list[dict]:
    """One row per (split, policy): JCT (offline) or max APS (online)."""
    rows = []
    for p, d in _splits(nodes):
        for mode in ("dualpath", "basic"):
            cfg = replace(base, prefill_nodes=p, decode_nodes=d, mode=mode)
            row = {"prefill_nodes": p, "decode_nodes": d, "p_over_d": p / d, "policy": mode}
            try:
                cost_model(
                    cfg.target, cfg.gpu, ep=cfg.decode_ep_size(get_target(cfg.target).default_ep, get_target(cfg.target).routed_experts)
                ).hbm_kv_capacity_tokens()
            except CostModelError as exc:  # e.g. the weights do not fit this many decode GPUs
                row["infeasible"] = str(exc)
                say(f"{p}P{d}D {mode}: infeasible ({exc})")
                rows.append(row)
                continue
            if online:
                w = replace(workload, rate=0.2 * p, duration_s=workload.duration_s or 300.0)
                row["max_aps"] = sweep_online(cfg, w, slo_ttft=slo[0], slo_tpot=slo[1], start_rate=0.2 * p, probes=probes)["max_aps"]
            else:
                row["jct_s"] = _offline_jct(cfg, workload)
            say(f"{p}P{d}D {mode}: " + (f"max APS {row.get('max_aps')}" if online else f"JCT {row['jct_s']:.1f} s"))
            rows.append(row)
    return rows


def _best(rows: list[dict], online: bool) -> dict:
    rows = [r for r in rows if "infeasible" not in r]
    if online:
        return max(rows, key=lambda r: r.get("max_aps") or 0.0)
    return min(rows, key=lambda r: r["jct_s"])


def _phases(base: SimConfig, workload: Workload, nodes: int, static: dict, say) -> list[dict]:
    out = []
    turns = workload.turns or 8
    half = max(1, turns // 2)
    for name, w in (
        ("early (first turns, cold storage)", replace(workload, turns=half, start_at=0.0)),
        ("late (mid-trajectory, warm storage)", replace(workload, turns=half, start_at=0.5)),
    ):
        jct = {}
        for p, d in _splits(nodes):
            try:
                jct[(p, d)] = _offline_jct(replace(base, prefill_nodes=p, decode_nodes=d, mode=static["policy"]), w)
            except CostModelError:
                continue
        best = min(jct, key=jct.__getitem__)
        mine = jct[(static["prefill_nodes"], static["decode_nodes"])]
        out.append(
            {
                "phase": name,
                "best": f"{best[0]}P{best[1]}D",
                "best_jct_s": jct[best],
                "static": f"{static['prefill_nodes']}P{static['decode_nodes']}D",
                "static_jct_s": mine,
                "gain": 1 - jct[best] / mine,
            }
        )
        say(f"phase {name}: best {best[0]}P{best[1]}D {jct[best]:.1f} s vs static {mine:.1f} s")
    return out


def main(argv: list[str], add_cluster_arguments, make_config, make_workload) -> int:
    p = argparse.ArgumentParser(prog="dualpath sim plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_arguments(p)
    p.set_defaults(agents=512, turns=4, start_at=0.5)
    p.add_argument("--gpus", type=int, required=True, help="GPU budget (whole nodes of --gpus-per-node)")
    p.add_argument("--online", action="store_true", help="rank by the highest APS within the SLO instead of JCT")
    p.add_argument("--slo-ttft", type=float, default=4.0)
    p.add_argument("--slo-tpot", type=float, default=0.05)
    p.add_argument("--probes", type=int, default=5, help="online: sweep probes per candidate")
    p.add_argument("--phases", action="store_true", help="also compare early and late rollout phases (see above)")
    ns = p.parse_args(argv)
    nodes = ns.gpus // ns.gpus_per_node
    if nodes < 2:
        print(f"dualpath sim plan: --gpus {ns.gpus} is fewer than two nodes of {ns.gpus_per_node} GPUs", file=sys.stderr)
        return 2
    say = lambda msg: print(msg, file=sys.stderr, flush=True)
    base, workload = make_config(ns), make_workload(ns)
    t0 = time.perf_counter()
    rows = evaluate(base, workload, nodes, online=ns.online, slo=(ns.slo_ttft, ns.slo_tpot), probes=ns.probes, say=say)
    if all("infeasible" in r for r in rows):
        print(f"dualpath sim plan: no split of {nodes} nodes fits {ns.target}: {rows[0]['infeasible']}", file=sys.stderr)
        return 2
    best = _best(rows, ns.online)
    lo, hi = no_bottleneck_range(ns.gpus_per_node, ns.snic_gbps / ns.cnic_gbps)
    result = {
        "target": ns.target,
        "dataset": ns.dataset,
        "gpus": ns.gpus,
        "nodes": nodes,
        "metric": "max_aps" if ns.online else "jct_s",
        "frontier": rows,
        "best": best,
        "no_bottleneck_range": [lo, hi],
        "best_in_range": lo <= best["p_over_d"] <= hi,
        "phases": _phases(base, workload, nodes, best, say) if ns.phases else None,
        "wall_s": time.perf_counter() - t0,
    }
    if ns.json:
        print(json.dumps(result, indent=2))
        return 0
    key = result["metric"]
    print(f"plan {ns.target} {ns.dataset}, {ns.gpus} GPUs = {nodes} nodes ({'max APS within SLO' if ns.online else 'offline JCT'}):")
    print(f"{'split':<7} {'P/D':>5} {'policy':<9} {key:>9}")
    for r in rows:
        v = r.get(key)
        mark = " <- best" if r is best else ("  infeasible: weights do not fit" if "infeasible" in r else "")
        print(
            f"{r['prefill_nodes']}P{r['decode_nodes']}D".ljust(7) + f" {r['p_over_d']:>5.2f} {r['policy']:<9} "
            f"{(f'{v:.2f}' if v is not None else '-'):>9}{mark}"
        )
    print(
        f"paper no-bottleneck range (g={ns.gpus_per_node}, s={ns.snic_gbps / ns.cnic_gbps:g}): {lo:.3f} <= P/D <= {hi:.2f}; "
        f"best P/D = {best['p_over_d']:.2f}: {'inside' if result['best_in_range'] else 'OUTSIDE'}"
    )
    for ph in result["phases"] or []:
        print(
            f"{ph['phase']}: best {ph['best']} ({ph['best_jct_s']:.1f} s) vs {ph['static']} ({ph['static_jct_s']:.1f} s): "
            f"{100 * ph['gain']:.1f}% shorter"
        )
    print(f"wall {result['wall_s']:.1f} s")
    return 0
