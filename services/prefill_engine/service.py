"""Run a prefill engine: ``python -m services.prefill_engine --model DIR --engine-id pe0 --node-id p0``."""

from __future__ import annotations

import argparse

from dualpath.engine.service import engine_parser, run_engine
from dualpath.protocol import messages as m
from dualpath.telemetry.metrics import nic_observations, observe
from services.prefill_engine.engine import PrefillEngine


def build_parser() -> argparse.ArgumentParser:
    return engine_parser("prefill", "layer-wise prefill engine (one per GPU)", window_mb=256)


def register_metrics(engine: PrefillEngine) -> None:
    """seq_e/tok_e, the ready queue, KV bytes moved, transfer-window occupancy and the CNIC (read at scrape time)."""
    me = {"engine": engine.cfg.engine_id, "role": "prefill"}
    observe("dualpath.engine.seq", "unfinished requests on the engine (seq_e)", lambda: [(len(engine.requests), me)])
    observe("dualpath.engine.tok", "tokens the engine still has to compute (tok_e)", lambda: [(engine.tokens_left(), me)])
    observe(
        "dualpath.engine.ready",
        "requests whose KV is loaded, waiting for a batch",
        lambda: [(len(engine.batcher) + len(engine.loaded), me)],
    )
    observe("dualpath.engine.busy", "seconds spent in batches", lambda: [(engine.busy_s, me)], unit="s", kind="counter")
    observe(
        "dualpath.engine.kv_bytes",
        "KV bytes moved by layer-wise prefill",
        lambda: [(engine.kv_in_bytes, {**me, "direction": "fetch"}), (engine.kv_out_bytes, {**me, "direction": "store"})],
        unit="By",
        kind="counter",
    )
    pool = engine.setup.dataplane.pool
    observe(
        "dualpath.engine.window_used",
        "bytes of the engine transfer window held by batches",
        lambda: [(pool.size - pool.free_bytes, me)],
        unit="By",
    )
    nic_observations(lambda: [engine.setup.nic.rx, engine.setup.nic.tx] if engine.setup.nic is not None else [])  # both links of the CNIC


def main(argv: list[str] | None = None) -> int:
    return run_engine(build_parser().parse_args(argv), "prefill", PrefillEngine, m.PrefillTask, register_metrics)
