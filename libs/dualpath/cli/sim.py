"""``dualpath sim``: the paper's experiments in a virtual-time cluster simulator.

    dualpath sim offline --target T --topology xPyD --dataset D --agents N [--modes ...] [--ablation] [--json] [--out DIR]
    dualpath sim online  --target T --topology xPyD --dataset D (--rate R | --sweep) [--modes ...] [--json] [--out DIR]
    dualpath sim paper   [--size S] [--jobs N] [--json] [--out DIR]  (paper figure vs simulated figure, one row each)
    dualpath sim validate [--quick] [--json] [--out DIR]     (testbed JCT vs simulated JCT on small clusters)
    dualpath sim plan --target T --dataset D --gpus N [--slo-ttft S --slo-tpot S] [--online] [--json]

The simulator drives the services' own scheduler core, engine cores, policy and cost model
(see ``dualpath.sim``); hardware defaults are the paper's (8 GPUs per node, 400 Gbps CNIC
per GPU and SNIC per node, 80 GB DRAM buffer per node).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from dualpath.node.prefetch import PREFETCH_CACHE_GB

__all__ = ["main"]


class _Fail(Exception):
    """Bad command-line input: one line on stderr, exit code 2."""


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the simulated cluster and workload (every sub-command but paper/validate)."""
    g = p.add_argument_group("cluster")
    g.add_argument(
        "--target",
        default="ds660b",
        help="modeled model: a name (ds660b, ds27b, qwen32b, dsv3) or a path to a model's config.json (any supported architecture)",
    )
    g.add_argument("--gpu", default="h800", help="modeled GPU: h800, h100")
    g.add_argument("--topology", default="2P4D", help="xPyD prefill and decode nodes")
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument(
        "--engines-per-node",
        type=int,
        default=0,
        help="engines simulated per node (0 = one per GPU); fewer shrink the node's SNIC and buffer in proportion, as the testbed does",
    )
    g.add_argument("--snic-gbps", type=float, default=400.0, help="storage NIC per node")
    g.add_argument("--cnic-gbps", type=float, default=400.0, help="compute NIC per GPU")
    g.add_argument("--dram-gb", type=float, default=80.0, help="DRAM buffer per node")
    g.add_argument(
        "--read-policy",
        default="",
        choices=("", "auto", "split"),
        help="split: also run mode 'split' (DualPath with each request's hits read by both sides) next to --modes",
    )
    g.add_argument("--quota-ms", type=float, default=300.0, help="prefill compute quota (paper §6.2)")
    g.add_argument(
        "--decode-ep",
        default="auto",
        help="decode expert parallelism: auto (every decode GPU when the target's group spans nodes, else its default), "
        "target (the cost model's default, as the testbed), or N",
    )
    g.add_argument("--hbm-tokens", type=int, default=0, help="decode KV capacity per engine in tokens (0: the cost model's)")
    g.add_argument("--max-running", type=int, default=1024, help="decode: most requests batched together")
    g.add_argument(
        "--decode-host-ms",
        type=float,
        default=0.0,
        help="decode: host time per step the GPU waits for (scheduling, sampling, streaming); 0: steps back to back",
    )
    g.add_argument("--decode-host-per-request-ms", type=float, default=0.0, help="decode: host time per step per running request")
    g.add_argument(
        "--de-read-share",
        type=float,
        default=1.0,
        help="decode nodes' storage read rate as a share of the SNIC's (sim paper uses the calibration's de_snic_read_share)",
    )
    g.add_argument(
        "--collective-share",
        type=float,
        default=0.0,
        help="prefill: CNIC time the model's collectives take per second of compute (high priority, KV yields)",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", default="64k", help="32k, 48k, 64k or a trajectory JSONL file")
    w.add_argument("--agents", type=int, default=256)
    w.add_argument("--turns", type=int, default=0, help="turns per agent (0 = the whole trajectory)")
    w.add_argument("--start-at", type=float, default=0.0, help="meet agents this far through their trajectories (warm storage)")
    w.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", choices=("auto", "always", "never"), default="auto", help="progress line on stderr")
    p.add_argument("--json", action="store_true", help="print result.json instead of the table")
    p.add_argument("--out", default="", help="write result.json and PNGs here")


def _config(ns: argparse.Namespace, mode: str = "dualpath"):
    from dualpath.cost import CostModelError, resolve_target
    from dualpath.sim import SimConfig, parse_topology

    try:
        target = resolve_target(ns.target)
    except CostModelError as exc:
        raise _Fail(f"--target: {exc}") from None
    try:
        p, d = parse_topology(ns.topology)
        decode_ep = {"auto": 0, "target": -1}.get(ns.decode_ep)
        if decode_ep is None:
            decode_ep = int(ns.decode_ep)
            if decode_ep < 1:
                raise ValueError(f"--decode-ep must be auto, target or a positive integer, got {ns.decode_ep!r}")
        return SimConfig(
            target=target,
            gpu=ns.gpu,
            prefill_nodes=p,
            decode_nodes=d,
            gpus_per_node=ns.gpus_per_node,
            engines_per_node=ns.engines_per_node,
            snic_gbps=ns.snic_gbps,
            cnic_gbps=ns.cnic_gbps,
            dram_buffer_gb=ns.dram_gb,
            quota_s=ns.quota_ms / 1000,
            decode_ep=decode_ep,
            hbm_tokens=ns.hbm_tokens,
            max_running=ns.max_running,
            mode=mode,
            collective_share=ns.collective_share,
            decode_host_s=ns.decode_host_ms / 1000,
            decode_host_per_request_s=ns.decode_host_per_request_ms / 1000,
            de_read_share=ns.de_read_share,
        )
    except ValueError as exc:
        raise _Fail(str(exc)) from None


def _workload(ns: argparse.Namespace, **kw):
    from dualpath.sim import Workload

    if ns.agents < 1:
        raise _Fail(f"--agents must be at least 1, got {ns.agents}")
    if ns.turns < 0:
        raise _Fail(f"--turns must be >= 0, got {ns.turns}")
    if not 0 <= ns.start_at < 1:
        raise _Fail(f"--start-at must be in [0, 1), got {ns.start_at}")
    return Workload(dataset=ns.dataset, agents=ns.agents, seed=ns.seed, turns=ns.turns or None, start_at=ns.start_at, **kw)


def _modes(text: str, read_policy: str = "") -> list[str]:
    from dualpath.sim import MODES

    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise _Fail(f"--modes: unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    if read_policy == "split" and "split" not in modes:
        modes.append("split")
    return modes


def _progress(ns: argparse.Namespace) -> bool | None:
    return {"auto": None, "always": True, "never": False}[ns.progress]


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _out(ns: argparse.Namespace) -> Path | None:
    if not ns.out:
        return None
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _f(v, fmt: str = ".2f") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "-"


def format_offline(result: dict) -> str:
    lines = [
        (
            f"offline (simulated) {result['target']} {result['topology']} x{result['engines_per_node']} {result['dataset']}: "
            f"{result['agents']} agents x {result['turns'] or 'all'} turns"
        ),
        (
            f"{'mode':<12} {'JCT s':>9} {'hit %':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'queue':>6} {'TTST p50':>9} {'TPOT p50':>9} "
            f"{'SNIC max/avg util':>17} {'SNIC bytes m/a':>14} {'attn m/a 5%':>11} {'events':>9} {'wall s':>7} {'CPU s':>7}"
        ),
    ]
    for r in result["modes"].values():
        lat = r["latency_s"]
        lines.append(
            f"{r['mode']:<12} {r['jct_s']:>9.1f} {_f(100 * (r['cache_hit_rate'] or 0), '.1f'):>6} "
            f"{_f(lat['ttft'].get('p50'), '.3f'):>9} {_f(lat['ttft'].get('p99'), '.3f'):>9} {_f(r['ttft_share']['queueing']):>6} "
            f"{_f(lat['ttst'].get('p50'), '.3f'):>9} {_f(lat['tpot'].get('p50'), '.3f'):>9} "
            f"{_f(r['snic_util_max']) + '/' + _f(r['snic_util_avg']):>17} {_f(r['snic_bytes_max_over_avg']):>14} "
            f"{_f(r['attention_max_over_avg_early']):>11} {r['events']:>9} {r['wall_s']:>7.1f} {r['cpu_s']:>7.1f}"
        )
    for k, v in result["ratios"].items():
        lines.append(f"{k}: {_f(v)}x")
    lines.append(f"I/O bound (every node's read rate over the prefill nodes') = {result['io_bound']:.2f}x")
    if result.get("ablation"):
        lines.append("ablation (JCT reduction vs basic-nolw; paper, 64K: 17.21%, then 38.19% and 45.62% more):")
        for step in result["ablation"]:
            lines.append(f"  {step['mode']:<12} {step['jct_s']:>9.1f} s  {100 * step['reduction']:>6.2f}%")
    stopped = [r["stopped_at"] for r in result["modes"].values() if r.get("stopped_at")]
    if stopped:
        lines.append(f"stopped at {stopped[0]:g} virtual s (--until): JCT is that time, not the job's end")
    lines.append(
        f"wall {result['wall_s']:.1f} s (agents built in {result['agents_build_s']:.1f} s), "
        f"peak memory {max(r['peak_memory_mb'] for r in result['modes'].values()):.0f} MiB, code: {result.get('code', '?')}, "
        f"huge pages: {result.get('huge_pages', '?')}"
    )
    return "\n".join(lines)


def _offline(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dualpath sim offline", description="all agents start at once; JCT per mode (simulated)")
    add_cluster_arguments(p)
    p.add_argument("--modes", default="basic,dualpath,oracle")
    p.add_argument("--ablation", action="store_true", help="also run the ablation steps basic-nolw -> basic -> dualpath-rr -> dualpath")
    p.add_argument("--until", type=float, default=0.0, help="stop at this virtual time (0: run to the end); measures throughput")
    ns = p.parse_args(argv)
    from dualpath.sim.experiments import run_offline

    base, workload, modes = _config(ns), _workload(ns), _modes(ns.modes, ns.read_policy)
    result = run_offline(
        base, workload, modes, ablation=ns.ablation, progress=_progress(ns), say=_say, until=ns.until if ns.until > 0 else float("inf")
    )
    out = _out(ns)
    if out is not None:
        from dualpath.sim.plots import plot_jct, plot_snic

        (out / "result.json").write_text(json.dumps(result, indent=2))
        plot_jct(result["modes"], out / "jct.png")
        plot_snic(result["modes"], out / "snic_utilisation.png")
        _say(f"wrote {out / 'result.json'}, {out / 'jct.png'}, {out / 'snic_utilisation.png'}")
    print(json.dumps(result, indent=2) if ns.json else format_offline(result))
    return 0


def format_online(result: dict) -> str:
    lines = [
        (
            f"online (simulated) {result['target']} {result['topology']} {result['dataset']}: SLO TTFT <= {result['slo_ttft']} s, "
            f"TPOT <= {1000 * result['slo_tpot']:.0f} ms"
        ),
        (
            f"{'mode':<12} {'APS':>7} {'max APS':>8} {'attain':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'queue p50':>9} {'exec p50':>9} "
            f"{'TTST p50':>9} {'TPOT p50':>9}"
        ),
    ]
    for mode, r in result["modes"].items():
        lat = r.get("latency_s") or {}

        def g(k: str, q: str = "p50", lat: dict = lat) -> str:
            return _f((lat.get(k) or {}).get(q), ".3f")

        lines.append(
            f"{mode:<12} {_f(r.get('rate'), '.3f'):>7} {_f(r.get('max_aps'), '.3f'):>8} {_f(r.get('attainment')):>7} "
            f"{g('ttft'):>9} {g('ttft', 'p99'):>9} {g('ttft_queue'):>9} {g('ttft_exec'):>9} {g('ttst'):>9} {g('tpot'):>9}"
        )
    if result.get("aps_ratio"):
        lines.append(f"dualpath/basic max APS: {result['aps_ratio']:.2f}x")
    for mode, r in result["modes"].items():
        pf = r.get("prefetch")
        if pf:
            lines.append(
                f"{mode}: prefetch staged {pf['staged_bytes'] / 1e9:.1f} GB from storage, retained "
                f"{pf.get('retained_bytes', 0.0) / 1e9:.1f} GB of reads, used {_f(pf['used_fraction'])} of both, "
                f"peak prefetch cache {pf['peak_cache_bytes'] / 1e9:.1f} of {pf['cap_bytes_per_node'] / 1e9:.1f} GB per node"
            )
    return "\n".join(lines)


def _online(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dualpath sim online", description="Poisson/Gamma agent arrivals; APS within SLO (simulated)")
    add_cluster_arguments(p)
    p.set_defaults(dataset="32k", turns=8, agents=100000)
    p.add_argument("--modes", default="basic,dualpath")
    p.add_argument("--rate", type=float, default=0.5, help="agents per second (the sweep's start)")
    p.add_argument("--sweep", action="store_true", help="search the highest APS meeting the SLO")
    p.add_argument("--sweep-probes", type=int, default=8)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals")
    p.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of inter-arrival gaps (1 = Poisson)")
    p.add_argument("--tool-gap", type=float, default=0.0, help="mean seconds of an agent's tool call between turns (exponential)")
    p.add_argument("--slo-ttft", type=float, default=4.0)
    p.add_argument("--slo-tpot", type=float, default=0.05)
    p.add_argument("--attainment", type=float, default=0.99)
    p.add_argument("--prefetch", action="store_true", help="also run mode 'prefetch' (DualPath with agent-aware prefetch) next to --modes")
    p.add_argument(
        "--prefetch-gb", type=float, default=PREFETCH_CACHE_GB, help="prefetch cache per node, GB, in host DRAM beside --dram-gb"
    )
    p.add_argument("--prefetch-ttl", type=float, default=60.0, help="seconds a staged copy waits for its agent's next turn")
    ns = p.parse_args(argv)
    if not ns.rate > 0 or not ns.duration > 0 or not ns.burstiness > 0 or ns.tool_gap < 0:
        raise _Fail("--rate, --duration and --burstiness must be positive and --tool-gap >= 0")
    if not ns.prefetch_gb > 0 or not ns.prefetch_ttl > 0:
        raise _Fail(f"--prefetch-gb and --prefetch-ttl must be positive, got {ns.prefetch_gb:g} and {ns.prefetch_ttl:g}")
    from dualpath.sim.experiments import run_online, sweep_online

    modes = _modes(ns.modes, ns.read_policy)
    if ns.prefetch and "prefetch" not in modes:
        modes.append("prefetch")
    workload = _workload(ns, rate=ns.rate, burstiness=ns.burstiness, tool_gap_s=ns.tool_gap, duration_s=ns.duration)
    rows = {}
    for mode in modes:
        cfg = replace(_config(ns, mode), prefetch_gb=ns.prefetch_gb, prefetch_ttl_s=ns.prefetch_ttl)
        if ns.sweep:
            rows[mode] = sweep_online(
                cfg,
                workload,
                slo_ttft=ns.slo_ttft,
                slo_tpot=ns.slo_tpot,
                attainment=ns.attainment,
                start_rate=ns.rate,
                probes=ns.sweep_probes,
                progress=_progress(ns),
                say=_say,
            )
        else:
            rows[mode] = run_online(cfg, workload, slo_ttft=ns.slo_ttft, slo_tpot=ns.slo_tpot, progress=_progress(ns))
            rows[mode].pop("snic_series", None)
    b, d = (rows.get("basic") or {}).get("max_aps"), (rows.get("dualpath") or {}).get("max_aps")
    result = {
        "target": ns.target,
        "topology": ns.topology,
        "dataset": ns.dataset,
        "slo_ttft": ns.slo_ttft,
        "slo_tpot": ns.slo_tpot,
        "modes": rows,
        "aps_ratio": d / b if b and d else None,
    }
    out = _out(ns)
    if out is not None:
        (out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2) if ns.json else format_online(result))
    return 0


def _paper(argv: list[str]) -> int:
    from dualpath.sim.paper import main as paper_main

    return paper_main(argv)


def _validate(argv: list[str]) -> int:
    from dualpath.sim.validate import main as validate_main

    return validate_main(argv)


def _plan(argv: list[str]) -> int:
    from dualpath.sim.plan import main as plan_main

    return plan_main(argv, add_cluster_arguments, _config, _workload)


COMMANDS = {"offline": _offline, "online": _online, "paper": _paper, "validate": _validate, "plan": _plan}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"dualpath sim: unknown sub-command {argv[0]!r}; one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return command(argv[1:])
    except _Fail as exc:
        print(f"dualpath sim {argv[0]}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # bad input the checks above did not foresee (an unreadable trajectory file ...)
        from dualpath.cost import CostModelError
        from loadgen.errors import InputError, TrajectoryFormatError

        if isinstance(exc, (InputError, TrajectoryFormatError, CostModelError, ValueError)):
            print(f"dualpath sim {argv[0]}: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
