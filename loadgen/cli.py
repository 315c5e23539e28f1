"""``dualpath loadgen``: replay agent trajectories against an OpenAI-compatible server.

Exit codes: 0 the run completed (whether or not the SLO was met); 2 bad usage or input
(options, dataset, trajectory file, tokenizer); 3 the server was unreachable or failed
requests; 130 interrupted. Whatever was measured is saved to ``--out`` in every case:
``report.json``, ``turns.jsonl`` and the PNG plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import anyio

from loadgen import output
from loadgen.arrivals import arrival_times
from loadgen.client import Endpoint, resolve_model
from loadgen.dataset import DEFAULT_AGENTS, load_dataset
from loadgen.errors import InputError, ServerError
from loadgen.progress import MODES, Progress
from loadgen.prompts import PromptText
from loadgen.render import format_probe, format_run, format_sweep
from loadgen.report import Slo
from loadgen.runner import LoadSpec, RunState, run_load
from loadgen.sweep import SweepPlan, SweepState, run_sweep
from loadgen.synthetic import trace_stats
from loadgen.trajectory import save_trajectories
from loadgen.transports import TRANSPORTS

__all__ = ["main", "build_parser"]

EXIT_OK, EXIT_INPUT, EXIT_SERVER, EXIT_INTERRUPTED = 0, 2, 3, 130


def build_parser(prog: str = "dualpath loadgen") -> argparse.ArgumentParser:
    """The argument parser (every option has help text)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Replay multi-turn agent trajectories against an "
        "OpenAI-compatible server and report latency, throughput and SLO attainment.",
    )
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000 (with or without /v1)")
    p.add_argument("--dataset", default="32k", help="32k, 48k, 64k (synthetic, paper statistics) or a trajectory JSONL file")
    p.add_argument("--agents", type=int, help=f"number of agents (default {DEFAULT_AGENTS}, or the file's line count)")
    p.add_argument("--turns", type=int, help="cap every agent at this many turns")
    p.add_argument(
        "--start-at",
        type=float,
        default=0.0,
        help="meet every agent this fraction of the way through its turns (0.5: mid-rollout contexts), "
        "the earlier turns folded into its first prompt",
    )
    p.add_argument(
        "--untimed-turns",
        type=int,
        default=0,
        help="run each agent's first N turns (of --turns) but leave them out of the figures: a lead-in for agents "
        "met mid-rollout, whose previous turn this server did not see",
    )
    p.add_argument("--scale", type=float, default=1.0, help="multiply every length by this (e.g. 0.01 for a tiny CPU model)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--rate", type=float, help="online: agents arrive at this many per second (the sweep's start rate)")
    mode.add_argument("--offline", action="store_true", help="offline: every agent starts at once (the default)")
    p.add_argument("--burstiness", type=float, default=1.0, help="Gamma arrival shape: 1 = Poisson, < 1 burstier")
    p.add_argument(
        "--stagger",
        type=float,
        default=0.0,
        help="offline: start agent i at i x this many seconds instead of all at once, so the server sees the first "
        "turns in the agents' order (a burst sent at once reaches a scheduler in whatever order the server's "
        "concurrent handling gives)",
    )
    p.add_argument("--duration", type=float, help="stop arrivals after this many seconds and end the run (online)")
    p.add_argument("--drain", type=float, default=0.0, help="seconds after --duration that running agents may continue")
    p.add_argument("--slo-ttft", type=float, default=4.0, help="TTFT bound of the SLO, seconds")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="TPOT bound of the SLO, seconds")
    p.add_argument("--slo-attainment", type=float, default=0.99, help="fraction of turns that must meet the SLO")
    p.add_argument("--sweep", action="store_true", help="search for the highest APS meeting the SLO (online probes)")
    p.add_argument("--sweep-probes", type=int, default=8, help="most probes a sweep runs")
    p.add_argument("--sweep-tolerance", type=float, default=0.1, help="stop when pass/fail rates are this close (relative)")
    p.add_argument(
        "--sweep-step",
        type=float,
        default=2.0,
        help="factor between probes until one passes and one fails (smaller when --rate is a good guess)",
    )
    p.add_argument("--out", help="directory for report.json, turns.jsonl and plots (default loadgen-out/<time>)")
    p.add_argument("--json", action="store_true", help="print report.json to stdout instead of a table")
    p.add_argument("--api", choices=("completions", "chat"), default="completions", help="endpoint to drive")
    p.add_argument("--model", help="model name (default: the first one /v1/models lists)")
    p.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY if set)")
    p.add_argument("--tokenizer", help="directory with tokenizer.json to size prompts exactly (else 1 token = 4 chars)")
    p.add_argument("--seed", type=int, default=0, help="seed of the dataset, arrivals and prompt text")
    p.add_argument("--transport", choices=TRANSPORTS, default="fast", help="HTTP client: fast (asyncio) or httpx")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a turn may take before it fails")
    p.add_argument("--max-errors", type=int, default=20, help="abort the run after this many failed turns")
    p.add_argument(
        "--session-header",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send X-Session-ID per agent (as aiperf --session-header): lets the server prefetch its next turn",
    )
    p.add_argument(
        "--tool-gap", type=float, default=0.0, help="mean seconds an agent runs a tool between turns (exponential; 0 = turns back to back)"
    )
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos/min_tokens (strict servers)")
    p.add_argument("--progress", choices=MODES, default="auto", help="live status line on stderr")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--save-dataset", help="also write the agents' trajectories to this JSONL file")
    return p


