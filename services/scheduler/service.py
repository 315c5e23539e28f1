"""Run the scheduler: ``python -m services.scheduler --policy dualpath [--read-path auto]``."""

from __future__ import annotations

import argparse
import asyncio

import anyio

from dualpath.bus import Bus
from dualpath.config import (
    BusConfig,
    EmulationConfig,
    SchedulerConfig,
    add_arguments,
    from_args,
)
from dualpath.core import CoreConfig, SchedulerCore, tune_gc
from dualpath.ha.lease import add_lease_arguments, keep_leading, wait_for_leadership
from dualpath.policy import Thresholds, get_policy
from dualpath.policy.values import Role
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from dualpath.runtime import run_service
from dualpath.telemetry.metrics import observe
from dualpath.telemetry.tracing import tracing_enabled
from services.scheduler.shell import SchedulerShell


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpath service scheduler", description="the DualPath scheduler (one active per deployment)")
    add_arguments(p, BusConfig)
    add_arguments(p, SchedulerConfig)
    add_arguments(p, EmulationConfig, skip=("cnic_gbps", "oracle"))
    add_lease_arguments(p)  # active/standby: act only while holding the JetStream KV lease
    p.add_argument(
        "--alpha-tokens",
        type=int,
        default=0,
        help="α: tokens a node reads from storage in 3 s (default: from the testbed profile, else 4M)",
    )
    p.add_argument(
        "--beta-tokens", type=int, default=0, help="β: tokens one engine computes in 5 s (default: from the cost model, else 4M)"
    )
    return p


def thresholds(ns, emu: EmulationConfig) -> Thresholds:
    """α and β: given, else derived from the emulated hardware and the cost model (paper §6.1)."""
    alpha, beta = ns.alpha_tokens, ns.beta_tokens
    if emu.modeled:
        from dualpath.cost import cost_model
        from dualpath.policy import alpha_tokens, beta_tokens

        cost = cost_model(emu.target, emu.gpu)
        snic = emu.profile().snic_real_bytes_per_s(emu.engines())  # the modeled cluster's bytes/s and bytes/token
        alpha = alpha or alpha_tokens(snic, cost.target.kv_bytes_per_token())
        beta = beta or beta_tokens(cost.prefill_tokens_per_s())
    return Thresholds(alpha_tokens=alpha or 1 << 22, beta_tokens=beta or 1 << 22)


def register_metrics(core: SchedulerCore) -> None:
    """Queue lengths and the cluster as the scheduler sees it (read at scrape time)."""
    observe("dualpath.scheduler.queue", "requests waiting to be placed", lambda: [(core.queued, {})])
    observe("dualpath.scheduler.running", "requests placed and not finished", lambda: [(core.running, {})])
    observe(
        "dualpath.scheduler.engines",
        "live engines by role",
        lambda: [(core.engine_count(role), {"role": role.name.lower()}) for role in Role],
    )
    observe(
        "dualpath.scheduler.read_q",
        "hit tokens queued for storage reads per node, as last reported",
        lambda: [(n.read_q, {"node": n.name}) for n in list(core.nodes())],
    )
    observe(
        "dualpath.scheduler.buffer_waits",
        "dispatches put back because the decode node's buffer was full",
        lambda: [(core.buffer_waits, {})],
        kind="counter",
    )


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    bus_cfg, cfg, emu = from_args(BusConfig, ns), from_args(SchedulerConfig, ns), from_args(EmulationConfig, ns)
    try:
        policy = get_policy(cfg.policy, thresholds(ns, emu), read_path=cfg.read_path)
    except (LookupError, ValueError) as exc:
        print(f"scheduler: {exc}")
        return 2
    subjects = Subjects(bus_cfg.namespace)
    tune_gc()  # the core's request objects would otherwise keep the collector busy (see GC_THRESHOLDS)

    async def serve(bus: Bus, stop: asyncio.Event) -> None:
        lease = await wait_for_leadership(bus.nc.jetstream(), subjects.sched_leader, ns, stop)  # standby until leader
        if ns.leader_lease and lease is None:
            return
        slow = emu.slowdown if emu.modeled else 1.0  # the core's clock is the host's: modeled seconds x slowdown
        queue_order = CoreConfig()  # its queue-order times are modeled seconds
        core = SchedulerCore(
            policy,
            CoreConfig(
                engine_timeout=cfg.engine_timeout,
                node_timeout=cfg.engine_timeout,
                max_queue=cfg.max_queue,
                max_attempts=cfg.max_attempts,
                trace_inputs=tracing_enabled(),
                prefetch=cfg.prefetch,
                decode_credit_s=queue_order.decode_credit_s * slow,
                urgent_wait_s=cfg.urgent_wait * slow,
            ),
        )
        register_metrics(core)
        async with anyio.create_task_group() as tasks:  # every dispatch and free the shell starts
            # under a lease the instance is the lease's acquisition (holder@revision): the same
            # holder acquiring again after losing it is a new instance too (gateways resubmit)
            instance = f"{lease.holder}@{lease.revision}" if lease is not None else ""
            shell = SchedulerShell(bus, subjects, core, tasks, instance)
            tasks.start_soon(keep_leading, lease, stop)  # a lost lease sets stop: this scheduler steps down
            await bus.serve(subjects.submit, shell.on_submit, m.SubmitRequest)
            await bus.serve(subjects.engine_reports, shell.on_engine_report, m.EngineReport, sender=lambda r: r.engine_id)
            await bus.serve(subjects.node_reports, shell.on_node_report, m.NodeReport, sender=lambda r: r.node_id)
            await bus.serve(subjects.task_failures, shell.on_task_failed, m.TaskFailed, sender=lambda r: r.engine_id)
            await bus.serve(subjects.sched_state, shell.on_state, m.StateRequest)
            # once serving: gateways resubmit to a new instance what a dead one held
            tasks.start_soon(shell.announce, stop, lambda: lease is None or lease.valid)
            await shell.run(stop)
            tasks.cancel_scope.deadline = anyio.current_time() + 5.0  # in-flight dispatches get a moment to end

    return run_service("scheduler", bus_cfg, serve)
