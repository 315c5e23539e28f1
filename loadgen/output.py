"""Assembling and saving the CLI's outputs: report.json, turns.jsonl, plots, exit status."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from loadgen.report import Slo, TurnRecord, write_json, write_turns
from loadgen.runner import RunState
from loadgen.sweep import SweepPlan, SweepState
from loadgen.synthetic import TraceStats

__all__ = ["new_report", "save_run", "verdict", "probe_point", "sweep_section", "plot_sweep_points", "finish"]

_SECRET = {"api_key"}


def new_report(args: argparse.Namespace, stats: TraceStats) -> dict:
    """The report skeleton: configuration (secrets left out) and dataset statistics."""
    config = {k: v for k, v in vars(args).items() if k not in _SECRET}
    return {
        "version": 1,
        "tool": "dualpath loadgen",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "status": None,
        "message": None,
        "config": config,
        "dataset": asdict(stats),
        "host": {"cpus": os.cpu_count(), "loadavg": list(os.getloadavg())},
    }


def save_run(out_dir: Path, turns: list[TurnRecord], slo: Slo, *, plots: bool, untimed_turns: int = 0) -> None:
    """Write turns.jsonl (every turn, lead-in included) and the CDF plots (timed turns) into
    ``out_dir``; warns on stderr on I/O errors."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_turns(out_dir / "turns.jsonl", turns)
        if plots and turns:
            from loadgen.plots import plot_run  # matplotlib import is slow: only when plotting

            plot_run(out_dir, [t for t in turns if t.turn >= untimed_turns], slo_ttft=slo.ttft_s, slo_tpot=slo.tpot_s)
    except OSError as exc:
        print(f"loadgen: warning: could not save results in {out_dir}: {exc}", file=sys.stderr)


def verdict(state: RunState, interrupted: bool) -> tuple[str, str | None, int]:
    """(status, message, exit code) for a finished or aborted run."""
    if interrupted:
        return "interrupted", "interrupted; partial results saved", 130
    if state.abort_reason is not None:
        return "server_errors", f"aborted: {state.abort_reason}; first error: {state.first_error}", 3
    if state.errors:
        return "server_errors", f"{state.errors} turns failed; first error: {state.first_error}", 3
    return "ok", None, 0


def probe_point(summary: dict, slo: Slo) -> dict:
    """The figures of one sweep probe (its full summary included)."""
    lat = summary["latency_s"]
    failed = sum(n for kind, n in summary["turns"]["errors"].items() if kind != "cancelled")
    attainment = summary["slo"]["attainment"]
    return {
        "passed": failed == 0 and attainment is not None and attainment >= slo.attainment,
        "failed_turns": failed,
        "attainment": attainment,
        "achieved_aps": summary["aps"]["achieved"],
        "ttft_p50": lat["ttft"].get("p50"),
        "ttft_p99": lat["ttft"].get("p99"),
        "tpot_p50": lat["tpot"].get("p50"),
        "tpot_p99": lat["tpot"].get("p99"),
        "goodput_turns_per_s": summary["goodput"]["turns_per_s"],
        "summary": summary,
    }


def sweep_section(plan: SweepPlan, sweep: SweepState, slo: Slo) -> dict:
    """The report's sweep section: plan, every probe, the highest passing APS."""
    return {
        "plan": asdict(plan),
        "attainment_target": slo.attainment,
        "points": sweep.points,
        "max_aps": sweep.best,
        "lowest_failing_aps": sweep.lowest_failure,
        "stopped": sweep.stopped,
    }


def plot_sweep_points(out_dir: Path, points: list[dict], slo: Slo) -> None:
    """Latency and attainment vs APS plots; warns on stderr on I/O errors."""
    from loadgen.plots import plot_sweep

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        plot_sweep(out_dir, points, slo_ttft=slo.ttft_s, slo_tpot=slo.tpot_s, target=slo.attainment)
    except OSError as exc:
        print(f"loadgen: warning: could not save sweep plots in {out_dir}: {exc}", file=sys.stderr)


def finish(report: dict, out_dir: Path, args: argparse.Namespace, *, status: str, message: str | None, code: int) -> int:
    """Record the outcome, write report.json, print it (``--json``) or the message; returns ``code``."""
    report.update(status=status, message=message, exit_code=code)
    path = out_dir / "report.json"
    try:
        write_json(path, report)
    except OSError as exc:
        print(f"loadgen: warning: could not write {path}: {exc}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    if message:
        print(f"loadgen: {'error' if code else 'note'}: {message}", file=sys.stderr)
    print(f"loadgen: report saved to {path}", file=sys.stderr)
    return code
