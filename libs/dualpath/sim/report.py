"""The figures of a run, as the testbed experiments report them, and the PNGs.

Per mode: JCT (offline: the last agent's end), TTFT/TTST/TPOT/e2e percentiles, the queueing
and execution shares of TTFT, the cache hit rate, per-node SNIC read utilisation over time
and overall, SNIC bytes max/avg across nodes (whole job, its first 5%, and per time bin averaged over the
job: ``snic_max_over_avg_windowed``), attention time
max/avg across prefill engines in the first 5% of the job (paper §7), event volume, wall
time and peak memory of the simulating process.
"""

from __future__ import annotations

import resource
import sys

from dualpath.policy import max_over_avg
from dualpath.sim.metrics import percentiles
from dualpath.sim.simulation import Simulation

__all__ = ["EARLY_SHARE", "peak_memory_mb", "run_figures"]

EARLY_SHARE = 0.05  # "the first 5% of the job"
SERIES_POINTS = 200  # points of a utilisation curve in result.json


def peak_memory_mb() -> float:
    """Peak resident memory of this process so far, MiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _ratio(values: list[float]) -> float | None:
    return max_over_avg(values) if values and any(v > 0 for v in values) else None


def snic_series(sim: Simulation, end: float) -> tuple[float, dict[str, list[float]]]:
    """Per-node SNIC read utilisation (0..1) of the node's own read rate, on a common grid of
    about ``SERIES_POINTS`` bins."""
    width = max(s.read_link.series.width for s in sim.storage.values())  # type: ignore[union-attr]
    while end / width > SERIES_POINTS:
        width *= 2
    out = {}
    for name, s in sim.storage.items():
        bins = s.read_link.series.rebinned(width, end)  # type: ignore[union-attr]
        cap = s.read_link.capacity  # a decode node's is the SNIC's times SimConfig.de_read_share
        out[name] = [min(1.0, b / width / cap) for b in bins]
    return width, out


def windowed_max_over_avg(series: dict[str, list[float]], end_bin: int | None = None) -> float | None:
    """Mean over time bins of (max / mean across nodes) of the bytes each node read in the
    bin, over the bins where any node read: how unevenly the SNICs are loaded at a time."""
    columns = list(zip(*series.values()))[:end_bin]
    ratios = [max(c) * len(c) / sum(c) for c in columns if sum(c) > 0]
    return sum(ratios) / len(ratios) if ratios else None


def run_figures(sim: Simulation) -> dict:
    """The result row of one finished simulation."""
    m, end = sim.metrics, sim.end_time or sim.loop.now
    early = EARLY_SHARE * end
    ttft, queue = percentiles(m.ttft), percentiles(m.queue)
    node_bytes = {name: s.bytes_read for name, s in sim.storage.items()}
    early_bytes = [s.read_link.series.window(0.0, early) for s in sim.storage.values()]  # type: ignore[union-attr]
    attention_early = [pe.attention.window(0.0, early) for pe in sim.prefill_engines.values()]
    width, series = snic_series(sim, end)
    util = {n: s.bytes_read / max(end, 1e-9) / s.read_link.capacity for n, s in sim.storage.items()}
    span = max(end, 1e-9)
    prefill_busy = [pe.busy_s / span for pe in sim.prefill_engines.values()]
    decode_busy = [de.busy_s / span for de in sim.decode_engines.values()]
    q_share = queue["mean"] / ttft["mean"] if ttft.get("n") and ttft["mean"] > 0 else None
    return {
        "mode": sim.cfg.mode,
        "jct_s": end,
        "agents": len(sim.agents),
        "agents_done": sim.agents_done,
        "agents_failed": sim.agents_failed,
        "turns_completed": m.turns_done,
        "cache_hit_rate": m.hit_tokens / m.prompt_tokens if m.prompt_tokens else None,
        "latency_s": {
            "ttft": ttft,
            "ttft_queue": queue,
            "ttft_exec": percentiles(m.exec),
            "ttst": percentiles(m.ttst),
            "tpot": percentiles(m.tpot),
            "e2e": percentiles(m.e2e),
        },
        "ttft_share": {"queueing": q_share, "execution": None if q_share is None else 1 - q_share},
        "snic_bytes_read": node_bytes,
        "snic_read_utilisation": util,
        "snic_util_max": max(util.values()),
        "snic_util_avg": sum(util.values()) / len(util),
        "snic_util_prefill": _mean([u for n, u in util.items() if n.startswith("p")]),  # the prefill nodes' SNICs
        "snic_util_decode": _mean([u for n, u in util.items() if n.startswith("d")]),
        "snic_bytes_max_over_avg": _ratio(list(node_bytes.values())),
        # what binds: the share of the job each kind of engine computed (a decode engine: had a batch)
        "prefill_busy": sum(prefill_busy) / len(prefill_busy),
        "decode_busy": sum(decode_busy) / len(decode_busy),
        "snic_bytes_max_over_avg_early": _ratio(early_bytes),
        "snic_max_over_avg_windowed": windowed_max_over_avg(series),
        "attention_max_over_avg_early": _ratio(attention_early),
        "snic_series": {"bin_s": width, "utilisation": series},
        "scheduler": {"passes": sim.scheduler.passes, "back_pressure": sim.scheduler.back_pressure, "failures": sim.scheduler.failures},
        "events": sim.loop.events,
        "flows": sim.net.flows_done + sum(s.read_link.flows_done + s.write_link.flows_done for s in sim.storage.values()),
        "wall_s": sim.wall_s,
        "cpu_s": sim.cpu_s,
        "cpu_us_per_turn": 1e6 * sim.cpu_s / max(m.turns_done, 1),
        "peak_memory_mb": peak_memory_mb(),
        "hbm_tokens_per_decode_engine": sim.hbm_tokens,
        "prefetch": sim.prefetch.summary() if sim.prefetch is not None else None,
        **agent_ends(sim.agents),
    }


def agent_ends(agents: list) -> dict:
    """When agents finished (``agent_end_s``: p50, p90, max; offline, the max is the JCT) and
    the last one to finish (``last_agent``: its turns and mean time per turn). An offline JCT
    is one agent's: the longest trajectory's turns run one after another however idle the
    cluster gets, so a per-turn cost it pays (a read, a transfer) sets the JCT's tail."""
    done = [a for a in agents if a.done_at >= 0]
    if not done:
        return {"agent_end_s": None, "last_agent": None}
    ends = sorted(a.done_at for a in done)
    last = max(done, key=lambda a: a.done_at)
    return {
        "agent_end_s": {"p50": ends[len(ends) // 2], "p90": ends[int(0.9 * (len(ends) - 1))], "max": ends[-1]},
        "last_agent": {"index": last.index, "turns": last.turns, "turn_s": (last.done_at - last.arrival) / max(last.turns, 1)},
    }
