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
shares itself among them. The emulation's own host time per decode step (sampling, streaming, admission, a loaded
host's late wake-ups: time the modeled GPU waits for) is what the testbed's decode engines
measure (``dualpath.testbed.HostPerStep``, the result's ``decode_host_per_step``: a fixed part
and a part per running request, modeled seconds); the simulator takes that figure as its
``decode_host_s`` / ``decode_host_per_request_s``, and the rows also give the JCT it simulates
without it (``sim_jct_gpu_only``: steps back to back). It is measured, not fitted to the JCT:
a step's host time against its batch size, the way Vidur profiles the CPU overhead of the
engine it models. Prefill host time is not modeled (the testbed's TTFTs match without it).

Both sides start agent ``i`` at ``i * --stagger-ms`` (2 modeled ms: 128 ms for 64 agents) instead
of all at once: a burst sent at once reaches the testbed's scheduler in whatever order the
gateway's concurrent handling gives, different from run to run, while the simulator takes
submission order; with 64 first turns queued for FIFO storage reads, that order alone moves
2P1D basic's JCT by several percent. Spaced starts give the same order on both sides.

``--recorded`` compares with the testbed figures of a quick run kept in ``RECORDED`` (the run
and its table are in docs/paper.md) instead of running the testbed (seconds);
``--testbed-json DIR`` reuses result.json files of earlier ``dualpath experiment offline`` runs
(``DIR/<topology>/result.json``).
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

__all__ = ["RECORDED", "main", "sim_jcts", "testbed_config", "testbed_runs"]

TESTBED_SCALE = 1000.0  # the testbed's default byte scale
TESTBED_BUFFER_MIB = 64  # the stack's buffer floor (runner.stack_config): what one-engine nodes get
TESTBED_KV_TOKENS = 1 << 22  # runner.stack_config's kv_capacity_tokens

# The testbed's JCTs (modeled seconds) and decode host time per step (fixed, per request;
# modeled seconds) of one ``dualpath sim validate --quick`` run (docs/paper.md): ds27b, 64K set,
# RECORDED_AGENTS agents x RECORDED_TURNS turns, start-at 0.5, one engine per node, slowdown 6.
RECORDED: dict[str, dict[str, tuple[float, float, float]]] = {
    "1P1D": {"basic": (4.187, 4.070e-05, 7.349e-06), "dualpath": (3.216, 3.036e-05, 1.074e-05)},
    "2P1D": {"basic": (3.216, 2.916e-05, 1.188e-05), "dualpath": (3.102, 2.582e-05, 1.162e-05)},
    "1P2D": {"basic": (4.094, 3.531e-05, 9.337e-06), "dualpath": (2.936, 3.372e-05, 1.082e-05)},
}
RECORDED_AGENTS, RECORDED_TURNS, RECORDED_STAGGER_MS = 16, 2, 2.0
STAGGER_MS = 2.0  # modeled ms between agent starts (module docstring)


def testbed_config(topology: str, target: str = "ds27b", host: dict | None = None) -> SimConfig:
    """The simulator configured as the testbed stack runs ``topology`` (module docstring), with
    ``host`` (a testbed run's ``decode_host_per_step``) as its decode host time per step."""
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
        decode_host_s=host["fixed_s"] if host else 0.0,
        decode_host_per_request_s=host["per_request_s"] if host else 0.0,
    )


def sim_jcts(
    topology: str,
    modes: list[str],
    *,
    agents: int,
    turns: int,
    target: str = "ds27b",
    seed: int = 0,
    hosts: dict[str, dict | None] | None = None,
    stagger_ms: float = 0.0,
    dataset: str = "64k",
) -> dict[str, float]:
    """Simulated JCTs of ``modes``; ``hosts`` (mode -> a testbed run's ``decode_host_per_step``)
    gives each mode's decode host time per step (none: steps back to back); agent ``i`` starts
    at ``i * stagger_ms``."""
    workload = Workload(dataset=dataset, agents=agents, turns=turns, start_at=0.5, seed=seed, stagger_s=stagger_ms / 1000)
    if not hosts or not any(hosts.values()):
        result = run_offline(testbed_config(topology, target), workload, modes, progress=False)
        return {m: r["jct_s"] for m, r in result["modes"].items()}
    out = {}
    for mode in modes:
        result = run_offline(testbed_config(topology, target, hosts.get(mode)), workload, [mode], progress=False)
        out[mode] = result["modes"][mode]["jct_s"]
    return out


