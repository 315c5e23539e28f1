"""Figures of a testbed run: JCT, SNIC utilisation and balance, attention balance, overhead."""

from __future__ import annotations

from dualpath.cli.experiment.runner import ModeResult
from dualpath.policy import max_over_avg
from dualpath.testbed.modeled import fit_host_per_step

__all__ = ["cpu_groups", "mode_figures", "snic_series"]


def snic_series(samples: list[tuple[float, int, int]], rate: float) -> list[tuple[float, float]]:
    """(time, read utilisation in [0, 1]) between consecutive reports of one node."""
    out = []
    for (t0, b0, _), (t1, b1, _) in zip(samples, samples[1:]):
        if t1 > t0:
            out.append((t1, min(1.0, (b1 - b0) / (t1 - t0) / rate)))
    return out


def _bytes_in_run(samples: list[tuple[float, int, int]]) -> int:
    inside = [s for s in samples if s[0] >= 0]
    return (inside[-1][1] - inside[0][1]) if len(inside) >= 2 else 0


def mode_figures(r: ModeResult) -> dict:
    """The per-mode row of the result: JCT, SNIC, load balance and emulation overhead."""
    run = r.report.get("run", {})
    jct = run.get("jct_s") or r.wall_s  # host seconds; utilisation and overhead are shares of it
    node_bytes = {n: _bytes_in_run(s) for n, s in r.nodes.items()}
    util = {n: (b / max(jct, 1e-9)) / r.snic_rate for n, b in node_bytes.items()}
    prefill = {e: s for e, s in r.engines.items() if s.get("role") == 0}
    decode = {e: s for e, s in r.engines.items() if s.get("role") == 1}
    attention = [s.get("attention_s", 0.0) for s in prefill.values()]
    pe_over = [max(0.0, s.get("busy_s", 0) - s.get("modeled_s", 0) - s.get("kv_wait_s", 0)) for s in prefill.values()]
    de_over = [max(0.0, s.get("busy_s", 0) - s.get("modeled_s", 0)) for s in decode.values()]
    overhead = [o / jct for o in pe_over + de_over] if jct else []
    return {
        "mode": r.mode,
        "jct_s": jct / r.slowdown,  # modeled seconds
        "host_s": jct,
        "agents_done": run.get("agents", {}).get("done"),
        "turns_completed": run.get("turns", {}).get("completed"),
        "errors": run.get("turns", {}).get("errors", {}),
        "cache_hit_rate": run.get("cache", {}).get("hit_rate"),
        "snic_bytes_read": node_bytes,
        "snic_read_utilisation": util,
        "snic_bytes_max_over_avg": max_over_avg(list(node_bytes.values())) if node_bytes and any(node_bytes.values()) else None,
        "attention_max_over_avg": max_over_avg(attention) if attention and any(attention) else None,
        "overhead_share": {"mean": sum(overhead) / len(overhead) if overhead else None, "max": max(overhead, default=None)},
        # how long prefill layer loops waited for their KV (fetch or store on the NICs), and computed, modeled seconds
        "prefill_kv_wait_s": sum(s.get("kv_wait_s", 0.0) for s in prefill.values()) / r.slowdown,
        "prefill_modeled_s": sum(s.get("modeled_s", 0.0) for s in prefill.values()) / r.slowdown,
        # decode engines' host time per step beyond the modeled GPU's (modeled seconds): fixed + per request
        "decode_host_per_step": fit_host_per_step(list(decode.values()), r.slowdown),
        "loadgen_exit": r.loadgen_exit,
        "kv_lookup_failures": r.extra.get("kv_lookup_failures", 0),  # hits lost to index lookup timeouts
        "host_cpu_s": cpu_groups(r.extra.get("cpu_s") or {}),
        "host_cpu_per_host_s": sum((r.extra.get("cpu_s") or {}).values()) / jct if jct else None,  # cores busy on average
        "loadavg": r.extra.get("loadavg"),
    }


_GROUPS = (("prefill-", "PE"), ("decode-", "DE"), ("traffic-manager-", "TM"), ("loadgen", "loadgen"))


def cpu_groups(cpu_s: dict[str, float]) -> dict[str, float]:
    """Host CPU seconds of a run per kind of process: PE, DE, TM, loadgen, rest (gateway,
    scheduler, index, NATS)."""
    out = {"PE": 0.0, "DE": 0.0, "TM": 0.0, "loadgen": 0.0, "rest": 0.0}
    for name, s in cpu_s.items():
        group = next((g for prefix, g in _GROUPS if name.startswith(prefix)), "rest")
        out[group] += s
    return out
