"""``dualpath sim plan``: the P/D split and read policy for a GPU budget (beyond the paper).

For ``--gpus N`` (``N // gpus_per_node`` nodes) it simulates every split into P prefill and D
decode nodes with each read policy (``dualpath``: both paths; ``basic``: prefill side only)
and ranks them by JCT (offline) or by the highest APS within the SLO (``--online``). It prints
the frontier and checks the best ratio against the paper's no-bottleneck range for
``g`` GPUs per node and ``s`` = SNIC/CNIC bandwidth ratio (§4.2): ``s/(g-s) <= P/D <=
min((g-2s)/s, (g-s)/(2s))`` — ``1/7 <= P/D <= 7/2`` for g = 8, s = 1.

Search: up to ``EXHAUSTIVE_SPLITS`` splits (or with ``--exhaustive``) every split is simulated.
Beyond that (1,152 GPUs are 144 nodes, 143 splits per policy) each policy's splits are searched:
a coarse grid, even in log(P/D), then, round by round, the midpoints of the gaps on both sides of
the best split so far, until its neighbours are simulated too. That finds the best split
wherever a policy's metric is unimodal in P (too few prefill nodes: prefill- or storage-bound;
too many: decode-bound), with about 20 runs per policy instead of 143. The runs of a round go to
a process pool (``--jobs``, default every core). Without ``--agents`` the cluster gets the
paper's load per node (2K agents on 2P4D, 48K on 48P96D).

Phases: a rollout's prefill pressure changes over time (early turns have short contexts and
many misses; late turns long, almost fully cached contexts). With ``--phases`` the agents'
first half of turns (from the start, cold) and second half (met mid-trajectory, warm
storage) are simulated separately for every split; when the best split of a phase differs
from the best static one, the report says which and by how much the phase's JCT would drop.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace

from dualpath.cost import CostModelError, cost_model, get_target
from dualpath.sim.config import SimConfig
from dualpath.sim.experiments import run_offline, sweep_online
from dualpath.sim.workload import Workload

__all__ = ["main", "no_bottleneck_range", "search_splits"]

EXHAUSTIVE_SPLITS = 16  # up to this many splits per policy, all are simulated
COARSE_POINTS = 9  # the search's first grid, per policy
AGENTS_PER_NODE = 2048 / 6  # the paper's offline load: 2K agents on 2P4D, 48K on 48P96D
POLICIES = ("dualpath", "basic")


def no_bottleneck_range(g: int, s: float) -> tuple[float, float]:
    """The paper's P/D range for ``g`` GPUs per node and SNIC = ``s`` x CNIC (§4.2)."""
    return s / (g - s), min((g - 2 * s) / s, (g - s) / (2 * s))


def _splits(nodes: int) -> list[tuple[int, int]]:
    return [(p, nodes - p) for p in range(1, nodes)]


def _offline_jct(cfg: SimConfig, workload: Workload) -> float:
    return run_offline(cfg, workload, [cfg.mode], progress=False)["modes"][cfg.mode]["jct_s"]


def _infeasible(cfg: SimConfig) -> str | None:
    """Why ``cfg`` cannot run (e.g. the weights do not fit its decode GPUs), or None."""
    target = get_target(cfg.target)
    try:
        cost_model(cfg.target, cfg.gpu, ep=cfg.decode_ep_size(target.default_ep, target.routed_experts)).hbm_kv_capacity_tokens()
    except CostModelError as exc:
        return str(exc)
    return None


def _run_split(base: SimConfig, workload: Workload, p: int, d: int, mode: str, online: bool, slo: tuple[float, float], probes: int) -> dict:
    """One (split, policy) row: JCT (offline) or max APS (online); a pool worker runs it."""
    cfg = replace(base, prefill_nodes=p, decode_nodes=d, mode=mode)
    row: dict = {"prefill_nodes": p, "decode_nodes": d, "p_over_d": p / d, "policy": mode}
    if online:
        start = online_start_rate(cfg, workload.turns or 1)
        sweep = sweep_online(cfg, replace(workload, rate=start), slo_ttft=slo[0], slo_tpot=slo[1], start_rate=start, probes=probes)
        row["max_aps"] = sweep["max_aps"]
        # a sweep that never failed (or never passed) says only a bound: more --probes would tell
        row["bracketed"] = any(pt["passed"] for pt in sweep["points"]) and any(not pt["passed"] for pt in sweep["points"])
        row["probes"] = len(sweep["points"])
    else:
        row["jct_s"] = _offline_jct(cfg, workload)
    return row