def _check(args: argparse.Namespace) -> None:
    for name in ("scale", "burstiness", "slo_ttft", "slo_tpot", "request_timeout"):
        if not getattr(args, name) > 0:
            raise InputError(f"--{name.replace('_', '-')} must be > 0")
    if args.rate is not None and not args.rate > 0:
        raise InputError("--rate must be > 0")
    if args.duration is not None and not args.duration > 0:
        raise InputError("--duration must be > 0")
    if not 0 < args.slo_attainment <= 1:
        raise InputError("--slo-attainment must be in (0, 1]")
    if args.untimed_turns < 0:
        raise InputError("--untimed-turns must be >= 0")
    if args.turns is not None and args.untimed_turns >= args.turns:
        raise InputError(f"--untimed-turns ({args.untimed_turns}) leaves no timed turn of --turns {args.turns}")
    if args.drain < 0 or args.max_errors < 1 or args.sweep_probes < 1:
        raise InputError("--drain must be >= 0, --max-errors and --sweep-probes >= 1")
    if not args.sweep_step > 1:
        raise InputError(f"--sweep-step must be > 1, got {args.sweep_step}")
    if args.sweep and args.offline:
        raise InputError("--sweep probes arrival rates; it cannot be combined with --offline")
    if not args.stagger >= 0:
        raise InputError("--stagger must be >= 0")
    if args.stagger and (args.rate is not None or args.sweep):
        raise InputError("--stagger spaces an offline run's starts; online runs have --rate")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage, 0 on --help
        return int(exc.code or 0)
    try:
        _check(args)
        prompts = PromptText(args.tokenizer)
        trajectories = load_dataset(
            args.dataset, agents=args.agents, seed=args.seed, turns=args.turns, scale=args.scale, start_at=args.start_at
        )
        if args.save_dataset:
            save_trajectories(args.save_dataset, trajectories)
    except (InputError, OSError) as exc:
        print(f"loadgen: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    out_dir = Path(args.out or Path("loadgen-out") / time.strftime("%Y%m%d-%H%M%S"))
    report = output.new_report(args, trace_stats(trajectories))
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    try:
        endpoint = Endpoint.parse(args.url, chat=args.api == "chat", model="", api_key=api_key, timeout_s=args.request_timeout)
    except ValueError as exc:
        print(f"loadgen: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    try:
        model = resolve_model(
            args.url, model=args.model, api_key=api_key, trust_env=args.transport == "httpx", timeout_s=min(10.0, args.request_timeout)
        )
    except ServerError as exc:
        return output.finish(report, out_dir, args, status="unreachable", message=str(exc), code=EXIT_SERVER)
    endpoint = dataclasses.replace(endpoint, model=model)
    report["config"]["model"] = model
    slo = Slo(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot, attainment=args.slo_attainment)
    if args.sweep:
        return _sweep(args, endpoint, trajectories, prompts, slo, report, out_dir)
    return _single(args, endpoint, trajectories, prompts, slo, report, out_dir)


def _spec(args, endpoint, trajectories, *, rate: float | None, seed: int) -> LoadSpec:
    arrivals = arrival_times(
        len(trajectories),
        rate=rate,
        burstiness=args.burstiness,
        seed=seed,
        stagger=args.stagger,  # 0 with a rate (main checks)
    )
    return LoadSpec(
        endpoint=endpoint,
        trajectories=tuple(trajectories),
        arrivals=tuple(arrivals.tolist()),
        offline=rate is None,
        duration_s=args.duration,
        drain_s=args.drain,
        transport=args.transport,
        text_seed=seed,
        max_errors=args.max_errors,
        exact_tokens=not args.no_ignore_eos,
        session_header=args.session_header,
        tool_gap_s=args.tool_gap,
        untimed_turns=args.untimed_turns,
    )


def _single(args, endpoint, trajectories, prompts, slo, report, out_dir) -> int:
    spec = _spec(args, endpoint, trajectories, rate=args.rate, seed=args.seed)
    state = RunState()
    interrupted = False
    try:
        anyio.run(run_load, spec, prompts, state, Progress(args.progress))
    except KeyboardInterrupt:
        interrupted = True
    report["run"] = state.summary(slo, offline=spec.offline, untimed_turns=spec.untimed_turns)
    output.save_run(out_dir, state.turns, slo, plots=not args.no_plots, untimed_turns=spec.untimed_turns)
    if not args.json:
        print(format_run(report["run"]))
    status, message, code = output.verdict(state, interrupted)
    return output.finish(report, out_dir, args, status=status, message=message, code=code)


def _sweep(args, endpoint, trajectories, prompts, slo, report, out_dir) -> int:
    plan = SweepPlan(start_rate=args.rate or 1.0, max_probes=args.sweep_probes, tolerance=args.sweep_tolerance, step=args.sweep_step)
    if args.duration is None:
        args.duration = 60.0
        report["config"]["duration"] = 60.0
    sweep = SweepState()
    states: list[RunState] = []

    async def probe(rate: float, index: int) -> dict:
        """One online run at ``rate``; its turns go to probe-<index>/turns.jsonl."""
        seed = args.seed + 1000 * (index + 1)  # fresh text and arrivals: no cache hits across probes
        spec = _spec(args, endpoint, trajectories, rate=rate, seed=seed)
        state = RunState()
        states.append(state)
        await run_load(spec, prompts, state, Progress(args.progress, label=f"[{rate:.4g} APS] "))
        point = output.probe_point(state.summary(slo, offline=False, untimed_turns=spec.untimed_turns), slo)
        output.save_run(out_dir / f"probe-{index}", state.turns, slo, plots=False)
        if not args.json:
            print(format_probe({**point, "rate": rate}), flush=True)
        return point

    interrupted = False
    try:
        anyio.run(run_sweep, plan, sweep, probe)
    except KeyboardInterrupt:
        interrupted = True
    report["sweep"] = output.sweep_section(plan, sweep, slo)
    if not args.no_plots and sweep.points:
        output.plot_sweep_points(out_dir, sweep.points, slo)
    if not args.json:
        print(format_sweep(report["sweep"]))
    status, message, code = output.verdict(states[-1] if states else RunState(), interrupted)
    if code == EXIT_OK and sweep.stopped:
        status, message, code = "server_errors", sweep.stopped, EXIT_SERVER
    return output.finish(report, out_dir, args, status=status, message=message, code=code)


if __name__ == "__main__":
    raise SystemExit(main())
