"""Human-readable summaries of a report (what the CLI prints without ``--json``)."""

from __future__ import annotations

__all__ = ["format_run", "format_probe", "format_sweep"]


def _s(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def format_run(run: dict) -> str:
    """A table of one run's summary (``RunState.summary``)."""
    lines = []
    agents, turns = run["agents"], run["turns"]
    errors = ", ".join(f"{n} {k}" for k, n in sorted(turns["errors"].items())) or "none"
    wall = f"wall {run['wall_s']:.2f} s" + (f", JCT {run['jct_s']:.2f} s" if run.get("jct_s") is not None else "")
    lines.append(f"  time        {wall}")
    lines.append(
        f"  agents      {agents['launched']} launched, {agents['done']} done, {agents['failed']} failed, {agents['cancelled']} cut off"
    )
    lines.append(f"  turns       {turns['completed']} completed; errors: {errors}")
    tp = run["throughput"]
    lines.append(
        f"  throughput  {tp['output_tokens_per_s']:.1f} output tok/s, {tp['prompt_tokens_per_s']:.1f} prompt tok/s, "
        f"{tp['turns_per_s']:.2f} turns/s"
    )
    if run["aps"]["achieved"] is not None:
        lines.append(f"  arrivals    {run['aps']['achieved']:.3f} agents/s achieved")
    lines.append(f"  cache       {_pct(run['cache']['hit_rate'])} of prompt tokens reported cached")
    lines.append(f"  {'latency (s)':<11} {'p50':>9} {'p90':>9} {'p99':>9} {'mean':>9} {'n':>8}")
    for name, key in (("TTFT", "ttft"), ("TTST", "ttst"), ("TPOT", "tpot"), ("ITL", "itl"), ("e2e", "e2e"), ("agent", "agent_completion")):
        d = run["latency_s"][key]
        lines.append(
            f"  {name:<11} {_s(d.get('p50'), 4):>9} {_s(d.get('p90'), 4):>9} {_s(d.get('p99'), 4):>9} {_s(d.get('mean'), 4):>9} {d['n']:>8}"
        )
    slo = run["slo"]
    verdict = "met" if slo["met"] else "NOT met"
    lines.append(
        f"  SLO         TTFT <= {slo['ttft_s']:g} s and TPOT <= {slo['tpot_s']:g} s: {_pct(slo['attainment'])} "
        f"of {slo['turns_counted']} turns (target {_pct(slo['attainment_target'])}) -> {verdict}"
    )
    gp = run["goodput"]
    lines.append(f"  goodput     {gp['turns_per_s']:.2f} turns/s, {gp['output_tokens_per_s']:.1f} output tok/s within SLO")
    lg = run["loadgen"]
    lag = lg["loop_lag_s"]
    lines.append(
        f"  loadgen     max {lg['max_active_agents']} active agents; event-loop lag p99 "
        f"{_s(lag.get('p99'), 4)} s, max {_s(lag.get('max'), 4)} s"
    )
    return "\n".join(lines)


def format_probe(point: dict) -> str:
    """One line per sweep probe."""
    return (
        f"probe {point['rate']:.4g} APS: attainment {_pct(point['attainment'])}, TTFT p99 "
        f"{_s(point['ttft_p99'])} s, TPOT p99 {_s(point['tpot_p99'])} s, {point['failed_turns']} failed "
        f"-> {'pass' if point['passed'] else 'fail'}"
    )


def format_sweep(sweep: dict) -> str:
    """Every probe, then the answer."""
    lines = [format_probe(p) for p in sweep["points"]]
    best = sweep["max_aps"]
    lines.append("highest APS meeting the SLO: " + ("none of the probed rates" if best is None else f"{best:.4g}"))
    if sweep.get("stopped"):
        lines.append(f"sweep stopped: {sweep['stopped']}")
    return "\n".join(lines)
