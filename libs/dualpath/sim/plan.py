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
a process pool (``--jobs``, default every core), with a progress bar on stderr (runs done against
those of the round plus an estimate of the rounds to come). Without ``--agents`` the cluster gets
the paper's load per node (2K agents on 2P4D, 48K on 48P96D).

Slices: a split is not simulated whole but on a slice (``dualpath.sim.slices``, which says how a
slice stands for the whole and where it is inexact): the nodes of ``--slice-min-nodes`` to
``--slice-nodes`` whose P/D is closest to the split's (exact when the ratio in lowest terms fits:
48P96D is run as 4P8D), at the whole's load per node, with the decode EP group pinned to the
whole's size (``decode_ep`` auto gives a whole of 32 or more decode nodes 256 GPUs per group;
the slice gets 256 too, not its own 8 x d). Offline the slice's JCT is the split's; online the
whole's APS is the slice's x N/n. Splits that share a slice run once. Defaults: 12-24 nodes
offline (smaller slices finish measurably earlier than the whole, see docs/simulator.md), 8-16
online (a slice with a single prefill node meets the TTFT bound at a lower rate per node than a
larger one: its queue has no other node to spill to; 8 nodes give each side two or more inside
the paper's range but at 1:7). Every row reports its
``slice``; ``--slice-nodes 0`` simulates every split whole. The best split is then simulated
whole (``--full-size-check``, default on): offline its JCT against the slice's; online one probe
of the whole at each of the two rates that bracket the slice's knee, scaled (it must pass at the
first and fail at the second, as the slice did).

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
from dataclasses import dataclass, replace

from dualpath.cost import CostModelError, cost_model, get_target
from dualpath.sim.config import SimConfig
from dualpath.sim.experiments import run_offline, run_online, sweep_online
from dualpath.sim.slices import Slice, slice_of, slice_split
from dualpath.sim.workload import Workload

__all__ = ["main", "no_bottleneck_range", "search_splits"]

EXHAUSTIVE_SPLITS = 16  # up to this many splits per policy, all are simulated
COARSE_POINTS = 9  # the search's first grid, per policy
AGENTS_PER_NODE = 2048 / 6  # the paper's offline load: 2K agents on 2P4D, 48K on 48P96D
POLICIES = ("dualpath", "basic")
FULL_SIZE = (1, 0)  # slicing (min, max nodes) that simulates every split whole
SLICING = {"offline": (12, 24), "online": (8, 16)}  # the default slice sizes (module docstring)
BAR_WIDTH = 30
ATTAINMENT = 0.99  # online: the share of turns within the SLO a rate must reach (sweep_online's)


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


def _run_slice(cfg: SimConfig, workload: Workload, online: bool, slo: tuple[float, float], probes: int) -> dict:
    """One run of a slice (or of a whole split): JCT (offline) or max APS (online), and the CPU
    seconds it took; a pool worker runs it."""
    cpu = time.process_time()
    out: dict = {}
    if online:
        start = online_start_rate(cfg, workload.turns or 1)
        sweep = sweep_online(
            cfg, replace(workload, rate=start), slo_ttft=slo[0], slo_tpot=slo[1], attainment=ATTAINMENT, start_rate=start, probes=probes
        )
        out["max_aps"] = sweep["max_aps"]
        out["failed_aps"] = min((pt["rate"] for pt in sweep["points"] if not pt["passed"]), default=None)
        # a sweep that never failed (or never passed) says only a bound: more --probes would tell
        out["bracketed"] = any(pt["passed"] for pt in sweep["points"]) and any(not pt["passed"] for pt in sweep["points"])
        out["probes"] = len(sweep["points"])
    else:
        out["jct_s"] = _offline_jct(cfg, workload)
    out["cpu_s"] = time.process_time() - cpu
    return out


