"""Run a decode engine: ``python -m services.decode_engine --model DIR --engine-id de0 --node-id d0``."""

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
from services.decode_engine.engine import DecodeEngine


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpath service decode-engine", description="continuous-batching decode engine (one per GPU)")
    add_arguments(p, BusConfig)
    add_arguments(p, ModelConfigSpec)
    add_arguments(p, EngineConfig, skip=("max_batch_tokens",))
    add_arguments(p, NodeConfig, skip=("storage", "buffer_mb"))
    add_arguments(p, EmulationConfig, skip=("snic_gbps",))
    p.add_argument("--window-mb", type=int, default=16, help="engine transfer window, MiB")
    return p


def register_metrics(engine: DecodeEngine) -> None:
    """seq_e/tok_e, the admission queue, KV memory occupancy and the CNIC (read at scrape time)."""
    me = {"engine": engine.cfg.engine_id, "role": "decode"}
    observe("dualpath.engine.seq", "requests on the engine, running or waiting for admission (seq_e)",
            lambda: [(len(engine.running) + len(engine.incoming), me)])
    observe("dualpath.engine.tok", "context tokens of those requests (tok_e)",
            lambda: [(sum(len(r.seq.tokens) for r in list(engine.running.values()))
                      + sum(len(t.prompt_tokens) for t in list(engine.incoming)), me)])
    observe("dualpath.engine.incoming", "prefilled requests waiting for admission", lambda: [(len(engine.incoming), me)])
    observe("dualpath.engine.busy", "seconds spent in decode steps", lambda: [(engine.busy_s, me)], unit="s", kind="counter")
    observe("dualpath.engine.kv_used", "tokens of KV memory ('HBM') in use",
            lambda: [(engine.memory.capacity_tokens - engine.memory.free_tokens, me)])
    observe("dualpath.engine.kv_capacity", "tokens of KV memory ('HBM')", lambda: [(engine.memory.capacity_tokens, me)])
    nic_observations(lambda: [engine.setup.nic] if engine.setup.nic is not None else [])


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    bus_cfg, cfg = from_args(BusConfig, ns), from_args(EngineConfig, ns)
    model, node, emu = from_args(ModelConfigSpec, ns), from_args(NodeConfig, ns), from_args(EmulationConfig, ns)
    subjects = Subjects(bus_cfg.namespace)

    async def serve(bus: Bus, stop: asyncio.Event) -> None:
        setup = await build_engine(engine_id=cfg.engine_id, namespace=bus_cfg.namespace, model=model, node=node, window_mb=ns.window_mb,
                                  emu=emu, role="decode")
        engine = DecodeEngine(bus, subjects, cfg, node.node_id, setup)
        register_metrics(engine)
        await bus.serve(subjects.decode(cfg.engine_id), engine.on_task, m.DecodeTask)
        await bus.serve(subjects.cancel, engine.on_cancel, m.CancelRequest)

        async def report() -> None:
            await bus.publish(subjects.engine_report, engine.report())

        try:
            await asyncio.gather(engine.run(stop), periodic(stop, node.report_interval, report))
        finally:
            await setup.close()

    return run_service(f"decode-engine-{cfg.engine_id}", bus_cfg, serve)