def online_start_rate(cfg: SimConfig, turns: int) -> float:
    """Where a split's APS sweep starts: half the rate at which agents of ``turns`` turns of
    ~45K hit tokens each would saturate the storage NICs its policy reads through (the prefill
    nodes', or every node's); the sweep doubles or halves from there."""
    nodes = cfg.prefill_nodes if cfg.mode == "basic" else cfg.prefill_nodes + cfg.decode_nodes
    return 0.5 * nodes * cfg.snic_bytes_per_s() / (45_000 * get_target(cfg.target).kv_bytes_per_token()) / turns


Key = tuple[str, int]  # (policy, prefill nodes)


def search_splits(
    nodes: int, policies: Iterable[str], score: Callable[[list[Key]], dict[Key, float]], *, coarse: int = COARSE_POINTS
) -> dict[Key, float]:
    """The best split of ``nodes`` per policy, by simulating few of them (module docstring).

    ``score`` takes a round's keys and returns their scores (higher is better; keys it leaves
    out are infeasible and never asked again). Returns every score taken: the best per policy
    is the maximum of its keys, and its neighbours (P-1, P+1) are among them where feasible."""
    ps = list(range(1, nodes))
    ratios = [math.log(p / (nodes - p)) for p in ps]
    lo, hi = ratios[0], ratios[-1]
    grid = sorted({min(range(len(ps)), key=lambda i: abs(ratios[i] - (lo + (hi - lo) * k / (coarse - 1)))) for k in range(coarse)})
    scores: dict[Key, float] = {}
    asked: set[Key] = set()
    todo = [(policy, ps[i]) for policy in policies for i in grid]
    while todo:
        asked.update(todo)
        scores.update(score(todo))
        todo = []
        for policy in {k[0] for k in asked}:
            done = sorted(p for (pol, p) in scores if pol == policy)
            if not done:
                continue
            best = max(done, key=lambda p: scores[(policy, p)])
            i = done.index(best)
            left = done[i - 1] if i > 0 else 0  # 0 and nodes: past the ends, never simulated
            right = done[i + 1] if i + 1 < len(done) else nodes
            for a, b in ((left, best), (best, right)):
                mid = (a + b) // 2 if b - a > 1 else None
                if mid is not None and mid != best and 0 < mid < nodes and (policy, mid) not in asked:
                    todo.append((policy, mid))
    return scores


def evaluate(
    base: SimConfig,
    workload: Workload,
    nodes: int,
    *,
    online: bool,
    slo: tuple[float, float],
    probes: int,
    say: Callable[[str], None],
    exhaustive: bool = False,
    jobs: int = 1,
    policies: tuple[str, ...] = POLICIES,
) -> list[dict]:
    """One row per simulated (split, policy): JCT (offline) or max APS (online), infeasible
    splits with the reason; every split when ``exhaustive`` or few, a search otherwise."""
    metric = "max_aps" if online else "jct_s"
    rows: dict[Key, dict] = {}
    t0 = time.perf_counter()
    pool = ProcessPoolExecutor(max_workers=jobs) if jobs > 1 else None

    def score(keys: list[Key]) -> dict[Key, float]:
        runnable = []
        for policy, p in keys:
            cfg = replace(base, prefill_nodes=p, decode_nodes=nodes - p, mode=policy)
            if (why := _infeasible(cfg)) is not None:
                rows[(policy, p)] = {"prefill_nodes": p, "decode_nodes": nodes - p, "p_over_d": p / (nodes - p), "policy": policy}
                rows[(policy, p)]["infeasible"] = why
                say(f"[plan] {p}P{nodes - p}D {policy}: infeasible ({why})")
            else:
                runnable.append((policy, p))
        args = [(base, workload, p, nodes - p, policy, online, slo, probes) for policy, p in runnable]
        done = (f.result() for f in as_completed([pool.submit(_run_split, *a) for a in args])) if pool else (_run_split(*a) for a in args)
        for row in done:
            rows[(row["policy"], row["prefill_nodes"])] = row
            value = row[metric]
            say(
                f"[plan] {len(rows)} runs, {time.perf_counter() - t0:6.0f} s: {row['prefill_nodes']}P{row['decode_nodes']}D "
                f"{row['policy']} " + (f"max APS {value}" if online else f"JCT {value:.1f} s")
            )
        return {k: (rows[k][metric] or 0.0) * (1 if online else -1) for k in runnable}

    try:
        if exhaustive or nodes - 1 <= EXHAUSTIVE_SPLITS:
            score([(policy, p) for policy in policies for p, _ in _splits(nodes)])
        else:
            search_splits(nodes, policies, score)
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    return [rows[k] for k in sorted(rows, key=lambda k: (k[1], POLICIES.index(k[0])))]


