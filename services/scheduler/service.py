"""Run the scheduler: ``python -m services.scheduler --policy dualpath [--read-path auto]``."""

from __future__ import annotations

import argparse
import asyncio

from dualpath.bus import Bus
from dualpath.config import BusConfig, SchedulerConfig, add_arguments, from_args
from dualpath.policy import Thresholds, get_policy
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from dualpath.runtime import run_service
from services.scheduler.core import Scheduler


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpath service scheduler", description="the DualPath scheduler (one active per deployment)")
    add_arguments(p, BusConfig)
    add_arguments(p, SchedulerConfig)
    p.add_argument("--alpha-tokens", type=int, default=1 << 22,
                   help="α: tokens a node reads from storage in 3 s (short-queue threshold); derive from the hardware profile")
    p.add_argument("--beta-tokens", type=int, default=1 << 22,
                   help="β: tokens one engine computes in 5 s (overload threshold); derive from profiling")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    bus_cfg, cfg = from_args(BusConfig, ns), from_args(SchedulerConfig, ns)
    try:
        policy = get_policy(cfg.policy, Thresholds(alpha_tokens=ns.alpha_tokens, beta_tokens=ns.beta_tokens), read_path=cfg.read_path)
    except (LookupError, ValueError) as exc:
        print(f"scheduler: {exc}")
        return 2
    subjects = Subjects(bus_cfg.namespace)

    async def serve(bus: Bus, stop: asyncio.Event) -> None:
        sched = Scheduler(bus, subjects, cfg, policy)
        await bus.serve(subjects.submit, sched.on_submit, m.SubmitRequest)
        await bus.serve(subjects.engine_report, sched.on_engine_report, m.EngineReport)
        await bus.serve(subjects.node_report, sched.on_node_report, m.NodeReport)
        await bus.serve(subjects.task_failed, sched.on_task_failed, m.TaskFailed)
        await bus.serve(subjects.sched_state, sched.on_state, m.StateRequest)
        await sched.run(stop)

    return run_service("scheduler", bus_cfg, serve)