def testbed_runs(
    topology: str,
    modes: list[str],
    *,
    agents: int,
    turns: int,
    out: Path,
    slowdown: float,
    target: str = "ds27b",
    seed: int = 0,
    stagger_ms: float = 0.0,
    dataset: str = "64k",
) -> dict[str, dict]:
    """Run ``dualpath experiment offline`` (minutes per mode) and return its per-mode figures
    (``jct_s``, ``decode_host_per_step``, ...)."""
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
        "--stagger-ms",
        str(stagger_ms),
        "--dataset",
        dataset,
        "--start-at",
        "0.5",
        "--json",
        "--out",
        str(out / topology),
    ]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=plain_env())  # the testbed as it runs on its own
    if proc.returncode != 0:
        raise RuntimeError(f"testbed {topology} exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout)["modes"]


def _rows(topology: str, testbed: dict[str, dict], sim: dict[str, float], gpu_only: dict[str, float]) -> list[dict]:
    rows = []
    for mode, tb in testbed.items():
        tb_jct, host = tb["jct_s"], tb.get("decode_host_per_step")
        sm = sim.get(mode)
        ratio = sm / tb_jct if sm is not None and tb_jct else None
        rows.append(
            {
                "topology": topology,
                "mode": mode,
                "testbed_jct": tb_jct,
                "sim_jct": sm,
                "ratio": ratio,
                "within_10pct": ratio is not None and abs(ratio - 1) <= 0.10,
                "decode_host_per_step": host,  # the testbed's, the simulator's input (modeled seconds)
                "sim_jct_gpu_only": gpu_only.get(mode),
                "ratio_gpu_only": gpu_only[mode] / tb_jct if mode in gpu_only and tb_jct else None,
            }
        )
    return rows


def format_rows(rows: list[dict]) -> str:
    out = [
        f"{'topology':<9} {'mode':<9} {'testbed JCT':>11} {'sim JCT':>8} {'sim/testbed':>11}  within 10%"
        f"  {'decode host ms/step':>19} {'GPU-only sim/testbed':>20}"
    ]
    for r in rows:
        host = r["decode_host_per_step"]
        host_text = f"{1e3 * host['fixed_s']:.3f}+{1e3 * host['per_request_s']:.4f}/req" if host else "-"
        gpu = f"{r['ratio_gpu_only']:.3f}" if r["ratio_gpu_only"] is not None else "-"
        out.append(
            f"{r['topology']:<9} {r['mode']:<9} {r['testbed_jct']:>11.2f} {r['sim_jct']:>8.2f} {r['ratio']:>11.3f}  "
            f"{'yes' if r['within_10pct'] else 'NO':<10}  {host_text:>19} {gpu:>20}"
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
    p.add_argument(
        "--stagger-ms",
        type=float,
        default=STAGGER_MS,
        help="start agent i at i x this many modeled ms on both sides (module docstring); 0: all at once",
    )
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
    if not ns.stagger_ms >= 0:
        raise ValueError(f"--stagger-ms must be >= 0, got {ns.stagger_ms}")
    stagger = ns.stagger_ms
    t0 = time.perf_counter()
    rows: list[dict] = []
    for topo in topologies:
        if ns.recorded:
            if topo not in RECORDED:
                print(f"dualpath sim validate: no recorded testbed run for {topo} (recorded: {', '.join(RECORDED)})", file=sys.stderr)
                continue
            testbed: dict[str, dict] = {
                m: {"jct_s": jct, "decode_host_per_step": {"fixed_s": fixed, "per_request_s": per} if fixed or per else None}
                for m, (jct, fixed, per) in RECORDED[topo].items()
                if m in modes
            }
            agents, turns, stagger = RECORDED_AGENTS, RECORDED_TURNS, RECORDED_STAGGER_MS
        elif ns.testbed_json:
            result = json.loads((Path(ns.testbed_json) / topo / "result.json").read_text())
            testbed = {m: r for m, r in result["modes"].items() if m in modes}  # runs before the host figure: none
            agents, turns, stagger = result["agents"], result["turns"], result.get("stagger_ms", 0.0)
        else:
            testbed = testbed_runs(topo, modes, agents=agents, turns=turns, out=Path(ns.out), slowdown=slowdown, stagger_ms=stagger)
        hosts: dict[str, dict | None] = {m: tb.get("decode_host_per_step") for m, tb in testbed.items()}
        gpu_only = sim_jcts(topo, list(testbed), agents=agents, turns=turns, stagger_ms=stagger)
        sim = (
            sim_jcts(topo, list(testbed), agents=agents, turns=turns, hosts=hosts, stagger_ms=stagger) if any(hosts.values()) else gpu_only
        )
        rows += _rows(topo, testbed, sim, gpu_only)
    wall = time.perf_counter() - t0
    result = {
        "rows": rows,
        "stagger_ms": stagger,
        "all_within_10pct": all(r["within_10pct"] for r in rows),
        "wall_s": wall,
        "source": "recorded" if ns.recorded else "testbed-json" if ns.testbed_json else "testbed",
    }
    print(json.dumps(result, indent=2) if ns.json else format_rows(rows) + f"\nwall {wall:.1f} s")
    return 0
