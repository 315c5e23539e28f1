"""``dualpath sim paper``: the paper's figures next to the simulator's, one row each.

Every row is ``{name, paper, sim, ratio, note}`` with ``ratio = sim / paper``. Where the paper
gives a range, ``paper`` is its middle and the note says whether the simulated figure is
inside. A row more than 15% off (or outside its range) carries a note saying why (``NOTES``)
and what binds in the simulated runs it comes from: each engine kind's busy share and the
storage NICs' utilisation. The table opens with PAPER.md's cache-compute rows, from the cost
model alone; the result carries the calibration every row uses (``dualpath.cost.calibration``).

Three sizes (``--size``):

- ``quick`` (CI: seconds): small clusters that are not storage-bound; checks the plumbing only.
- ``reduced`` (the default): the paper's clusters and agent counts, every agent's whole 64K
  trajectory (offline: all agents start at 0; online: Poisson arrivals, each agent running its
  trajectory back to back, attainment counted in the steady state after the first agents'
  lifetime); the DS 27B topologies at four batch sizes (the paper's ranges, averages and maxima
  are over batch sizes); the scale rows at 8P16D.
- ``full``: the same with the paper's scale runs: 48P96D with 48K agents against 2P4D with 2K,
  and 44P88D online against 2P4D.

The runs go to a process pool (``--jobs``, default every core), the largest first, with a
progress line on stderr as each ends. They are independent but one: the online scale sweep starts
at 2P4D's answer times the node ratio, so it waits for 2P4D's sweep (``Run.after``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import NamedTuple

from dualpath.cost import calibration
from dualpath.sim.config import SimConfig
from dualpath.sim.experiments import run_offline, sweep_online
from dualpath.sim.workload import Workload

__all__ = ["CACHE_COMPUTE", "SIZES", "Size", "cache_compute_rows", "main", "paper_rows"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Size:
    agents_660b: int  # 2P4D offline
    agents_27b: tuple[int, ...]  # DS 27B batch sizes, the same agents on 1P1D, 2P1D and 1P2D
    turns: int | None  # offline turns per agent (None: whole trajectories)
    start_at: float
    scale_to: tuple[int, int, int]  # (prefill nodes, decode nodes, agent multiple) of the offline scale run
    online_turns: int | None
    online_start_at: float
    online_duration: float  # arrivals last this long
    online_warmup: float  # attainment counts turns submitted after this (the ramp-up of whole trajectories)
    probes: int
    online_scale_to: tuple[int, int]


SIZES = {
    "quick": Size(
        agents_660b=96,
        agents_27b=(24, 48),
        turns=2,
        start_at=0.5,
        scale_to=(4, 8, 2),
        online_turns=2,
        online_start_at=0.5,
        online_duration=30.0,
        online_warmup=0.0,
        probes=3,
        online_scale_to=(4, 8),
    ),
    "reduced": Size(
        agents_660b=2048,
        agents_27b=(128, 256, 512, 1024),
        turns=None,
        start_at=0.0,
        scale_to=(8, 16, 4),
        online_turns=None,
        online_start_at=0.0,
        online_duration=2400.0,
        online_warmup=1200.0,
        probes=10,
        online_scale_to=(8, 16),
    ),
    "full": Size(
        agents_660b=2048,
        agents_27b=(128, 256, 512, 1024),
        turns=None,
        start_at=0.0,
        scale_to=(48, 96, 24),
        online_turns=None,
        online_start_at=0.0,
        online_duration=2400.0,
        online_warmup=1200.0,
        probes=10,
        online_scale_to=(44, 88),
    ),
}

HEARTBEAT_S = 60.0  # a progress line at least this often while runs go on
ONLINE_DRAIN_S = 60.0  # an online probe stops this long after its last arrival (run_online)
ONLINE_TOLERANCE = 0.05  # a sweep stops once its highest pass and lowest failure are this close
# A sweep starts at the rate that saturates the storage NICs its mode reads through
# (_start_rate), which lands within ~25% of the answer, so it steps by 1.25x, not 2x, until it
# has a pass and a failure: fewer probes, and no probe at twice the answer (the most costly).
ONLINE_STEP = 1.25
SLO_TTFT_S, SLO_TPOT_S = 4.0, 0.05

# Why a row is off, where that is known; the binding resources measured in the row's runs are
# appended to the note by paper_rows.
NOTES = {
    "ds660b_2p4d_dualpath_over_basic": "the quick size runs a few turns per agent: the JCT is then set by the agents with the "
    "longest generations (decode-bound, not SNIC-bound)",
    "ds660b_2p4d_dualpath_over_oracle": "the paper says 'close to Oracle' without a figure: the row compares with 1.0. "
    "The JCT is the last agent's, its turns one after another, and each of them read on the decode side pays the "
    "fitted de_snic_read_share (chosen from the 27B P/D rows); with decode nodes reading at the line rate the row "
    "sits at the band's edge. The 27B rows and this one ask for different shares; docs/paper.md gives both figures",
    "ablation_layerwise_jct_reduction_pct": "the simulated Basic is pinned at the prefill nodes' SNICs, which layer-wise prefill "
    "does not touch (its loads come from the DRAM buffer over a CNIC 8x the GPU's share of the SNIC); the paper's "
    "reason (a prefill batch without it must hold every layer's KV in HBM) caps no batch here: the 300 ms quota "
    "admits fewer tokens than HBM holds, and the prefill engines are mostly idle. An earlier 16.7% (six turns per "
    "agent, before f60a855) came from refused decode-buffer reservations and their back-off, which Basic without "
    "layer-wise prefill met more often (its decode slots are held through loads, compute and stores in turn), not "
    "from layer-wise prefill: docs/paper.md gives the measurements",
    "ablation_dual_path_jct_reduction_pct": "follows the headline ratio (same runs)",
    "ablation_scheduler_jct_reduction_pct": "follows the headline ratio (same runs)",
    "snic_max_over_avg_round_robin": "round robin reads every other request on the prefill side: with P < D prefill nodes "
    "each prefill node reads (P + D) / (2P) times the average, the decode nodes less; the figure follows P/D",
    "snic_max_over_avg_dualpath": "quick size: too few reads for a stable figure",
    "ds27b_1p1d_dualpath_over_basic": "quick size: the cluster is not storage-bound",
    "ds27b_1p1d_dualpath_over_oracle": "DualPath is bound by the two SNICs (its JCT is the trajectories' hit bytes over "
    "both nodes' storage NICs) while Oracle is bound by decode, so the row follows the 27B's decode step: the fitted "
    "calibration ds27b_decode_per_request_s (the paper gives no compute figure for its internal 27B). With a roofline "
    "step alone Oracle is ~3x faster and the row 3.2-5.7x; docs/paper.md gives the measurements",
    "pd_speedup_average": "the speedup follows how storage-bound the cluster is at the simulated batch sizes and the "
    "decode nodes' read rate (the fitted calibration de_snic_read_share)",
    "pd_speedup_max": "the speedup follows how storage-bound the cluster is at the simulated batch sizes and the "
    "decode nodes' read rate (the fitted calibration de_snic_read_share, chosen for this row)",
    "dualpath_2p1d_over_dualpath_1p2d": "small sizes: JCT is set by a few slow agents, not by storage bandwidth",
    "basic_1p1d_over_basic_1p2d": "small sizes: JCT is set by a few slow agents, not by storage bandwidth",
    "attention_max_over_avg_first_5pct": "small sizes: a few batches in the first 5% of the job",
    "append_sweep_min": "follows the headline ratio (same configuration, appends x0.5/x1/x2)",
    "append_sweep_max": "follows the headline ratio (same configuration, appends x0.5/x1/x2)",
    "scale_offline_jct_ratio": "the larger cluster runs proportionally more agents; JCT is set by the slowest agents",
    "online_ds27b_aps_ratio": "Basic is bound by storage-side TTFT queueing; DualPath adds the decode node's SNIC at the "
    "fitted de_snic_read_share of its rate: see the sweep's best point for which SLO binds the simulated DualPath (its "
    "decode step includes the fitted ds27b_decode_per_request_s)",
    "online_ds660b_aps_ratio": "Basic is bound by the prefill nodes' SNICs (TTFT queueing) as in the paper; see the "
    "sweep's best point for which SLO binds the simulated DualPath (TTFT, or TPOT, which counts the wait for decode "
    "HBM) against the paper's DualPath at 0.4 APS (TTFT 1.74 s, TPOT 39 ms: a prefill-side limit)",
    "online_scale_aps_ratio": "the sweep brackets max APS within 5%; ratios carry that error twice",
}


def _row(name: str, paper: float, sim: float | None, note: str = "", lo: float | None = None, hi: float | None = None) -> dict:
    ratio = sim / paper if sim is not None and paper else None
    inside = None
    if lo is not None and hi is not None and sim is not None:
        inside = lo <= sim <= hi
        note = (note + "; " if note else "") + f"paper range {lo:g}-{hi:g}: {'inside' if inside else 'outside'}"
    off = (not inside) if inside is not None else ratio is None or abs(ratio - 1) > 0.15
    if off:
        why = NOTES.get(name, "differs by more than 15%: see the report")
        note = f"{note}; >15%: {why}" if note else f">15%: {why}"
    row = {"name": name, "paper": paper, "sim": sim, "ratio": ratio, "within": not off, "note": note}
    if lo is not None and hi is not None:
        row["range"] = [lo, hi]  # the paper's range; ``paper`` is its middle
    return row


# PAPER.md's cache-compute table (GB of KV loaded per PFLOP computed, append 429): the low end
# of each 16K-64K range is the 16K figure, the high end the 64K one (the ratio rises with context).
CACHE_COMPUTE = (
    ("qwen32b", 16, 117.0),
    ("qwen32b", 64, 267.0),
    ("ds660b", 16, 13.0),
    ("ds660b", 32, 22.0),
    ("ds660b", 64, 36.0),
    ("dsv3", 16, 4.8),
    ("dsv3", 64, 5.8),
)


def cache_compute_rows() -> list[dict]:
    """The cache-compute table from the cost model (targets read from their config.json)."""
    from dualpath.cost import cost_model

    return [
        _row(f"cache_compute_{t}_{k}k_gb_per_pflop", paper, cost_model(t).cache_compute_ratio(k * 1024), "append 429 tokens")
        for t, k, paper in CACHE_COMPUTE
    ]


# -- the runs -------------------------------------------------------------------------------
# A run is (key, function, keyword arguments, weight): ``weight`` estimates its CPU seconds
# (one core, compiled), so the pool starts the largest first and the progress bar moves by it.


# Decode step time beyond the roofline per running request, per target (calibration
# ``ds27b_decode_per_request_s``: fitted, the paper gives no compute figure for its 27B).
DECODE_PER_REQUEST_S = {"ds27b": calibration.value("ds27b_decode_per_request_s")}


def _config(target: str, p: int, d: int, decode_ep: int, mode: str = "dualpath") -> SimConfig:
    """A table run's cluster: the target's decode time beyond its roofline added per running
    request (``DECODE_PER_REQUEST_S``), the decode nodes reading storage at the calibration's
    ``de_snic_read_share`` of the SNIC rate."""
    extra = DECODE_PER_REQUEST_S.get(target, 0.0)
    return SimConfig(
        target=target,
        prefill_nodes=p,
        decode_nodes=d,
        decode_ep=decode_ep,
        mode=mode,
        decode_host_per_request_s=extra,
        de_read_share=calibration.value("de_snic_read_share"),
    )


def _offline_run(target: str, p: int, d: int, agents: int, mode: str, turns: int | None, start_at: float, **extra) -> dict:
    decode_ep = extra.pop("decode_ep", 0)
    cfg = _config(target, p, d, decode_ep)
    w = Workload(dataset="64k", agents=agents, turns=turns, start_at=start_at, **extra)
    row = run_offline(cfg, w, [mode], progress=False)["modes"][mode]
    row.pop("snic_series", None)  # not needed by any row; keeps what crosses the pool small
    return row


def _online_run(
    target: str, p: int, d: int, mode: str, size: Size, start_rate: float, decode_ep: int = 0, jobs: int = 1, step: float = ONLINE_STEP
) -> dict:
    cfg = _config(target, p, d, decode_ep, mode)
    w = Workload(dataset="64k", agents=1 << 20, turns=size.online_turns, start_at=size.online_start_at, duration_s=size.online_duration)
    return sweep_online(
        cfg,
        w,
        slo_ttft=SLO_TTFT_S,
        slo_tpot=SLO_TPOT_S,
        start_rate=start_rate,
        probes=size.probes,
        tolerance=ONLINE_TOLERANCE,
        step=step,
        jobs=jobs,
        warmup_s=size.online_warmup,
        drain_s=ONLINE_DRAIN_S if size.online_turns is None else float("inf"),
        tpot_after_second=True,  # the paper reports TTST beside TPOT: its TPOT is the pace after the second token
    )


def _start_rate(target: str, p: int, d: int, mode: str, size: Size) -> float:
    """Where an APS sweep starts: about the rate at which the storage NICs that ``mode`` reads
    through (the prefill nodes', or every node's) would be saturated by agents of the 64K set
    (the sweep doubles or halves from there)."""
    from dualpath.cost import get_target

    nodes = p if mode == "basic" else p + d
    snic = SimConfig(target=target, prefill_nodes=p).snic_bytes_per_s()
    if size.online_turns is None:  # whole trajectories: ~157 turns of ~32.7K hit tokens, ~8 s each
        return nodes * snic / (32_721 * get_target(target).kv_bytes_per_token()) / 157
    return 0.5 * nodes * snic / (45_000 * get_target(target).kv_bytes_per_token()) / size.online_turns


class Run(NamedTuple):
    """One run of the table. ``after``: the key of a run whose result this one's arguments need,
    and the function that sets them from it (the run starts once that result is in)."""

    key: str
    fn: Callable[..., dict]
    kw: dict
    weight: float  # its CPU seconds, estimated (one core, compiled)
    after: tuple[str, Callable[[dict, dict], dict]] | None = None


def _scaled_start(factor: float) -> Callable[[dict, dict], dict]:
    """A scale sweep's arguments from its small cluster's sweep: start at the small cluster's
    highest pass times ``factor`` (the node ratio: the rate if throughput scales with nodes) and
    step by the tolerance, so a cluster that scales linearly is bracketed in one round of two
    probes (and one that does not, a round per 5% it is off)."""

    def update(kw: dict, small: dict) -> dict:
        if small.get("max_aps"):
            return {**kw, "start_rate": small["max_aps"] * factor, "step": 1.0 + ONLINE_TOLERANCE}
        return kw  # the small sweep found no passing rate: keep the SNIC-saturation start

    return update


def _runs(size: Size, online: bool, offline: bool, jobs: int = 1) -> list[Run]:
    """Every run of the table with its expected cost, the costliest first. The online scale run's
    sweep is the longest of all: it starts from 2P4D's answer (``_scaled_start``) once that is in,
    and probes ``jobs`` rates at once (its own processes, beside the pool's)."""
    runs: list[Run] = []
    common = {"turns": size.turns, "start_at": size.start_at}
    if offline:
        n = size.agents_660b
        for mode in ("basic-nolw", "basic", "dualpath-rr", "dualpath", "oracle"):
            kw = {"target": "ds660b", "p": 2, "d": 4, "agents": n, "mode": mode, **common}
            runs.append(Run(f"ds660b 2P4D {mode}", _offline_run, kw, n / 250))
        for factor in (0.5, 2.0):
            for mode in ("basic", "dualpath"):
                kw = {"target": "ds660b", "p": 2, "d": 4, "agents": n, "mode": mode, "append_scale": factor, **common}
                runs.append(Run(f"ds660b 2P4D {mode} appends x{factor:g}", _offline_run, kw, n / 250))
        p, d, k = size.scale_to
        kw = {"target": "ds660b", "p": p, "d": d, "agents": n * k, "mode": "dualpath", "decode_ep": 32, **common}  # 2P4D's decode EP group
        runs.append(Run(f"ds660b {p}P{d}D dualpath", _offline_run, kw, n * k / 250 * (1 + p / 12)))
        for agents in size.agents_27b:
            for p, d in ((1, 1), (2, 1), (1, 2)):
                for mode in ("basic", "dualpath", "oracle") if (p, d) == (1, 1) else ("basic", "dualpath"):
                    kw = {"target": "ds27b", "p": p, "d": d, "agents": agents, "mode": mode, **common}
                    runs.append(Run(f"ds27b {p}P{d}D {mode} {agents}", _offline_run, kw, agents / 250))
    if online:
        scale = size.online_duration / 40 if size.online_turns is None else size.online_duration / 300
        big = size.online_scale_to
        for target, p, d, modes in (
            ("ds27b", 1, 1, ("basic", "dualpath")),
            ("ds660b", 2, 4, ("basic", "dualpath")),
            ("ds660b", *big, ("dualpath",)),
        ):
            for mode in modes:
                sweep = {"target": target, "p": p, "d": d, "mode": mode, "size": size, "start_rate": _start_rate(target, p, d, mode, size)}
                after = None
                if (p, d) == big:  # replicates 2P4D's decode EP group, as the offline scale run does
                    sweep |= {"decode_ep": 32, "jobs": jobs}
                    after = ("online ds660b 2P4D dualpath", _scaled_start(p / 2))
                runs.append(Run(f"online {target} {p}P{d}D {mode}", _online_run, sweep, scale * p / 2 * (1 + p / 12), after))
    return sorted(runs, key=lambda r: -r.weight)


def _execute(runs: list[Run], jobs: int, say: Callable[[str], None] | None) -> dict[str, dict]:
    """Every run, ``jobs`` at a time (1: in this process), with a progress line per run. A run
    with ``after`` starts once the run it names has ended; the runs start in order of their
    cost plus that of the runs waiting on them (the longest chain first)."""
    out: dict[str, dict] = {}
    t0 = time.perf_counter()
    total_weight = sum(r.weight for r in runs) or 1.0
    done_weight = 0.0
    chain = {r.key: r.weight + sum(w.weight for w in runs if w.after and w.after[0] == r.key) for r in runs}
    waiting = [r for r in runs if r.after]
    ready = [r for r in runs if not r.after]

    def progress(run: Run, result: dict) -> None:
        nonlocal done_weight
        done_weight += run.weight
        if say:
            bar = "#" * int(30 * done_weight / total_weight)
            elapsed = time.perf_counter() - t0
            say(f"[paper] [{bar:<30}] {len(out)}/{len(runs)} runs, {elapsed:6.0f} s: {run.key} ({result.get('cpu_s', 0):.0f} s CPU)")

    def release() -> None:
        """The waiting runs whose dependency has ended join the ready ones, their arguments set
        from its result; the longest chain goes first."""
        for r in [r for r in waiting if r.after and r.after[0] in out]:
            waiting.remove(r)
            assert r.after is not None
            ready.append(r._replace(kw=r.after[1](r.kw, out[r.after[0]])))
        ready.sort(key=lambda r: -chain[r.key])

    def heartbeat() -> None:  # the largest runs take minutes: say that they are still going
        if say:
            bar = "#" * int(30 * done_weight / total_weight)
            say(f"[paper] [{bar:<30}] {len(out)}/{len(runs)} runs, {time.perf_counter() - t0:6.0f} s")

    release()
    if jobs <= 1:
        while ready:
            run = ready.pop(0)
            out[run.key] = _timed(run.fn, run.kw)
            progress(run, out[run.key])
            release()
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures: dict = {}
            while True:
                while len(futures) < jobs and ready:  # a slot at a time: a released run does not queue behind the rest
                    run = ready.pop(0)
                    futures[pool.submit(_timed, run.fn, run.kw)] = run
                if not futures:
                    break
                done, _ = wait(futures, timeout=HEARTBEAT_S, return_when=FIRST_COMPLETED)
                for f in done:
                    run = futures.pop(f)
                    out[run.key] = f.result()
                    progress(run, out[run.key])
                release()
                if not done:
                    heartbeat()
    if waiting:
        raise RuntimeError(f"runs wait on runs that are not in the table: {[r.after[0] for r in waiting if r.after]}")
    return out


def _timed(fn: Callable[..., dict], kw: dict) -> dict:
    """``fn(**kw)`` in a pool worker, with the CPU seconds it took (``cpu_s``)."""
    c0 = time.process_time()
    result = fn(**kw)
    result["cpu_s"] = max(time.process_time() - c0, result.get("cpu_s", 0.0))  # a parallel sweep's probes ran elsewhere
    return result


def _binding(rows: dict[str, dict]) -> str:
    """What binds in these runs: each mode's prefill / decode engine busy shares and the prefill and
    decode nodes' SNIC read utilisation."""
    parts = []
    for key, r in rows.items():
        parts.append(
            f"{key}: prefill {r['prefill_busy']:.0%} decode {r['decode_busy']:.0%} busy, "
            f"SNIC prefill {r['snic_util_prefill']:.0%} decode {r['snic_util_decode']:.0%}"
        )
    return "binds: " + "; ".join(parts)


# -- the rows -------------------------------------------------------------------------------


def paper_rows(size: Size, say=None, *, online: bool = True, offline: bool = True, jobs: int = 1) -> tuple[list[dict], dict]:
    """Run every experiment of ``size`` (``jobs`` at a time) and return the rows (see the module
    docstring) and the scale runs' absolute figures beside the paper's."""
    res = _execute(_runs(size, online, offline, jobs), jobs, say)
    rows: list[dict] = cache_compute_rows() if offline else []
    absolute: dict = {"_cpu_s": [r.get("cpu_s", 0.0) for r in res.values()] if jobs > 1 else []}
    if offline:
        rows += _offline_rows(size, res, absolute)
    if online:
        rows += _online_rows(size, res, absolute)
    return rows, absolute


def _with_binding(row: dict, runs: dict[str, dict]) -> dict:
    if not row["within"]:
        row["note"] += "; " + _binding(runs)
    return row


def _offline_rows(size: Size, res: dict[str, dict], absolute: dict) -> list[dict]:
    rows = []
    j = {k: r["jct_s"] for k, r in res.items() if "jct_s" in r and not k.startswith("online")}
    big = "ds660b 2P4D "
    r = {m: res[big + m] for m in ("basic-nolw", "basic", "dualpath-rr", "dualpath", "oracle")}
    rows.append(_with_binding(_row("ds660b_2p4d_dualpath_over_basic", 1.87, j[big + "basic"] / j[big + "dualpath"]), r))
    rows.append(
        _with_binding(
            _row("ds660b_2p4d_dualpath_over_oracle", 1.0, j[big + "dualpath"] / j[big + "oracle"], "paper: 'close to Oracle'; " + _tail(r)),
            {k: r[k] for k in ("dualpath", "oracle")},
        )
    )
    base = j[big + "basic-nolw"]
    for mode, paper, label in (("basic", 17.21, "layerwise"), ("dualpath-rr", 38.19, "dual_path"), ("dualpath", 45.62, "scheduler")):
        row = _row(
            f"ablation_{label}_jct_reduction_pct",
            paper,
            100 * (1 - j[big + mode] / base),
            "cumulative JCT reduction vs Basic without layer-wise prefill",
        )
        rows.append(_with_binding(row, {k: r[k] for k in ("basic-nolw", mode)}))
    rr, dp = r["dualpath-rr"], r["dualpath"]
    rows.append(
        _row(
            "snic_max_over_avg_round_robin",
            1.53,
            rr["snic_bytes_max_over_avg"],
            f"dualpath-rr, bytes read per node over the job (per time bin, averaged: {rr['snic_max_over_avg_windowed']:.2f})",
        )
    )
    rows.append(
        _row(
            "snic_max_over_avg_dualpath",
            1.18,
            dp["snic_bytes_max_over_avg"],
            f"bytes read per node over the job (per time bin, averaged: {dp['snic_max_over_avg_windowed']:.2f})",
        )
    )
    rows.append(_row("attention_max_over_avg_first_5pct", 1.06, dp["attention_max_over_avg_early"], "paper: <= 1.06"))
    # -- DS 27B: 1P1D / 2P1D / 1P2D at every batch size ----------------------------------------
    sizes = size.agents_27b
    top = sizes[-1]

    def jct(p: int, d: int, mode: str, n: int = top) -> float:
        return j[f"ds27b {p}P{d}D {mode} {n}"]

    def runs27(p: int, d: int, modes: tuple[str, ...], n: int = top) -> dict:
        return {f"{p}P{d}D {m} {n}": res[f"ds27b {p}P{d}D {m} {n}"] for m in modes}

    over_basic = [jct(1, 1, "basic", n) / jct(1, 1, "dualpath", n) for n in sizes]
    rows.append(
        _with_binding(
            _row("ds27b_1p1d_dualpath_over_basic", 1.78, max(over_basic), f"paper: 'up to'; the most over {_agents(sizes)}"),
            runs27(1, 1, ("basic", "dualpath")),
        )
    )
    over_oracle = [jct(1, 1, "dualpath", n) / jct(1, 1, "oracle", n) for n in sizes]
    lo, hi = min(over_oracle), max(over_oracle)
    row = _row("ds27b_1p1d_dualpath_over_oracle", 1.47, hi, f"the most over {_agents(sizes)} (the least: {lo:.2f})", lo=1.09, hi=1.85)
    if row["within"] and lo < 1.09:
        row["within"] = False
    rows.append(_with_binding(row, runs27(1, 1, ("dualpath", "oracle"))))
    for name, a, b, text in (
        ("basic_1p1d_over_basic_1p2d", (1, 1, "basic"), (1, 2, "basic"), "paper: Basic 1P1D ~ Basic 1P2D"),
        ("dualpath_1p1d_over_basic_2p1d", (1, 1, "dualpath"), (2, 1, "basic"), "paper: DualPath 1P1D ~ Basic 2P1D"),
        ("dualpath_2p1d_over_dualpath_1p2d", (2, 1, "dualpath"), (1, 2, "dualpath"), "paper: DualPath 2P1D ~ DualPath 1P2D"),
    ):
        rows.append(_row(name, 1.0, jct(*a) / jct(*b), f"{text}; {top} agents"))
    speedups = [jct(p, d, "basic", n) / jct(p, d, "dualpath", n) for n in sizes for p, d in ((1, 1), (2, 1), (1, 2))]
    where = f"ds27b over 1P1D/2P1D/1P2D x {_agents(sizes)}"
    pd_runs = {**runs27(1, 1, ("basic", "dualpath")), **runs27(2, 1, ("basic", "dualpath")), **runs27(1, 2, ("basic", "dualpath"))}
    rows.append(_with_binding(_row("pd_speedup_average", 1.64, sum(speedups) / len(speedups), where), pd_runs))
    rows.append(_with_binding(_row("pd_speedup_max", 2.46, max(speedups), where), pd_runs))
    # -- append-length sweep (DS 660B 2P4D) ---------------------------------------------------
    sweep = [j[f"{big}basic appends x{f:g}"] / j[f"{big}dualpath appends x{f:g}"] for f in (0.5, 2.0)]
    sweep.append(j[big + "basic"] / j[big + "dualpath"])
    rows.append(_row("append_sweep_min", 1.82, min(sweep), "appends x0.5, x1, x2"))
    rows.append(_row("append_sweep_max", 1.99, max(sweep), "appends x0.5, x1, x2"))
    # -- offline scale: 2P4D -> larger, agents in proportion ------------------------------------
    p, d, k = size.scale_to
    big_jct, small_jct = j[f"ds660b {p}P{d}D dualpath"], j[big + "dualpath"]
    absolute["offline_scale"] = {
        "topology": f"{p}P{d}D",
        "agents": size.agents_660b * k,
        "jct_s": big_jct,
        "jct_2p4d_s": small_jct,
        "paper": {"topology": "48P96D", "agents": 48 * 1024, "jct_s": 3201.0, "jct_2p4d_s": 3167.0},
    }
    rows.append(
        _row(
            "scale_offline_jct_ratio",
            3201 / 3167,
            big_jct / small_jct,
            f"JCT {p}P{d}D with {size.agents_660b * k} agents {big_jct:,.0f} s / 2P4D with {size.agents_660b} {small_jct:,.0f} s "
            "(paper 48P96D with 48K: 3,201 s / 3,167 s)",
        )
    )
    return rows


def _tail(runs: dict[str, dict]) -> str:
    """Where each mode's JCT comes from: the median and last agents' ends, and the last agent's
    turns and mean time per turn (a JCT is its last agent's: ``report.agent_ends``)."""
    parts = []
    for mode in ("dualpath", "oracle"):
        ends, last = runs[mode].get("agent_end_s"), runs[mode].get("last_agent")
        if ends and last:
            parts.append(
                f"{mode}: half the agents done at {ends['p50']:,.0f} s, the last at {ends['max']:,.0f} s "
                f"({last['turns']} turns, {1e3 * last['turn_s']:.0f} ms each)"
            )
    return "; ".join(parts)


def _agents(sizes: tuple[int, ...]) -> str:
    return "/".join(str(n) for n in sizes) + " agents"


def _latencies(sweep: dict) -> dict:
    """A sweep's answer: the highest passing rate with its latencies, and the lowest failing rate
    (the answer lies between them), each with its SLO attainment."""
    best = sweep.get("best") or {}
    failures = [p for p in sweep.get("points", []) if not p["passed"]]
    fail = min(failures, key=lambda p: p["rate"]) if failures else {}
    return {
        "aps": sweep.get("max_aps"),
        "attainment": best.get("attainment"),
        "fails_at_aps": fail.get("rate"),
        "attainment_there": fail.get("attainment"),
        "ttft_s": best.get("ttft_mean"),
        "ttst_s": best.get("ttst_mean"),
        "tpot_s": best.get("pace_mean"),  # after the second token, as the paper reports it beside TTST
        "tpot_from_first_s": best.get("tpot_mean"),
    }


def _bracket(name: str, sweep: dict) -> str:
    """Where a sweep's answer lies: its highest pass and lowest failure, with their attainments."""
    text = f"{name} passes at {sweep['aps'] or 0:.3g} APS ({_share(sweep['attainment'])} within the SLO)"
    if sweep["fails_at_aps"]:
        text += f" and fails at {sweep['fails_at_aps']:.3g} ({_share(sweep['attainment_there'])})"
    return text


def _share(attainment: float | None) -> str:
    return "-" if attainment is None else f"{attainment:.1%}"


def _ratio_range(big: dict, small: dict) -> str:
    """The scale ratio's range from both brackets: big's pass over small's failure to big's failure
    over small's pass."""
    if not (big["aps"] and small["aps"] and big["fails_at_aps"] and small["fails_at_aps"]):
        return ""
    return f": the ratio lies in {big['aps'] / small['fails_at_aps']:.3g}-{big['fails_at_aps'] / small['aps']:.3g}"


def _online_rows(size: Size, res: dict[str, dict], absolute: dict) -> list[dict]:
    rows = []
    for target, p, d, paper in (("ds27b", 1, 1, 1.67), ("ds660b", 2, 4, 2.25)):
        b, dp = (res[f"online {target} {p}P{d}D {m}"] for m in ("basic", "dualpath"))
        lb, ld = _latencies(b), _latencies(dp)
        text = f"{p}P{d}D, SLO TTFT 4 s, TPOT 50 ms; max APS basic {lb['aps'] or 0:.3g}, dualpath {ld['aps'] or 0:.3g}"
        ratio = ld["aps"] / lb["aps"] if lb["aps"] and ld["aps"] else None
        row = _row(f"online_{target}_aps_ratio", paper, ratio, text)
        if not row["within"]:
            row["note"] += f"; binds: basic {_online_binding(b)}; dualpath {_online_binding(dp)}"
        rows.append(row)
    p, d = size.online_scale_to
    big, small = _latencies(res[f"online ds660b {p}P{d}D dualpath"]), _latencies(res["online ds660b 2P4D dualpath"])
    absolute["online_scale"] = {
        f"{p}P{d}D": big,
        "2P4D": small,
        "paper": {
            "44P88D": {"aps": 8.8, "ttft_s": 1.847, "ttst_s": 0.194, "tpot_s": 0.036},
            "2P4D": {"aps": 0.4, "ttft_s": 1.739, "ttst_s": 0.228, "tpot_s": 0.039},
        },
    }
    rows.append(
        _row(
            "online_scale_aps_ratio",
            p / 2,
            big["aps"] / small["aps"] if big["aps"] and small["aps"] else None,
            f"{p}P{d}D / 2P4D max APS (paper 44P88D / 2P4D: 8.8 / 0.4 = 22x, the node ratio); {_bracket(f'{p}P{d}D', big)}, "
            f"{_bracket('2P4D', small)}{_ratio_range(big, small)}; TTFT/TTST/TPOT at max APS "
            f"{p}P{d}D {_lat(big)}, 2P4D {_lat(small)} (paper 44P88D 1.847/0.194/0.036 s, 2P4D 1.739/0.228/0.039 s)",
        )
    )
    return rows


def _online_binding(sweep: dict) -> str:
    """At the highest passing rate: latencies, busy shares, SNIC; at the lowest failing one: which
    part of the SLO the turns missed."""
    best = sweep.get("best") or {}
    fails = [p for p in sweep.get("points", []) if not p["passed"] and p["rate"] > (sweep.get("max_aps") or 0)]
    text = (
        f"at {sweep.get('max_aps') or 0:.3g} APS TTFT/TTST/TPOT {_lat(_latencies(sweep))}, prefill {best.get('prefill_busy', 0):.0%} "
        f"decode {best.get('decode_busy', 0):.0%} busy, SNIC prefill {best.get('snic_util_prefill', 0):.0%} "
        f"decode {best.get('snic_util_decode', 0):.0%}"
    )
    if fails:
        f = min(fails, key=lambda p: p["rate"])
        miss = f.get("slo_misses") or {}
        text += f"; at {f['rate']:.3g} APS {miss.get('ttft') or 0:.1%} of turns over the TTFT bound, {miss.get('tpot') or 0:.1%} over TPOT"
    return text


def _lat(x: dict) -> str:
    f = lambda v: f"{v:.3f}" if isinstance(v, float) else "-"
    return f"{f(x['ttft_s'])}/{f(x['ttst_s'])}/{f(x['tpot_s'])} s"


def format_rows(rows: list[dict]) -> str:
    out = [f"{'figure':<40} {'paper':>8} {'sim':>8} {'ratio':>6}  note"]
    for r in rows:
        f = lambda v: f"{v:.3g}" if isinstance(v, (int, float)) else "-"
        out.append(f"{r['name']:<40} {f(r['paper']):>8} {f(r['sim']):>8} {f(r['ratio']):>6}  {r['note']}")
    inside = sum(r["within"] for r in rows)
    out.append(f"{inside} of {len(rows)} rows within 15% of the paper (or inside its range)")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dualpath sim paper", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--size", choices=tuple(SIZES), default="reduced", help="quick (CI), reduced (the default) or full (the paper's scale runs)"
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="the same as --size quick")
    g.add_argument("--full", action="store_true", help="the same as --size full")
    p.add_argument("--jobs", type=int, default=0, help="runs at once in a process pool (default: every core; 1: in this process)")
    p.add_argument("--json", action="store_true", help="print the rows and the calibration as JSON")
    p.add_argument("--out", default="", help="write paper.json (and paper.png, with matplotlib) here")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--offline-only", action="store_true", help="skip the online (APS) rows")
    only.add_argument("--online-only", action="store_true", help="only the online (APS) rows")
    ns = p.parse_args(argv)
    name = "quick" if ns.quick else "full" if ns.full else ns.size
    jobs = ns.jobs or os.cpu_count() or 1
    say = lambda msg: print(msg, file=sys.stderr, flush=True)
    t0, c0 = time.perf_counter(), time.process_time()
    rows, absolute = paper_rows(SIZES[name], say, online=not ns.offline_only, offline=not ns.online_only, jobs=jobs)
    wall = time.perf_counter() - t0
    result = {
        "size": name,
        "rows": rows,
        "within": sum(r["within"] for r in rows),
        "absolute": absolute,
        "calibration": calibration.table(),
        "wall_s": wall,
        "cpu_s": time.process_time() - c0 + sum(absolute.pop("_cpu_s", [])),  # this process and every run's
        "jobs": jobs,
    }
    if ns.out:
        from pathlib import Path

        out = Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "paper.json").write_text(json.dumps(result, indent=2))
        try:
            from dualpath.sim.plots import plot_paper

            plot_paper(rows, out / "paper.png")
        except ImportError:  # matplotlib is optional: the JSON is the result
            say("[paper] matplotlib is not installed: no paper.png")
    print(json.dumps(result, indent=2) if ns.json else format_rows(rows) + f"\nwall {wall:.1f} s")
    return 0