def _row(policy: str, p: int, d: int, s: Slice, run: dict) -> dict:
    """A split's row from its slice's run: the whole's APS is the slice's times ``s.scale``."""
    row: dict = {"prefill_nodes": p, "decode_nodes": d, "p_over_d": p / d, "policy": policy, "slice": s.to_json()}
    if "max_aps" in run:
        row["max_aps"] = None if run["max_aps"] is None else run["max_aps"] * s.scale
        row["failed_aps"] = None if run["failed_aps"] is None else run["failed_aps"] * s.scale  # the lowest rate that failed
        row["slice_max_aps"] = run["max_aps"]
        row["bracketed"], row["probes"] = run["bracketed"], run["probes"]
    else:
        row["jct_s"] = run["jct_s"]
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Evaluation:
    """What ``evaluate`` found: a row per split (by P, then policy), the runs it took (one per
    distinct slice) and their CPU seconds."""

    rows: list[dict]
    runs: int
    cpu_s: float


class _Runs:
    """Runs (policy, P) splits of ``nodes`` on their slices, each slice once, ``jobs`` at a time,
    with a progress bar on ``say``: runs done against those planned (exhaustive) or, for a
    search, those of its round plus an estimate of the rounds to come (``~``)."""

    def __init__(
        self,
        base: SimConfig,
        workload: Workload,
        nodes: int,
        *,
        online: bool,
        slo: tuple[float, float],
        probes: int,
        slicing: tuple[int, int],
        jobs: int,
        say: Callable[[str], None],
    ) -> None:
        self.base, self.workload, self.nodes, self.online, self.slo, self.probes = base, workload, nodes, online, slo, probes
        self.slicing, self.say = slicing, say
        self.metric = "max_aps" if online else "jct_s"
        self.rows: dict[Key, dict] = {}
        self.runs: dict[tuple[str, int, int], dict] = {}  # a slice's run by (policy, p, d): splits sharing a slice run it once
        self.planned = 0  # runs an exhaustive evaluation will make (0: a search, the total is estimated)
        self.t0 = time.perf_counter()
        self.pool = ProcessPoolExecutor(max_workers=jobs) if jobs > 1 else None

    def score(self, keys: list[Key]) -> dict[Key, float]:
        """``search_splits``' score: each key's metric, higher is better; infeasible keys left out."""
        todo: dict[tuple[str, int, int], tuple[SimConfig, Workload]] = {}
        mine: dict[Key, tuple[tuple[str, int, int], Slice]] = {}
        for policy, p in keys:
            d = self.nodes - p
            whole = replace(self.base, prefill_nodes=p, decode_nodes=d, mode=policy)
            if (why := _infeasible(whole)) is not None:
                self.rows[(policy, p)] = {"prefill_nodes": p, "decode_nodes": d, "p_over_d": p / d, "policy": policy, "infeasible": why}
                self.say(f"[plan] {p}P{d}D {policy}: infeasible ({why})")
                continue
            cfg, w, s = slice_split(whole, self.workload, min_nodes=self.slicing[0], max_nodes=self.slicing[1], online=self.online)
            skey = (policy, s.prefill_nodes, s.decode_nodes)
            mine[(policy, p)] = (skey, s)
            if skey not in self.runs:
                todo[skey] = (cfg, w)
        pending = len(todo)
        for skey, run in self._run(todo):
            self.runs[skey] = run
            pending -= 1
            splits = [k for k, (sk, _) in mine.items() if sk == skey]
            for policy, p in splits:
                self.rows[(policy, p)] = _row(policy, p, self.nodes - p, mine[(policy, p)][1], run)
            self._progress(skey, splits, pending)
        for policy, p in mine:  # splits whose slice an earlier round ran
            self.rows.setdefault((policy, p), _row(policy, p, self.nodes - p, mine[(policy, p)][1], self.runs[mine[(policy, p)][0]]))
        return {k: self._score(self.rows[k]) for k in mine}

    def _score(self, row: dict) -> float:
        return (row[self.metric] or 0.0) * (1 if self.online else -1)

    def _run(self, todo: dict[tuple[str, int, int], tuple[SimConfig, Workload]]) -> Iterable[tuple[tuple[str, int, int], dict]]:
        args = {k: (cfg, w, self.online, self.slo, self.probes) for k, (cfg, w) in todo.items()}
        if self.pool is None:
            return ((k, _run_slice(*a)) for k, a in args.items())
        futures = {self.pool.submit(_run_slice, *a): k for k, a in args.items()}
        return ((futures[f], f.result()) for f in as_completed(futures))

    def _progress(self, skey: tuple[str, int, int], splits: list[Key], pending: int) -> None:
        done = len(self.runs)
        if self.planned:
            total, approx = self.planned, ""
        else:
            scores = {k: self._score(r) for k, r in self.rows.items() if "infeasible" not in r}
            total, approx = done + pending + search_left(self.nodes, scores), "~"
        policy, p, d = skey
        run = self.runs[skey]
        if self.online:  # the whole's APS (the slice's, scaled)
            aps = self.rows[splits[0]]["max_aps"]
            value = "max APS " + ("none passed" if aps is None else f"{aps:.1f}")
        else:
            value = f"JCT {run['jct_s']:.1f} s"
        names = ", ".join(f"{q}P{self.nodes - q}D" for _, q in splits)
        bar = "#" * int(BAR_WIDTH * done / max(total, done, 1))
        self.say(
            f"[plan] [{bar:<{BAR_WIDTH}}] {done}/{approx}{max(total, done)} runs, {time.perf_counter() - self.t0:5.0f} s: "
            f"{names} {policy} on {p}P{d}D: {value} ({run['cpu_s']:.1f} s CPU)"
        )

    def distinct(self, keys: list[Key]) -> int:
        """How many runs ``keys`` take: one per slice of their feasible splits."""
        mine = {(pol, p) for pol, p in keys if _infeasible(replace(self.base, prefill_nodes=p, decode_nodes=self.nodes - p)) is None}
        lo, hi = self.slicing
        return len({(pol, slice_of(p, self.nodes - p, min_nodes=lo, max_nodes=hi)) for pol, p in mine})

    def close(self) -> None:
        if self.pool:
            self.pool.shutdown(cancel_futures=True)


