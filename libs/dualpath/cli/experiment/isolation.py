"""``dualpath experiment isolation``: does KV traffic slow the model's own traffic down?

The paper puts every byte of a GPU on its compute NIC (CNIC) and relies on traffic classes:
model-execution traffic (the MoE expert-parallel all-to-all) on a high-priority lane, KV loads
and stores on a low-priority one that takes what is left. This experiment runs the same
offline workload (DualPath mode, modeled all-to-all of every MoE layer on the CNICs at the
cost model's volume) twice: with two classes (KV low priority) and with one class only (one
FIFO queue), and reports

- the all-to-all's completion-time inflation caused by KV traffic: the sum over every
  all-to-all of its completion time over its uncontended time (bytes / rate), minus one
  (the paper's design goal: none);
- the KV bytes the CNICs carried and their throughput (per modeled second of the run), and
  the job completion time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from dualpath.cli.experiment.analysis import mode_figures
from dualpath.cli.experiment.runner import (
    ModeResult,
    add_cluster_arguments,
    emulation_config,
    prepare,
    run_mode,
)

__all__ = ["isolation_figures", "main"]

CONFIGS = {"two-class": 2, "one-class": 1}  # name -> CNIC traffic classes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dualpath experiment isolation", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_cluster_arguments(p)
    p.set_defaults(engines_per_node=1)
    p.add_argument("--dataset", default="64k", help="32k, 48k, 64k or a trajectory JSONL file")
    p.add_argument("--agents", type=int, default=32, help="agents, all started at once")
    p.add_argument("--turns", type=int, default=2, help="timed turns per agent")
    p.add_argument("--slowdown", type=float, default=4.0, help="slow motion (modeled times x, NIC rates /)")
    p.add_argument("--start-at", type=float, default=0.5, help="meet every agent this far through its trajectory")
    p.add_argument(
        "--model-traffic",
        default="on",
        choices=("auto", "on"),
        help="on: every remote EP rank through the CNIC (ds27b's EP fits one node, so auto sends nothing); "
        "auto: only the share crossing nodes",
    )
    p.add_argument("--out", default="runs/isolation", help="result.json and per-configuration logs")
    p.add_argument("--json", action="store_true", help="print result.json instead of the table")
    return p


def isolation_figures(r: ModeResult, byte_scale: float) -> dict:
    """The all-to-all inflation and the CNICs' KV traffic of one run (every engine summed)."""
    engines = list(r.engines.values())
    actual = sum(e.get("model_xfer_s", 0.0) for e in engines)
    ideal = sum(e.get("model_xfer_ideal_s", 0.0) for e in engines)
    row = mode_figures(r)
    kv_bytes = sum(e.get("cnic_kv_bytes", 0) for e in engines) * byte_scale  # the real cluster's bytes
    return {
        "jct_s": row["jct_s"],
        "model_xfers": sum(e.get("model_xfers", 0) for e in engines),
        "model_bytes": sum(e.get("model_xfer_bytes", 0) for e in engines) * byte_scale,
        "model_inflation": actual / ideal - 1 if ideal else None,
        "cnic_kv_bytes": kv_bytes,
        "kv_gbps": kv_bytes * 8 / 1e9 / row["jct_s"] if row["jct_s"] else None,
        "turns_completed": row["turns_completed"],
        "errors": row["errors"],
    }


def format_table(result: dict) -> str:
    lines = [
        (
            f"isolation {result['target']} {result['topology']} {result['dataset']}: {result['agents']} agents x {result['turns']} "
            f"turns, DualPath, MoE all-to-all on the CNICs ({result['model_traffic']})"
        ),
        f"{'CNIC':<10} {'JCT s':>7} {'all-to-alls':>11} {'model GB':>9} {'inflation':>10} {'KV GB':>8} {'KV Gbit/s':>10}",
    ]
    for name, r in result["configs"].items():
        infl = f"{100 * r['model_inflation']:.1f}%" if r["model_inflation"] is not None else "-"
        kv = f"{r['kv_gbps']:.1f}" if r["kv_gbps"] is not None else "-"
        lines.append(
            f"{name:<10} {r['jct_s']:>7.1f} {r['model_xfers']:>11} {r['model_bytes'] / 1e9:>9.1f} {infl:>10} "
            f"{r['cnic_kv_bytes'] / 1e9:>8.1f} {kv:>10}"
        )
    lines.append(
        "inflation = all-to-all completion time over its uncontended time (bytes / rate), minus one: what KV "
        "traffic on the same CNIC costs the model (paper's goal with two classes: none)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    ns.modes = "dualpath"
    if not ns.slowdown > 0 or not 0 <= ns.start_at < 1:
        print("dualpath experiment isolation: --slowdown must be positive and --start-at in [0, 1)", file=sys.stderr)
        return 2
    prepared = prepare(
        ns,
        "dualpath experiment isolation",
        warmup_turns=1,
        stream_interval=16,
        slowdown=ns.slowdown,
        extra_loadgen=("--start-at", str(ns.start_at)),
    )
    if prepared is None:
        return 2
    spec, _ = prepared
    say = lambda msg: print(msg, file=sys.stderr, flush=True)
    configs, exits = {}, []
    for name, classes in CONFIGS.items():
        run_spec = dataclasses.replace(spec, out=spec.out / name, model_traffic=ns.model_traffic, nic_classes=classes, warm_dir=spec.out)
        say(f"[{name}] CNICs with {classes} traffic class(es)")
        r = run_mode(run_spec, "dualpath", say=say)
        exits.append(r.loadgen_exit)
        configs[name] = isolation_figures(r, emulation_config(run_spec, False, 1.0).byte_scale())
    result = {
        "target": ns.target,
        "topology": ns.topology,
        "dataset": ns.dataset,
        "agents": ns.agents,
        "turns": ns.turns,
        "model_traffic": ns.model_traffic,
        "slowdown": ns.slowdown,
        "configs": configs,
    }
    (spec.out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2) if ns.json else format_table(result))
    return 0 if all(e == 0 for e in exits) else 1
