"""What both engine services share: their command line and their process wiring.

The prefill and decode services differ only in the engine class, the message they take and
their metrics; ``engine_parser`` and ``run_engine`` hold the rest, once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import uuid
from collections.abc import Callable

from anyio.abc import TaskGroup

from dualpath.bus import Bus
from dualpath.config import (
    BusConfig,
    EmulationConfig,
    EngineConfig,
    ModelConfigSpec,
    NodeConfig,
    add_arguments,
    from_args,
)
from dualpath.engine.common import build_engine
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from dualpath.runtime import periodic, run_service

__all__ = ["engine_parser", "run_engine"]

_SKIP = {"prefill": ("kv_capacity_tokens", "max_running", "stream_interval"), "decode": ("compute_quota_ms",)}


def engine_parser(role: str, description: str, window_mb: int) -> argparse.ArgumentParser:
    """Flags of a ``role`` ("prefill"/"decode") engine: bus, model, engine, node, emulation, window."""
    p = argparse.ArgumentParser(prog=f"dualpath service {role}-engine", description=description)
    add_arguments(p, BusConfig)
    add_arguments(p, ModelConfigSpec)
    add_arguments(p, EngineConfig, skip=_SKIP[role])
    add_arguments(p, NodeConfig, skip=("storage", "buffer_mb"))
    add_arguments(p, EmulationConfig, skip=("snic_gbps",))
    p.add_argument("--window-mb", type=int, default=window_mb, help="engine transfer window (stand-in for registered HBM), MiB")
    return p


def run_engine(ns: argparse.Namespace, role: str, engine_cls, task_type: type, register_metrics: Callable) -> int:
    """Run one engine process: build it, serve its task subject and cancels, report periodically."""
    bus_cfg, cfg = from_args(BusConfig, ns), from_args(EngineConfig, ns)
    model, node, emu = from_args(ModelConfigSpec, ns), from_args(NodeConfig, ns), from_args(EmulationConfig, ns)
    if role == "prefill" and not cfg.compute_quota_ms > 0:
        print(f"dualpath service prefill-engine: --compute-quota-ms must be positive, got {cfg.compute_quota_ms:g}", file=sys.stderr)
        return 2
    subjects = Subjects(bus_cfg.namespace)
    task_subject = subjects.prefill if role == "prefill" else subjects.decode

    async def serve(bus: Bus, stop: asyncio.Event, tasks: TaskGroup) -> None:
        import torch

        torch.set_num_threads(max(1, cfg.torch_threads))  # oversubscribed threads slow tiny CPU forwards ~50x
        setup = await build_engine(
            engine_id=cfg.engine_id, namespace=bus_cfg.namespace, model=model, node=node, window_mb=ns.window_mb, emu=emu, role=role
        )
        engine = engine_cls(bus, subjects, cfg, node.node_id, setup, tasks)
        register_metrics(engine)
        await bus.serve(task_subject(cfg.engine_id), engine.on_task, task_type)
        await bus.serve(subjects.cancel, engine.on_cancel, m.CancelRequest)

        incarnation = uuid.uuid4().hex[:12]  # this process: the scheduler tells a restart under the same name by it

        async def report() -> None:
            r = engine.report()
            await bus.publish(
                subjects.engine_report(cfg.engine_id), r if r.incarnation else dataclasses.replace(r, incarnation=incarnation)
            )

        try:
            tasks.start_soon(periodic, stop, node.report_interval, report, name="engine-report")
            await engine.run(stop)
        finally:
            await setup.close()

    return run_service(f"{role}-engine-{cfg.engine_id}", bus_cfg, serve)