def search_left(nodes: int, scores: dict[Key, float]) -> int:
    """About how many runs a search with these ``scores`` has left: per policy, halving each gap
    beside its best split down to the neighbours (2 log2 of the gap's width, at most)."""
    left = 0
    for policy in {k[0] for k in scores}:
        done = sorted(p for pol, p in scores if pol == policy)
        best = max(done, key=lambda p: scores[(policy, p)])
        i = done.index(best)
        gaps = (best - (done[i - 1] if i > 0 else 0), (done[i + 1] if i + 1 < len(done) else nodes) - best)
        left += sum(math.ceil(math.log2(g)) for g in gaps if g > 1)
    return left


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
    slicing: tuple[int, int] = FULL_SIZE,
) -> Evaluation:
    """One row per simulated (split, policy): JCT (offline) or max APS (online), infeasible
    splits with the reason; every split when ``exhaustive`` or few, a search otherwise. Each
    split runs on its slice of ``slicing`` = (min, max) nodes (``dualpath.sim.slices``;
    ``FULL_SIZE``: the whole)."""
    runs = _Runs(base, workload, nodes, online=online, slo=slo, probes=probes, slicing=slicing, jobs=jobs, say=say)
    try:
        if exhaustive or nodes - 1 <= EXHAUSTIVE_SPLITS:
            keys = [(policy, p) for policy in policies for p, _ in _splits(nodes)]
            runs.planned = runs.distinct(keys)
            runs.score(keys)
        else:
            search_splits(nodes, policies, runs.score)
            n = len(runs.runs)
            say(f"[plan] [{'#' * BAR_WIDTH}] {n}/{n} runs, {time.perf_counter() - runs.t0:5.0f} s: the search is done")
    finally:
        runs.close()
    rows = [runs.rows[k] for k in sorted(runs.rows, key=lambda k: (k[1], POLICIES.index(k[0])))]
    return Evaluation(rows=rows, runs=len(runs.runs), cpu_s=sum(r["cpu_s"] for r in runs.runs.values()))


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
    """The best feasible row; among splits that share its slice (the same figure), the one whose
    ratio is closest to the slice's."""
    rows = [r for r in rows if "infeasible" not in r]

    def miss(r: dict) -> float:
        return abs(math.log(r["p_over_d"] / r["slice"]["p_over_d"])) if "slice" in r else 0.0

    if online:
        return min(rows, key=lambda r: (-(r.get("max_aps") or 0.0), miss(r)))
    return min(rows, key=lambda r: (r["jct_s"], miss(r)))


