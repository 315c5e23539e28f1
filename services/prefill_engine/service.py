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
from dualpath.telemetry.metrics import nic_observations, observe
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


def register_metrics(engine: PrefillEngine) -> None:
    """seq_e/tok_e, the ready queue, KV bytes moved, transfer-window occupancy and the CNIC (read at scrape time)."""
    me = {"engine": engine.cfg.engine_id, "role": "prefill"}
    observe("dualpath.engine.seq", "unfinished requests on the engine (seq_e)", lambda: [(len(engine.jobs), me)])
    observe("dualpath.engine.tok", "tokens the engine still has to compute (tok_e)",
            lambda: [(sum(len(j.task.prompt_tokens) - j.progress for j in list(engine.jobs.values())), me)])
    observe("dualpath.engine.ready", "requests whose KV is loaded, waiting for a batch", lambda: [(len(engine.ready), me)])
    observe("dualpath.engine.busy", "seconds spent in batches", lambda: [(engine.busy_s, me)], unit="s", kind="counter")
    observe("dualpath.engine.kv_bytes", "KV bytes moved by layer-wise prefill",
            lambda: [(engine.kv_in_bytes, {**me, "direction": "fetch"}), (engine.kv_out_bytes, {**me, "direction": "store"})],
            unit="By", kind="counter")
    pool = engine.setup.dataplane.pool
    observe("dualpath.engine.window_used", "bytes of the engine transfer window held by batches",
            lambda: [(pool.size - pool.free_bytes, me)], unit="By")
    nic_observations(lambda: [engine.setup.nic] if engine.setup.nic is not None else [])


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    bus_cfg, cfg = from_args(BusConfig, ns), from_args(EngineConfig, ns)
    model, node, emu = from_args(ModelConfigSpec, ns), from_args(NodeConfig, ns), from_args(EmulationConfig, ns)
    subjects = Subjects(bus_cfg.namespace)

    async def serve(bus: Bus, stop: asyncio.Event) -> None:
        setup = await build_engine(engine_id=cfg.engine_id, namespace=bus_cfg.namespace, model=model, node=node, window_mb=ns.window_mb,
                                  emu=emu, role="prefill")
        engine = PrefillEngine(bus, subjects, cfg, node.node_id, setup)
        register_metrics(engine)
        await bus.serve(subjects.prefill(cfg.engine_id), engine.on_task, m.PrefillTask)
        await bus.serve(subjects.cancel, engine.on_cancel, m.CancelRequest)

        async def report() -> None:
            await bus.publish(subjects.engine_report, engine.report())

        try:
            await asyncio.gather(engine.run(stop), periodic(stop, node.report_interval, report))
        finally:
            await setup.close()

    return run_service(f"prefill-engine-{cfg.engine_id}", bus_cfg, serve)
