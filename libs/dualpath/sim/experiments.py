"""Runs the command line asks for: offline (JCT per mode) and online (APS within SLO).

``run_offline`` simulates each mode on the same agents (drawn once, copied per mode) and
returns the testbed experiment's result shape (``dualpath experiment offline``): per-mode
rows, the basic/dualpath and dualpath/oracle ratios, the ablation steps when asked.
``run_online`` simulates one arrival rate; ``sweep_online`` searches the highest APS whose
turns meet the SLO with the load generator's own search (``loadgen.sweep.next_rate``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from dualpath.compiled import status as compiled_status
from dualpath.sim import hugepages
from dualpath.sim.config import ABLATION, SimConfig
from dualpath.sim.report import run_figures
from dualpath.sim.simulation import Simulation
from dualpath.sim.workload import Agent, Workload, build_agents
from loadgen.sweep import SweepPlan, SweepState, next_rates, record

__all__ = ["Ticker", "run_offline", "run_online", "sweep_online"]


class Ticker:
    """A progress line on stderr every ``every_s`` wall seconds (``enabled``: auto = a terminal)."""

    def __init__(self, label: str, enabled: bool | None = None, every_s: float = 1.0) -> None:
        self.label = label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.every_s = every_s
        self._last = time.perf_counter()
        self._t0 = self._last

    def __call__(self, sim: Simulation) -> None:
        now = time.perf_counter()
        if not self.enabled or now - self._last < self.every_s:
            return
        self._last = now
        total = len(sim.agents)
        done = sim.agents_done + sim.agents_failed
        bar = "#" * int(20 * done / max(total, 1))
        end = "\r" if sys.stderr.isatty() else "\n"
        print(
            f"{self.label} [{bar:<20}] agents {done}/{total} turns {sim.metrics.turns_done} virtual {sim.loop.now:8.1f}s "
            f"wall {now - self._t0:6.1f}s",
            end=end,
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.enabled and sys.stderr.isatty():
            print(file=sys.stderr)


def _simulate(cfg: SimConfig, workload: Workload, agents: list[Agent], progress: bool | None, until: float = float("inf")) -> Simulation:
    sim = Simulation(cfg, workload, [a.fresh() for a in agents])
    ticker = Ticker(f"[{cfg.mode}]", progress)
    sim.run(until, tick=ticker)
    ticker.close()
    return sim


def run_offline(
    base: SimConfig,
    workload: Workload,
    modes: list[str],
    *,
    ablation: bool = False,
    progress: bool | None = None,
    say: Callable[[str], None] | None = None,
    until: float = float("inf"),
) -> dict:
    """Every mode on the same agents, all started at 0; the result dict (module docstring).
    ``until`` stops each run at that virtual time (a throughput probe: JCT is then not final)."""
    if ablation:
        modes = [*ABLATION, *(m for m in modes if m not in ABLATION)]
    t0 = time.perf_counter()
    agents = build_agents(replace(workload, rate=None), base.block_tokens)
    build_s = time.perf_counter() - t0
    rows = {}
    for mode in modes:
        sim = _simulate(replace(base, mode=mode), workload, agents, progress, until)
        rows[mode] = run_figures(sim)
        rows[mode]["stopped_at"] = None if until == float("inf") else until
        if say:
            say(
                f"[{mode}] JCT {sim.end_time:.1f} s (virtual), {sim.metrics.turns_done} turns, {sim.loop.events} events, "
                f"wall {sim.wall_s:.1f} s, CPU {sim.cpu_s:.1f} s ({1e6 * sim.cpu_s / max(sim.metrics.turns_done, 1):.0f} us per turn)"
            )
    jct = {m: r["jct_s"] for m, r in rows.items()}

    def ratio(a: str, b: str) -> float | None:
        return jct[a] / jct[b] if a in jct and b in jct and jct[b] > 0 else None

    return {
        "target": base.target,
        "topology": base.topology,
        "engines_per_node": base.engines,
        "dataset": workload.dataset,
        "agents": workload.agents,
        "turns": workload.turns,
        "start_at": workload.start_at,
        "seed": workload.seed,
        "modes": rows,
        "ratios": {"basic/dualpath": ratio("basic", "dualpath"), "dualpath/oracle": ratio("dualpath", "oracle")},
        # every node's read rate over the prefill nodes' (Basic's): the most pooling them can gain
        "io_bound": (base.prefill_nodes + base.decode_nodes * base.de_read_share) / base.prefill_nodes,
        "ablation": [{"mode": m, "jct_s": jct[m], "reduction": 1 - jct[m] / jct[ABLATION[0]]} for m in ABLATION] if ablation else None,
        "wall_s": time.perf_counter() - t0,
        "agents_build_s": build_s,
        "code": compiled_status(),  # mypyc extensions or pure Python (same results, not the same speed)
        "huge_pages": hugepages.status(),  # the heap on 2 MiB pages or not (same results, not the same speed)
    }


def run_online(
    cfg: SimConfig,
    workload: Workload,
    *,
    slo_ttft: float,
    slo_tpot: float,
    warmup_s: float = 0.0,
    drain_s: float = float("inf"),
    tpot_after_second: bool = False,
    progress: bool | None = None,
) -> dict:
    """One online run: agents arrive at ``workload.rate`` for ``workload.duration_s``; every
    agent runs its turns (with tool-call pauses) to the end. SLO attainment and the latency
    figures count the turns submitted while arrivals lasted, after ``warmup_s``: agents that
    run whole trajectories live for minutes, so the cluster's load ramps up for that long
    after the first arrival (the paper's steady state is what follows). ``drain_s`` stops the
    run that long after the last arrival instead of running every agent to its end (the turns
    counted finish within seconds when the SLO holds; one still running then is not counted).
    ``tpot_after_second``: the TPOT bound applies to the decode pace after the second token
    (``Metrics.pace``), with TTST a figure of its own, as the paper reports them."""
    if workload.rate is not None and workload.duration_s is not None:
        # only the agents that can arrive in time (a Poisson count stays below mean + 6 sd + 16)
        mean = workload.rate * workload.duration_s
        workload = replace(workload, agents=min(workload.agents, int(mean + 6 * mean**0.5 + 16)))
    agents = build_agents(workload, cfg.block_tokens)
    until = (workload.duration_s or 0.0) + drain_s if workload.duration_s is not None else float("inf")
    sim = _simulate(cfg, workload, agents, progress, until)
    row = run_figures(sim)
    horizon = workload.duration_s or sim.end_time
    attainment = sim.metrics.slo_attainment(slo_ttft, slo_tpot, since=min(warmup_s, horizon), until=horizon, after_second=tpot_after_second)
    row["window_latency_s"] = sim.metrics.window_latency(since=min(warmup_s, horizon), until=horizon)
    row["slo_misses"] = _slo_misses(sim, slo_ttft, slo_tpot, min(warmup_s, horizon), horizon, tpot_after_second)
    row.update(
        {
            "rate": workload.rate,
            "arrived": len(agents),
            "attainment": attainment,
            "achieved_aps": len(agents) / max(a.arrival for a in agents) if agents else 0.0,
        }
    )
    return row


def _slo_misses(
    sim: Simulation, slo_ttft: float, slo_tpot: float, since: float, until: float, after_second: bool = False
) -> dict[str, float | None]:
    """Shares of the window's turns over the TTFT and over the TPOT bound: which part of the SLO binds."""
    import numpy as np

    m = sim.metrics
    sub = np.frombuffer(m.submit, dtype=np.float32)
    keep = (sub >= since) & (sub < until)
    if not keep.any():
        return {"ttft": None, "tpot": None}
    ttft, tpot = (np.frombuffer(a, dtype=np.float32)[keep] for a in (m.ttft, m.pace if after_second else m.tpot))
    return {"ttft": float((ttft > slo_ttft).mean()), "tpot": float((tpot > slo_tpot).mean())}


def sweep_online(
    cfg: SimConfig,
    workload: Workload,
    *,
    slo_ttft: float,
    slo_tpot: float,
    attainment: float = 0.99,
    start_rate: float = 0.5,
    probes: int = 8,
    tolerance: float = 0.05,
    step: float = 2.0,
    jobs: int = 1,
    warmup_s: float = 0.0,
    drain_s: float = float("inf"),
    tpot_after_second: bool = False,
    progress: bool | None = None,
    say: Callable[[str], None] | None = None,
) -> dict:
    """The highest APS whose turns meet the SLO (``attainment`` of them, counted after
    ``warmup_s``: ``run_online``), by the load generator's search (``step``: its factor between
    probes until one passes and one fails; ``jobs`` > 1: that many probes at once, each in its
    own process); every probe reported, the best one's latencies as ``best``."""
    plan, state = SweepPlan(start_rate=start_rate, max_probes=probes, tolerance=tolerance, step=step), SweepState()
    best: dict | None = None
    kw: dict[str, Any] = {
        "slo_ttft": slo_ttft,
        "slo_tpot": slo_tpot,
        "warmup_s": warmup_s,
        "drain_s": drain_s,
        "tpot_after_second": tpot_after_second,
    }
    pool = ProcessPoolExecutor(max_workers=jobs) if jobs > 1 else None
    try:
        while rates := next_rates(plan, state, jobs):
            if pool is None:
                rows = [run_online(cfg, replace(workload, rate=rates[0]), progress=progress, **kw)]
            else:
                futures = [pool.submit(run_online, cfg, replace(workload, rate=r), progress=False, **kw) for r in rates]
                rows = [f.result() for f in futures]
            for rate, row in zip(rates, rows, strict=True):
                point = _probe_point(rate, row, attainment)
                if point["passed"] and rate > (state.best or 0.0):
                    best = point
                record(state, point)
                if say:
                    say(f"[{cfg.mode}] {rate:.3f} APS: attainment {row['attainment']}, {'pass' if point['passed'] else 'fail'}")
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return {"max_aps": state.best, "best": best, "points": state.points, "cpu_s": sum(p["cpu_s"] for p in state.points)}


def _probe_point(rate: float, row: dict, attainment: float) -> dict:
    """One probe of a sweep: whether it met the SLO, its latencies and what was busy."""
    window = row["window_latency_s"]
    return {
        "rate": rate,
        "passed": row["attainment"] is not None and row["attainment"] >= attainment,
        "attainment": row["attainment"],
        "failed_turns": 0,
        "ttft_p50": window["ttft"].get("p50"),
        "tpot_p50": window["tpot"].get("p50"),
        "ttft_mean": window["ttft"].get("mean"),
        "ttst_mean": window["ttst"].get("mean"),
        "tpot_mean": window["tpot"].get("mean"),
        "pace_mean": window["pace"].get("mean"),
        "cpu_s": row["cpu_s"],
        "slo_misses": row["slo_misses"],
        "prefill_busy": row["prefill_busy"],
        "decode_busy": row["decode_busy"],
        "snic_util_prefill": row["snic_util_prefill"],
        "snic_util_decode": row["snic_util_decode"],
    }