def _split_jct(base: SimConfig, workload: Workload, nodes: int, policy: str, p: int, slicing: tuple[int, int]) -> float:
    """One split's offline JCT, run on its slice in this process."""
    whole = replace(base, prefill_nodes=p, decode_nodes=nodes - p, mode=policy)
    cfg, w, _ = slice_split(whole, workload, min_nodes=slicing[0], max_nodes=slicing[1], online=False)
    return _offline_jct(cfg, w)


def full_size_check(
    base: SimConfig, workload: Workload, nodes: int, best: dict, *, online: bool, slo: tuple[float, float], jobs: int
) -> dict:
    """The best split simulated whole against its slice's figure. Offline: its JCT (``slice_error``:
    the slice's JCT / the whole's - 1). Online: the two rates that bracket the slice's knee, scaled
    to the whole (its max APS, which passed, and the lowest rate that failed), each one probe of
    the whole (``agrees``: the whole passes and fails where the slice did)."""
    whole = replace(base, prefill_nodes=best["prefill_nodes"], decode_nodes=best["decode_nodes"], mode=best["policy"])
    cfg, w, _ = slice_split(whole, workload, min_nodes=FULL_SIZE[0], max_nodes=FULL_SIZE[1], online=online)
    out: dict = {"split": f"{best['prefill_nodes']}P{best['decode_nodes']}D", "policy": best["policy"]}
    if not online:
        run = _run_slice(cfg, w, online, slo, 0)
        out.update(jct_s=run["jct_s"], sliced=best["jct_s"], slice_error=best["jct_s"] / run["jct_s"] - 1, cpu_s=run["cpu_s"])
        return out
    rates = {r: passed for r, passed in ((best["max_aps"], True), (best.get("failed_aps"), False)) if r is not None}
    with ProcessPoolExecutor(max_workers=max(1, min(jobs, len(rates)))) as pool:
        probes = dict(zip(rates, pool.map(_online_probe, [cfg] * len(rates), [w] * len(rates), rates, [slo] * len(rates))))
    out["probes"] = [{"rate": r, "slice_passed": rates[r], **probes[r]} for r in rates]
    out["agrees"] = all(p["passed"] == p["slice_passed"] for p in out["probes"])
    out["cpu_s"] = sum(p["cpu_s"] for p in probes.values())
    return out


def _online_probe(cfg: SimConfig, workload: Workload, rate: float, slo: tuple[float, float]) -> dict:
    """One probe at ``rate`` APS: its SLO attainment and whether it passed (as a sweep's probe)."""
    cpu = time.process_time()
    row = run_online(cfg, replace(workload, rate=rate), slo_ttft=slo[0], slo_tpot=slo[1])
    passed = row["attainment"] is not None and row["attainment"] >= ATTAINMENT
    return {"attainment": row["attainment"], "passed": passed, "cpu_s": time.process_time() - cpu}