def near_best(rows: list[dict], online: bool, tolerance: float) -> dict[str, dict]:
    """Per policy, its best row and the P/D range of the simulated splits within ``tolerance``
    of it (a flat optimum: any split in the range is as good, to the simulator's resolution)."""
    out = {}
    for policy in POLICIES:
        mine = [r for r in rows if r["policy"] == policy and "infeasible" not in r]
        if not mine:
            continue
        best = _best(mine, online)
        if online:
            close = [r for r in mine if (r["max_aps"] or 0.0) >= (1 - tolerance) * (best["max_aps"] or 0.0)]
        else:
            close = [r for r in mine if r["jct_s"] <= (1 + tolerance) * best["jct_s"]]
        ratios = [r["p_over_d"] for r in close]
        out[policy] = {"best": best, "p_over_d_min": min(ratios), "p_over_d_max": max(ratios), "splits": len(close)}
    return out


def _best(rows: list[dict], online: bool) -> dict:
    rows = [r for r in rows if "infeasible" not in r]
    if online:
        return max(rows, key=lambda r: r.get("max_aps") or 0.0)
    return min(rows, key=lambda r: r["jct_s"])


def _phases(base: SimConfig, workload: Workload, nodes: int, static: dict, say, *, exhaustive: bool, jobs: int) -> list[dict]:
    """Per rollout phase, the best split with the static best's policy against the static split."""
    out = []
    turns = workload.turns or 8
    half = max(1, turns // 2)
    policy, mine_p = static["policy"], static["prefill_nodes"]
    for name, w in (
        ("early (first turns, cold storage)", replace(workload, turns=half, start_at=0.0)),
        ("late (mid-trajectory, warm storage)", replace(workload, turns=half, start_at=0.5)),
    ):
        rows = evaluate(
            base, w, nodes, online=False, slo=(0.0, 0.0), probes=0, say=say, exhaustive=exhaustive, jobs=jobs, policies=(policy,)
        )
        jct = {r["prefill_nodes"]: r["jct_s"] for r in rows if "infeasible" not in r}
        if mine_p not in jct:  # the search went elsewhere: the static split is simulated for the comparison
            jct[mine_p] = _run_split(base, w, mine_p, nodes - mine_p, policy, False, (0.0, 0.0), 0)["jct_s"]
        best = min(jct, key=jct.__getitem__)
        out.append(
            {
                "phase": name,
                "best": f"{best}P{nodes - best}D",
                "best_jct_s": jct[best],
                "static": f"{mine_p}P{nodes - mine_p}D",
                "static_jct_s": jct[mine_p],
                "gain": 1 - jct[best] / jct[mine_p],
            }
        )
        say(f"phase {name}: best {best}P{nodes - best}D {jct[best]:.1f} s vs static {mine_p}P{nodes - mine_p}D {jct[mine_p]:.1f} s")
    return out


def main(argv: list[str], add_cluster_arguments, make_config, make_workload) -> int:
    p = argparse.ArgumentParser(prog="dualpath sim plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_arguments(p)
    p.set_defaults(agents=0, turns=4, start_at=0.5)
    p.add_argument("--gpus", type=int, required=True, help="GPU budget (whole nodes of --gpus-per-node)")
    p.add_argument("--online", action="store_true", help="rank by the highest APS within the SLO instead of JCT")
    p.add_argument("--slo-ttft", type=float, default=4.0)
    p.add_argument("--slo-tpot", type=float, default=0.05)
    p.add_argument("--probes", type=int, default=6, help="online: sweep probes per candidate")
    p.add_argument("--duration", type=float, default=60.0, help="online: seconds of arrivals per probe")
    p.add_argument("--phases", action="store_true", help="also compare early and late rollout phases (see above)")
    p.add_argument("--exhaustive", action="store_true", help=f"simulate every split (default up to {EXHAUSTIVE_SPLITS}; a search beyond)")
    p.add_argument("--tolerance", type=float, default=0.01, help="near-best: within this share of a policy's best (default 1%%)")
    p.add_argument("--jobs", type=int, default=0, help="runs at once in a process pool (default: every core; 1: in this process)")
    ns = p.parse_args(argv)
    nodes = ns.gpus // ns.gpus_per_node
    if nodes < 2:
        print(f"dualpath sim plan: --gpus {ns.gpus} is fewer than two nodes of {ns.gpus_per_node} GPUs", file=sys.stderr)
        return 2
    if ns.jobs < 0:
        print(f"dualpath sim plan: --jobs must be >= 0, got {ns.jobs}", file=sys.stderr)
        return 2
    if not 0 <= ns.tolerance < 1:
        print(f"dualpath sim plan: --tolerance must be in [0, 1), got {ns.tolerance}", file=sys.stderr)
        return 2
    if ns.online and not (ns.duration > 0 and ns.probes >= 1):
        print(f"dualpath sim plan: --duration must be > 0 and --probes >= 1, got {ns.duration} and {ns.probes}", file=sys.stderr)
        return 2
    if ns.agents == 0:  # offline: the paper's load per node (a fixed count would leave a large cluster idle);
        # online: as many as arrive in a probe (each run builds only those)
        ns.agents = 1 << 20 if ns.online else max(1, round(AGENTS_PER_NODE * nodes))
    say = lambda msg: print(msg, file=sys.stderr, flush=True)
    base, workload = make_config(ns), make_workload(ns)
    if ns.online:
        workload = replace(workload, duration_s=ns.duration)
    jobs = ns.jobs or os.cpu_count() or 1
    t0 = time.perf_counter()
    rows = evaluate(
        base,
        workload,
        nodes,
        online=ns.online,
        slo=(ns.slo_ttft, ns.slo_tpot),
        probes=ns.probes,
        say=say,
        exhaustive=ns.exhaustive,
        jobs=jobs,
    )
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
        "agents": ns.agents,
        "metric": "max_aps" if ns.online else "jct_s",
        "search": "exhaustive" if ns.exhaustive or nodes - 1 <= EXHAUSTIVE_SPLITS else "search",
        "splits": nodes - 1,
        "simulated": sum("infeasible" not in r for r in rows),
        "jobs": jobs,
        "frontier": rows,
        "best": best,
        "no_bottleneck_range": [lo, hi],
        "best_in_range": lo <= best["p_over_d"] <= hi,
        "near_best": near_best(rows, ns.online, ns.tolerance),
        "unbracketed": [f"{r['prefill_nodes']}P{r['decode_nodes']}D {r['policy']}" for r in rows if r.get("bracketed") is False],
        "tolerance": ns.tolerance,
        "phases": _phases(base, workload, nodes, best, say, exhaustive=ns.exhaustive, jobs=jobs) if ns.phases else None,
        "wall_s": time.perf_counter() - t0,  # phases included
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
        if r.get("bracketed") is False:
            mark += "  (a bound: the sweep never both passed and failed; raise --probes)"
        print(
            f"{r['prefill_nodes']}P{r['decode_nodes']}D".ljust(7) + f" {r['p_over_d']:>5.2f} {r['policy']:<9} "
            f"{(f'{v:.2f}' if v is not None else '-'):>9}{mark}"
        )
    print(
        f"paper no-bottleneck range (g={ns.gpus_per_node}, s={ns.snic_gbps / ns.cnic_gbps:g}): {lo:.3f} <= P/D <= {hi:.2f}; "
        f"best P/D = {best['p_over_d']:.2f}: {'inside' if result['best_in_range'] else 'OUTSIDE'}"
    )
    for policy, nb in result["near_best"].items():
        b = nb["best"]
        print(
            f"{policy}: best {b['prefill_nodes']}P{b['decode_nodes']}D; within {100 * ns.tolerance:g}% of it: "
            f"P/D {nb['p_over_d_min']:.2f}-{nb['p_over_d_max']:.2f} ({nb['splits']} simulated splits)"
        )
    for ph in result["phases"] or []:
        print(
            f"{ph['phase']}: best {ph['best']} ({ph['best_jct_s']:.1f} s) vs {ph['static']} ({ph['static_jct_s']:.1f} s): "
            f"{100 * ph['gain']:.1f}% shorter"
        )
    print(f"{result['simulated']} runs ({result['search']}, {nodes - 1} splits per policy, {jobs} jobs), wall {result['wall_s']:.1f} s")
    return 0
