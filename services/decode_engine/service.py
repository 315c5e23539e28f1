"""Run a decode engine: ``python -m services.decode_engine --model DIR --engine-id de0 --node-id d0``."""

from __future__ import annotations

import argparse

from dualpath.engine.service import engine_parser, run_engine
from dualpath.protocol import messages as m
from dualpath.telemetry.metrics import nic_observations, observe
from services.decode_engine.engine import DecodeEngine, DecodePhase


def build_parser() -> argparse.ArgumentParser:
    return engine_parser("decode", "continuous-batching decode engine (one per GPU)", window_mb=16)


def register_metrics(engine: DecodeEngine) -> None:
    """seq_e/tok_e, the admission queue, KV memory occupancy and the CNIC (read at scrape time)."""
    me = {"engine": engine.cfg.engine_id, "role": "decode"}
    observe(
        "dualpath.engine.seq",
        "requests on the engine, running or waiting for admission (seq_e)",
        lambda: [(engine.count(DecodePhase.RUNNING, DecodePhase.WAITING), me)],
    )
    observe("dualpath.engine.tok", "context tokens of those requests (tok_e)", lambda: [(engine.batcher.context_tokens(), me)])
    observe("dualpath.engine.incoming", "prefilled requests waiting for admission", lambda: [(engine.count(DecodePhase.WAITING), me)])
    observe("dualpath.engine.busy", "seconds spent in decode steps", lambda: [(engine.busy_s, me)], unit="s", kind="counter")
    observe(
        "dualpath.engine.kv_used",
        "tokens of KV memory ('HBM') in use",
        lambda: [(engine.memory.capacity_tokens - engine.memory.free_tokens, me)],
    )
    observe("dualpath.engine.kv_capacity", "tokens of KV memory ('HBM')", lambda: [(engine.memory.capacity_tokens, me)])
    observe(
        "dualpath.engine.kv_reserved",
        "tokens of KV memory reserved by admitted requests (prompt + max_tokens each)",
        lambda: [(engine.batcher.reserved_tokens, me)],
    )
    nic_observations(lambda: [engine.setup.nic.rx, engine.setup.nic.tx] if engine.setup.nic is not None else [])  # both links of the CNIC


def main(argv: list[str] | None = None) -> int:
    return run_engine(build_parser().parse_args(argv), "decode", DecodeEngine, m.DecodeTask, register_metrics)