def _phases(
    base: SimConfig, workload: Workload, nodes: int, static: dict, say, *, exhaustive: bool, jobs: int, slicing: tuple[int, int]
) -> list[dict]:
    """Per rollout phase, the best split with the static best's policy against the static split."""
    out = []
    turns = workload.turns or 8
    half = max(1, turns // 2)
    policy, mine_p = static["policy"], static["prefill_nodes"]
    for name, w in (
        ("early (first turns, cold storage)", replace(workload, turns=half, start_at=0.0)),
        ("late (mid-trajectory, warm storage)", replace(workload, turns=half, start_at=0.5)),
    ):
        found = evaluate(
            base,
            w,
            nodes,
            online=False,
            slo=(0.0, 0.0),
            probes=0,
            say=say,
            exhaustive=exhaustive,
            jobs=jobs,
            policies=(policy,),
            slicing=slicing,
        )
        jct = {r["prefill_nodes"]: r["jct_s"] for r in found.rows if "infeasible" not in r}
        if mine_p not in jct:  # the search went elsewhere: the static split is simulated for the comparison
            jct[mine_p] = _split_jct(base, w, nodes, policy, mine_p, slicing)
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


def _parser(add_cluster_arguments) -> argparse.ArgumentParser:
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
    p.add_argument(
        "--slice-nodes",
        type=int,
        default=None,
        help=f"simulate each split on a slice of at most this many nodes (default {SLICING['offline'][1]}, online "
        f"{SLICING['online'][1]}; 0: every split whole)",
    )
    p.add_argument(
        "--slice-min-nodes",
        type=int,
        default=None,
        help=f"... and at least this many (default {SLICING['offline'][0]}, online {SLICING['online'][0]})",
    )
    p.add_argument(
        "--full-size-check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="simulate the best split whole and report its slice's error (default on)",
    )
    p.add_argument("--tolerance", type=float, default=0.01, help="near-best: within this share of a policy's best (default 1%%)")
    p.add_argument("--jobs", type=int, default=0, help="runs at once in a process pool (default: every core; 1: in this process)")
    return p


def _refusal(ns: argparse.Namespace, nodes: int) -> str | None:
    """Why these arguments cannot be planned, or None."""
    if nodes < 2:
        return f"--gpus {ns.gpus} is fewer than two nodes of {ns.gpus_per_node} GPUs"
    if ns.jobs < 0:
        return f"--jobs must be >= 0, got {ns.jobs}"
    if not 0 <= ns.tolerance < 1:
        return f"--tolerance must be in [0, 1), got {ns.tolerance}"
    if ns.online and not (ns.duration > 0 and ns.probes >= 1):
        return f"--duration must be > 0 and --probes >= 1, got {ns.duration} and {ns.probes}"
    if ns.slice_nodes is not None and ns.slice_nodes != 0 and ns.slice_nodes < 2:
        return f"--slice-nodes must be 0 (every split whole) or at least 2, got {ns.slice_nodes}"
    if ns.slice_min_nodes is not None and ns.slice_min_nodes < 2:
        return f"--slice-min-nodes must be at least 2, got {ns.slice_min_nodes}"
    return None


def _slicing(ns: argparse.Namespace) -> tuple[int, int]:
    """(min, max) slice nodes from the flags and the mode's defaults; ``FULL_SIZE`` for 0."""
    lo, hi = SLICING["online" if ns.online else "offline"]
    hi = hi if ns.slice_nodes is None else ns.slice_nodes
    lo = lo if ns.slice_min_nodes is None else ns.slice_min_nodes
    return FULL_SIZE if hi == 0 else (min(lo, hi), hi)


def main(argv: list[str], add_cluster_arguments, make_config, make_workload) -> int:
    ns = _parser(add_cluster_arguments).parse_args(argv)
    nodes = ns.gpus // ns.gpus_per_node
    if (why := _refusal(ns, nodes)) is not None:
        print(f"dualpath sim plan: {why}", file=sys.stderr)
        return 2
    if ns.agents == 0:  # offline: the paper's load per node (a fixed count would leave a large cluster idle);
        # online: as many as arrive in a probe (each run builds only those)
        ns.agents = 1 << 20 if ns.online else max(1, round(AGENTS_PER_NODE * nodes))
    say = lambda msg: print(msg, file=sys.stderr, flush=True)
    base, workload = make_config(ns), make_workload(ns)
    if ns.online:
        workload = replace(workload, duration_s=ns.duration)
    jobs, slicing, slo = ns.jobs or os.cpu_count() or 1, _slicing(ns), (ns.slo_ttft, ns.slo_tpot)
    t0 = time.perf_counter()
    found = evaluate(
        base, workload, nodes, online=ns.online, slo=slo, probes=ns.probes, say=say, exhaustive=ns.exhaustive, jobs=jobs, slicing=slicing
    )
    rows = found.rows
    if all("infeasible" in r for r in rows):
        print(f"dualpath sim plan: no split of {nodes} nodes fits {ns.target}: {rows[0]['infeasible']}", file=sys.stderr)
        return 2
    best = _best(rows, ns.online)
    lo, hi = no_bottleneck_range(ns.gpus_per_node, ns.snic_gbps / ns.cnic_gbps)
    check = None
    if ns.full_size_check and best["slice"]["prefill_nodes"] + best["slice"]["decode_nodes"] < nodes:
        say(f"[plan] full-size check: {best['prefill_nodes']}P{best['decode_nodes']}D {best['policy']} simulated whole")
        check = full_size_check(base, workload, nodes, best, online=ns.online, slo=slo, jobs=jobs)
    searched = not (ns.exhaustive or nodes - 1 <= EXHAUSTIVE_SPLITS)
    result = {
        "target": ns.target,
        "dataset": ns.dataset,
        "gpus": ns.gpus,
        "nodes": nodes,
        "agents": ns.agents,
        "metric": "max_aps" if ns.online else "jct_s",
        "search": "search" if searched else "exhaustive",
        "splits": nodes - 1,
        "simulated": sum("infeasible" not in r for r in rows),
        "runs": found.runs,
        "slicing": None if slicing == FULL_SIZE else {"min_nodes": slicing[0], "max_nodes": slicing[1]},
        "jobs": jobs,
        "frontier": rows,
        "best": best,
        "no_bottleneck_range": [lo, hi],
        "best_in_range": lo <= best["p_over_d"] <= hi,
        "near_best": near_best(rows, ns.online, ns.tolerance),
        "unbracketed": [f"{r['prefill_nodes']}P{r['decode_nodes']}D {r['policy']}" for r in rows if r.get("bracketed") is False],
        "tolerance": ns.tolerance,
        "full_size_check": check,
        "phases": _phases(base, workload, nodes, best, say, exhaustive=ns.exhaustive, jobs=jobs, slicing=slicing) if ns.phases else None,
        "cpu_s": found.cpu_s + (check["cpu_s"] if check else 0.0),  # the runs' own, phases not included
        "wall_s": time.perf_counter() - t0,  # phases included
    }
    if ns.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result, ns)
    return 0


