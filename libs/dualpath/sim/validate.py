"""``dualpath sim validate``: the emulated testbed and the simulator on the same small clusters.

For each topology (1P1D, 2P1D, 1P2D; one engine per node, as the testbed runs them) and mode
(basic, dualpath; oracle with ``--oracle``) it runs ``dualpath experiment offline`` (the real
services with modeled compute and emulated NICs: minutes per mode) and the simulator with
the testbed's settings, and prints both JCTs and their ratio (rows with ``testbed_jct``,
``sim_jct``, ``ratio``, ``within_10pct``).

The simulator is set up as the testbed stack is (``dualpath.cli.experiment.runner``): the
node's SNIC and buffer shrink to one GPU's share, the decode engine's KV capacity is the
stack's ``kv_capacity_tokens`` (4M tokens) and its buffer the stack's (64 MiB at the byte
scale 1000), the cost model's default expert parallelism, agents met mid-rollout with warm
storage, and a node's storage reads served one after another: the testbed's emulated SNIC
is a non-preemptive FIFO server of byte jobs (``dualpath.transfer.nic``) and each read
queues all its chunks at once, so of the traffic manager's four reads in flight the first
queued finishes first, where a real NIC (the simulator's default, ``storage_parallel`` 4)
shares itself among them. The simulator does not model the emulation's own host overhead (Python, the bus),
which the testbed reports as its ``overhead`` share.

``--recorded`` compares with the testbed JCTs of the last quick run recorded in the README
instead of running the testbed (seconds: the CI form); ``--testbed-json DIR`` reuses result.json files of earlier
``dualpath experiment offline`` runs (``DIR/<topology>/result.json``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from dualpath.sim.config import SimConfig, parse_topology
from dualpath.sim.experiments import run_offline
from dualpath.sim.hugepages import plain_env
from dualpath.sim.workload import Workload

__all__ = ["RECORDED", "main", "sim_jcts"]

TESTBED_SCALE = 1000.0  # the testbed's default byte scale
TESTBED_BUFFER_MIB = 64  # the stack's buffer floor (runner.stack_config): what one-engine nodes get
TESTBED_KV_TOKENS = 1 << 22  # runner.stack_config's kv_capacity_tokens

# The testbed's JCTs (modeled seconds) of the last ``dualpath sim validate --quick`` recorded in
# the README (2026-12-03 at 90f8968, the 2-core VM with nothing else running): ds27b, 64K set,
# RECORDED_AGENTS agents x RECORDED_TURNS turns, start-at 0.5, one engine per node, slowdown 6.
RECORDED = {
    "1P1D": {"basic": 4.215, "dualpath": 3.167},
    "2P1D": {"basic": 3.284, "dualpath": 3.208},
    "1P2D": {"basic": 4.116, "dualpath": 2.934},
}
RECORDED_AGENTS, RECORDED_TURNS = 16, 2


def testbed_config(topology: str, target: str = "ds27b") -> SimConfig:
    """The simulator configured as the testbed stack runs ``topology`` (module docstring)."""
    p, d = parse_topology(topology)
    share = 1 / 8
    dram_gb = TESTBED_BUFFER_MIB * 2**20 * TESTBED_SCALE / 1e9 / share
    return SimConfig(
        target=target,
        prefill_nodes=p,
        decode_nodes=d,
        engines_per_node=1,
        decode_ep=-1,
        hbm_tokens=TESTBED_KV_TOKENS,
        dram_buffer_gb=dram_gb,
        storage_parallel=1,  # the emulated SNIC serves reads FIFO (module docstring)
    )


def sim_jcts(topology: str, modes: list[str], *, agents: int, turns: int, target: str = "ds27b", seed: int = 0) -> dict[str, float]:
    result = run_offline(
        testbed_config(topology, target),
        Workload(dataset="64k", agents=agents, turns=turns, start_at=0.5, seed=seed),
        modes,
        progress=False,
    )
    return {m: r["jct_s"] for m, r in result["modes"].items()}


def testbed_jcts(
    topology: str, modes: list[str], *, agents: int, turns: int, out: Path, slowdown: float, target: str = "ds27b", seed: int = 0
) -> dict[str, float]:
    """Run ``dualpath experiment offline`` (minutes per mode) and return its JCTs."""
    cmd = [
        sys.executable,
        "-m",
        "dualpath.cli",
        "experiment",
        "offline",
        "--target",
        target,
        "--topology",
        topology,
        "--agents",
        str(agents),
        "--turns",
        str(turns),
        "--modes",
        ",".join(modes),
        "--slowdown",
        str(slowdown),
        "--seed",
        str(seed),
        "--json",
        "--out",
        str(out / topology),
    ]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=plain_env())  # the testbed as it runs on its own
    if proc.returncode != 0:
        raise RuntimeError(f"testbed {topology} exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    result = json.loads(proc.stdout)
    return {m: r["jct_s"] for m, r in result["modes"].items()}


def _rows(topology: str, testbed: dict[str, float], sim: dict[str, float]) -> list[dict]:
    rows = []
    for mode, tb in testbed.items():
        sm = sim.get(mode)
        ratio = sm / tb if sm is not None and tb else None
        rows.append(
            {
                "topology": topology,
                "mode": mode,
                "testbed_jct": tb,
                "sim_jct": sm,
                "ratio": ratio,
                "within_10pct": ratio is not None and abs(ratio - 1) <= 0.10,
            }
        )
    return rows


def format_rows(rows: list[dict]) -> str:
    out = [f"{'topology':<9} {'mode':<9} {'testbed JCT':>11} {'sim JCT':>8} {'sim/testbed':>11}  within 10%"]
    for r in rows:
        out.append(
            f"{r['topology']:<9} {r['mode']:<9} {r['testbed_jct']:>11.2f} {r['sim_jct']:>8.2f} {r['ratio']:>11.3f}  "
            f"{'yes' if r['within_10pct'] else 'NO'}"
        )
    return "\n".join(out)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dualpath sim validate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topologies", default="1P1D,2P1D,1P2D")
    p.add_argument("--oracle", action="store_true", help="also compare the oracle mode")
    p.add_argument(
        "--quick", action="store_true", help="16 agents x 2 turns, slowdown 6 (testbed ~1 min per mode; the host's own cost a small share)"
    )
    p.add_argument("--agents", type=int, default=64)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--slowdown", type=float, default=4.0, help="testbed slow motion (its default)")
    p.add_argument("--recorded", action="store_true", help="compare with the README's recorded testbed runs (no testbed run)")
    p.add_argument("--testbed-json", default="", help="reuse DIR/<topology>/result.json of earlier testbed runs")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default="runs/sim-validate")
    ns = p.parse_args(argv)
    modes = ["basic", "dualpath"] + (["oracle"] if ns.oracle else [])
    agents, turns, slowdown = (16, 2, 6.0) if ns.quick else (ns.agents, ns.turns, ns.slowdown)
    topologies = [t.strip() for t in ns.topologies.split(",") if t.strip()]
    for t in topologies:
        parse_topology(t)  # ValueError -> one line, exit 2
    t0 = time.perf_counter()
    rows: list[dict] = []
    for topo in topologies:
        if ns.recorded:
            if topo not in RECORDED:
                print(f"dualpath sim validate: no recorded testbed run for {topo} (recorded: {', '.join(RECORDED)})", file=sys.stderr)
                continue
            testbed = {m: RECORDED[topo][m] for m in modes if m in RECORDED[topo]}
            agents, turns = RECORDED_AGENTS, RECORDED_TURNS
        elif ns.testbed_json:
            result = json.loads((Path(ns.testbed_json) / topo / "result.json").read_text())
            testbed = {m: r["jct_s"] for m, r in result["modes"].items() if m in modes}
            agents, turns = result["agents"], result["turns"]
        else:
            testbed = testbed_jcts(topo, modes, agents=agents, turns=turns, out=Path(ns.out), slowdown=slowdown)
        rows += _rows(topo, testbed, sim_jcts(topo, list(testbed), agents=agents, turns=turns))
    wall = time.perf_counter() - t0
    result = {
        "rows": rows,
        "all_within_10pct": all(r["within_10pct"] for r in rows),
        "wall_s": wall,
        "source": "recorded" if ns.recorded else "testbed-json" if ns.testbed_json else "testbed",
    }
    print(json.dumps(result, indent=2) if ns.json else format_rows(rows) + f"\nwall {wall:.1f} s")
    return 0
