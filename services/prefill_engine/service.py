"""Run a prefill engine: ``python -m services.prefill_engine --model DIR --engine-id pe0 --node-id p0``."""

from __future__ import annotations

import argparse
import asyncio

from dualpath.bus import Bus
from dualpath.config import BusConfig, EmulationConfig, EngineConfig, ModelConfigSpec, NodeConfig, add_arguments, from_args
from dualpath.engine.common import build_engine
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from dualpath.runtime import periodic, run_service
from services.prefill_engine.engine import PrefillEngine


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpath service prefill-engine", description="layer-wise prefill engine (one per GPU)")
    add_arguments(p, BusConfig)
    add_arguments(p, ModelConfigSpec)
    add_arguments(p, EngineConfig, skip=("kv_capacity_tokens", "max_running"))
    add_arguments(p, NodeConfig, skip=("storage", "buffer_mb"))
    add_arguments(p, EmulationConfig, skip=("snic_gbps",))
    p.add_argument("--window-mb", type=int, default=256, help="engine transfer window (stand-in for registered HBM), MiB")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    bus_cfg, cfg = from_args(BusConfig, ns), from_args(EngineConfig, ns)
    model, node, emu = from_args(ModelConfigSpec, ns), from_args(NodeConfig, ns), from_args(EmulationConfig, ns)
    subjects = Subjects(bus_cfg.namespace)

    async def serve(bus: Bus, stop: asyncio.Event) -> None:
        setup = await build_engine(engine_id=cfg.engine_id, namespace=bus_cfg.namespace, model=model, node=node, window_mb=ns.window_mb,
                                  emu=emu, role="prefill")
        engine = PrefillEngine(bus, subjects, cfg, node.node_id, setup)
        await bus.serve(subjects.prefill(cfg.engine_id), engine.on_task, m.PrefillTask)
        await bus.serve(subjects.cancel, engine.on_cancel, m.CancelRequest)

        async def report() -> None:
            await bus.publish(subjects.engine_report, engine.report())

        try:
            await asyncio.gather(engine.run(stop), periodic(stop, node.report_interval, report))
        finally:
            await setup.close()

    return run_service(f"prefill-engine-{cfg.engine_id}", bus_cfg, serve)