def _print_table(result: dict, ns: argparse.Namespace) -> None:
    key, best, nodes = result["metric"], result["best"], result["nodes"]
    print(f"plan {ns.target} {ns.dataset}, {ns.gpus} GPUs = {nodes} nodes ({'max APS within SLO' if ns.online else 'offline JCT'}):")
    print(f"{'split':<8} {'P/D':>5} {'policy':<9} {'slice':<7} {key:>9}")
    for r in result["frontier"]:
        v = r.get(key)
        mark = " <- best" if r is best else ("  infeasible: weights do not fit" if "infeasible" in r else "")
        if r.get("bracketed") is False:
            mark += "  (a bound: the sweep never both passed and failed; raise --probes)"
        sl = f"{r['slice']['prefill_nodes']}P{r['slice']['decode_nodes']}D" if "slice" in r else "-"
        print(
            f"{r['prefill_nodes']}P{r['decode_nodes']}D".ljust(8) + f" {r['p_over_d']:>5.2f} {r['policy']:<9} {sl:<7} "
            f"{(f'{v:.2f}' if v is not None else '-'):>9}{mark}"
        )
    lo, hi = result["no_bottleneck_range"]
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
    if (check := result["full_size_check"]) is not None:
        head = f"full-size check, {check['split']} {check['policy']} simulated whole:"
        if "jct_s" in check:
            print(f"{head} JCT {check['jct_s']:.1f} s, on its slice {check['sliced']:.1f} s ({100 * check['slice_error']:+.1f}%)")
        else:
            probes = ", ".join(
                f"{p['rate']:.1f} APS {'passed' if p['passed'] else 'failed'} (slice: {'passed' if p['slice_passed'] else 'failed'})"
                for p in check["probes"]
            )
            print(f"{head} {probes}: {'agrees' if check['agrees'] else 'DISAGREES'}")
    for ph in result["phases"] or []:
        print(
            f"{ph['phase']}: best {ph['best']} ({ph['best_jct_s']:.1f} s) vs {ph['static']} ({ph['static_jct_s']:.1f} s): "
            f"{100 * ph['gain']:.1f}% shorter"
        )
    sliced = (
        f"slices of {result['slicing']['min_nodes']}-{result['slicing']['max_nodes']} nodes" if result["slicing"] else "every split whole"
    )
    print(
        f"{result['simulated']} splits ({result['search']}, {nodes - 1} per policy, {sliced}) in {result['runs']} runs, "
        f"{result['jobs']} jobs: wall {result['wall_s']:.1f} s, CPU {result['cpu_s']:.1f} s"
    )
