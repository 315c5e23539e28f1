"""Run one testbed mode: a stack with emulated hardware, the load generator against it, and
the cluster figures sampled meanwhile."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dualpath.bus.embedded import free_port
from dualpath.cli.experiment.sampler import ClusterSampler
from dualpath.cli.launcher.stack import Stack, StackConfig
from dualpath.cli.launcher.topology import Topology, parse_topology
from dualpath.cli.launcher.up import ensure_model
from dualpath.config import EmulationConfig
from dualpath.cost import resolve_target
from dualpath.protocol.subjects import Role

__all__ = [
    "ABLATION",
    "MODES",
    "Mode",
    "ModeResult",
    "TestbedSpec",
    "add_cluster_arguments",
    "emulation_config",
    "loadgen_command",
    "prepare",
    "run_mode",
    "stack_config",
    "stack_cpu_seconds",
]


@dataclass(frozen=True, slots=True)
class Mode:
    policy: str
    read_path: str
    oracle: bool = False
    layerwise: bool = True
    label: str = ""
    prefetch: bool = False  # agent-aware prefetch, with a cache beside the node buffer (HardwareProfile.prefetch_cache_gb)


MODES = {
    "basic": Mode("basic", "pe", label="Basic: PE read path, round robin, layer-wise prefill"),
    "dualpath": Mode("dualpath", "auto", label="DualPath: both read paths, DualPath scheduler"),
    "oracle": Mode("dualpath", "auto", oracle=True, label="Oracle: no storage reads, no KV transfers"),
    # the ablation's steps (paper: + layer-wise prefill, + dual-path loading, + the scheduler)
    "basic-nolw": Mode("basic", "pe", layerwise=False, label="Basic without layer-wise prefill"),
    "dualpath-rr": Mode("round_robin", "auto", label="+ dual-path loading (round robin, shorter read queue)"),
    # beyond the paper (issue 16): each request's hit blocks split between both storage NICs
    "split": Mode("dualpath", "split", label="DualPath + split reads (--read-policy split)"),
    "prefetch": Mode("dualpath", "auto", prefetch=True, label="DualPath + agent-aware prefetch (--prefetch)"),
}
ABLATION = ("basic-nolw", "basic", "dualpath-rr", "dualpath")


@dataclass(frozen=True, slots=True, kw_only=True)
class TestbedSpec:
    model: str
    topology: Topology
    target: str
    scale: float
    gpu: str = "h800"  # the modeled GPU profile (dualpath.cost.GPUS)
    gpus_per_node: int
    snic_gbps: float
    cnic_gbps: float
    dataset: str
    agents: int
    turns: int
    seed: int
    out: Path
    slowdown: float = 1.0  # slow motion: modeled times x, NIC rates / (reported times divided back)
    warmup_turns: int = 0  # offline: run each agent's first turns before the clock starts
    warmup_slowdown: float = 0.1  # the warm-up's stack runs fast-forward (its timing is not measured)
    stream_interval: int = 1  # decode tokens per streamed event
    online_rate: float = 0.0  # 0 = offline (all agents at once)
    duration: float = 0.0
    extra_loadgen: tuple[str, ...] = ()
    model_traffic: str = "auto"  # MoE all-to-all on the emulated CNICs: auto (cross-node share), on, off
    warm_dir: Path | None = None  # where the shared warm-up storage is kept (default: out)
    nic_classes: int = 2  # 2: model traffic first, KV low priority; 1: one FIFO queue (no isolation)
    untimed_turns: int = 0  # each agent's lead-in turns on the timed stack, before its ``turns`` timed ones


@dataclass(slots=True, kw_only=True)
class ModeResult:
    mode: str
    report: dict
    nodes: dict[str, list[tuple[float, int, int]]]
    engines: dict[str, dict]
    wall_s: float
    loadgen_exit: int
    snic_rate: float  # emulated bytes/s of one node's SNIC (host seconds)
    slowdown: float = 1.0  # host seconds per modeled second
    extra: dict = field(default_factory=dict)


def emulation_config(spec: TestbedSpec, oracle: bool, slowdown: float) -> EmulationConfig:
    """The emulation settings of one stack of ``spec``."""
    return _emulation(spec, oracle, slowdown)


def _emulation(spec: TestbedSpec, oracle: bool, slowdown: float) -> EmulationConfig:
    return EmulationConfig(
        compute="modeled",
        target=spec.target,
        gpu=spec.gpu,
        scale=spec.scale,
        gpus_per_node=spec.gpus_per_node,
        engines_per_node=spec.topology.engines_per_node,
        snic_gbps=spec.snic_gbps,
        cnic_gbps=spec.cnic_gbps,
        oracle=oracle,
        slowdown=slowdown,
        model_traffic=spec.model_traffic,
        nic_classes=spec.nic_classes,
    )


def decode_hbm_tokens(target: str, gpu: str = "h800") -> int:
    """KV tokens one decode GPU's HBM holds for ``target`` (the cost model: HBM less weights and
    a reserve), so HBM admission constrains decode batches as on the modeled cluster."""
    from dualpath.cost import cost_model

    return cost_model(target, gpu).hbm_kv_capacity_tokens()


def stack_config(spec: TestbedSpec, m: Mode, emu: EmulationConfig, out: Path) -> StackConfig:
    """The testbed stack of ``spec`` in mode ``m``: storage and logs under ``out``."""
    buffer_mb = max(64, emu.profile().buffer_bytes(spec.topology.engines_per_node) >> 20)
    return StackConfig(
        model=spec.model,
        topology=spec.topology,
        storage=str(out / "storage"),
        run_dir=str(out / "run"),
        port=free_port(),
        policy=m.policy,
        read_path=m.read_path,
        emulation=emu,
        buffer_mb=buffer_mb,
        prefetch_mb=max(1, emu.profile().prefetch_cache_bytes(spec.topology.engines_per_node) >> 20) if m.prefetch else 0,
        kv_capacity_tokens=decode_hbm_tokens(spec.target, spec.gpu),
        # Fewer, larger token events: the 2-core emulation host's CPU goes to the
        # modeled cluster, not to per-token messaging (TTFT is unaffected).
        extra_env={
            "DUALPATH_STREAM_INTERVAL": str(spec.stream_interval),
            "DUALPATH_MAX_RUNNING": "1024",
            "DUALPATH_LAYERWISE": str(m.layerwise).lower(),
            # the emulated SNIC models the write time; local fsyncs would add the host disk's
            "DUALPATH_STORAGE_FSYNC": "false",
        },
    )


def loadgen_command(spec: TestbedSpec, url: str, turns: int, out: Path) -> list[str]:
    """The ``loadgen.cli`` command line running ``turns`` turns of spec's agents against ``url``."""
    return [
        sys.executable,
        "-m",
        "loadgen.cli",
        "--url",
        url,
        "--dataset",
        spec.dataset,
        "--agents",
        str(spec.agents),
        "--turns",
        str(turns),
        "--tokenizer",
        spec.model,
        "--out",
        str(out),
        "--progress",
        "never",
        "--no-plots",
        "--seed",
        str(spec.seed),
        "--request-timeout",
        "3600",
        *spec.extra_loadgen,
    ]


def _warm_up(spec: TestbedSpec, mode: str, out: Path, say) -> None:
    """Run every agent's first ``warmup_turns`` turns, untimed, on a fast-forwarded stack
    (``warmup_slowdown``) over the mode's storage: their KV is then persisted and indexed, as
    it is for the agents of a long rollout, whose first turn is a small share of 60-157 turns.
    The timed stack then starts on that storage (the index is durable)."""
    m = MODES[mode]
    emu = _emulation(spec, False, spec.warmup_slowdown)
    say(f"[{mode}] warm-up: the first {spec.warmup_turns} turn(s) of every agent, untimed, at {1 / spec.warmup_slowdown:g}x speed")
    stack = Stack(stack_config(spec, m, emu, out)).start(timeout=300)
    try:
        t0 = time.monotonic()
        cmd = [*loadgen_command(spec, stack.url, spec.warmup_turns, out / "warmup"), "--offline"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            say(f"[{mode}] warm-up load generator exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
        say(f"[{mode}] warm-up done in {time.monotonic() - t0:.0f} s")
    finally:
        stack.stop()


def _warm_key(spec: TestbedSpec) -> str:
    """What the warm-up's storage depends on (not the mode: KV bytes are the same whichever
    path loaded them)."""
    import hashlib

    key = json.dumps(
        [
            spec.model,
            spec.target,
            spec.scale,
            spec.dataset,
            spec.agents,
            spec.seed,
            spec.warmup_turns,
            list(spec.extra_loadgen),
            spec.topology.prefill_nodes,
            spec.topology.decode_nodes,
        ]
    )
    return hashlib.blake2b(key.encode(), digest_size=6).hexdigest()


def _warmed_storage(spec: TestbedSpec, mode: str, out: Path, say) -> None:
    """The mode's storage after the warm-up: the first mode runs it, later modes (and reruns
    with the same settings) start from a copy of its storage, index included."""
    cached = (spec.warm_dir or spec.out) / f"warm-storage-{_warm_key(spec)}"
    if not (cached / ".complete").exists():
        _warm_up(spec, mode, out, say)
        shutil.rmtree(cached, ignore_errors=True)
        shutil.copytree(out / "storage", cached)
        (cached / ".complete").write_text("")
        return
    shutil.copytree(cached, out / "storage", ignore=shutil.ignore_patterns(".complete"))
    say(f"[{mode}] storage from the shared warm-up ({cached.name})")


def run_mode(spec: TestbedSpec, mode: str, say=print) -> ModeResult:
    """Start a fresh stack (empty storage) for ``mode``, run the agents, stop; return the figures."""
    m = MODES[mode]
    emu = _emulation(spec, m.oracle, spec.slowdown)
    out = spec.out / mode
    for stale in ("storage", "run", "warmup", "loadgen"):  # a fresh start, also when --out is reused
        shutil.rmtree(out / stale, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    offline = not spec.online_rate
    if spec.warmup_turns:  # offline, and online probes: agents met mid-trajectory with their history in storage
        _warmed_storage(spec, mode, out, say)
    motion = f", {spec.slowdown:g}x slow motion" if spec.slowdown != 1 else ""
    say(f"[{mode}] starting {spec.topology} stack ({m.label or m.policy}){motion}")
    gateway_log = out / "run" / "logs" / "gateway.log"
    failed_before = _count_in_log(gateway_log, "kv_lookup_failed")  # the warm-up's, if it ran here
    stack = Stack(stack_config(spec, m, emu, out)).start(timeout=300)
    sampler = ClusterSampler(stack.nats_url, stack.namespace, **stack.nats_options(Role.OBSERVER)).start()
    try:
        cmd = loadgen_command(spec, stack.url, spec.untimed_turns + spec.turns, out / "loadgen")
        cmd += ["--offline"] if offline else ["--rate", str(spec.online_rate), "--duration", str(spec.duration)]
        if spec.untimed_turns:
            cmd += ["--untimed-turns", str(spec.untimed_turns)]
        how = " (all at once)" if offline else f" at {spec.online_rate} APS"
        lead = f" after {spec.untimed_turns} untimed" if spec.untimed_turns else ""
        say(f"[{mode}] {spec.agents} agents x {spec.turns} turns{lead} of the {spec.dataset} set{how}")
        sampler.reset_clock()
        cpu0, lg0 = stack_cpu_seconds(stack), _children_cpu_s()
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wall = time.monotonic() - t0
        cpu = {name: max(0.0, s - cpu0.get(name, 0.0)) for name, s in stack_cpu_seconds(stack).items()}
        cpu["loadgen"] = _children_cpu_s() - lg0
        time.sleep(2 * 0.2 + 0.1)  # one more round of reports
    finally:
        sampler.stop()
        stack.stop()
    report_path = out / "loadgen" / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    if proc.returncode != 0:
        say(f"[{mode}] load generator exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    failures = max(0, _count_in_log(gateway_log, "kv_lookup_failed") - failed_before)
    if failures:
        say(f"[{mode}] warning: {failures} index lookups timed out (served as full recomputes: fewer hits, a slower run)")
    return ModeResult(
        mode=mode,
        report=report,
        nodes=sampler.nodes,
        engines=sampler.engines,
        wall_s=wall,
        loadgen_exit=proc.returncode,
        snic_rate=emu.profile().snic_bytes_per_s(spec.topology.engines_per_node),
        slowdown=spec.slowdown,
        extra={"kv_lookup_failures": failures, "cpu_s": cpu, "loadavg": os.getloadavg()},
    )


def stack_cpu_seconds(stack: Stack) -> dict[str, float]:
    """Host CPU seconds (user + system, all threads) each of the stack's processes used so far
    (Linux ``/proc``; empty elsewhere): where the emulation host's cores go."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    for name, proc in stack.procs:
        try:
            stat = Path(f"/proc/{proc.pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is fields[0]
        out[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def _children_cpu_s() -> float:
    """CPU seconds of this process's finished children (the load generator, once waited for)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _count_in_log(path: Path, event: str) -> int:
    """Lines of a service log naming ``event`` (0 when there is no log)."""
    try:
        with path.open(errors="replace") as f:
            return sum(event in line for line in f)
    except OSError:
        return 0


def add_cluster_arguments(p) -> None:
    """Flags every testbed experiment shares: the modeled cluster and the emulation scale."""
    p.add_argument(
        "--target",
        default="ds27b",
        help="modeled model: a name (ds660b, ds27b, qwen32b, dsv3) or a path to a model's config.json (any supported architecture)",
    )
    p.add_argument("--gpu", default="h800", help="modeled GPU: h800, h100")
    p.add_argument("--topology", default="1P1D", help="xPyD nodes")
    p.add_argument(
        "--read-policy",
        default="",
        choices=("", "auto", "split"),
        help="split: also run mode 'split' (DualPath with each request's hits read by both sides) next to --modes",
    )
    p.add_argument(
        "--prefetch",
        action="store_true",
        help="also run mode 'prefetch' (DualPath with agent-aware prefetch, a cache beside the buffer) next to --modes",
    )
    p.add_argument("--engines-per-node", type=int, default=2, help="engine processes per node (SNIC scaled to match the GPUs)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--scale", type=float, default=1000.0, help="bytes and bandwidths divided by this (times preserved)")
    p.add_argument("--snic-gbps", type=float, default=400.0)
    p.add_argument("--cnic-gbps", type=float, default=400.0)
    p.add_argument("--seed", type=int, default=0)


def _check_load(ns) -> None:
    """The load's flags, checked before any stack starts (ValueError says which is wrong)."""
    from loadgen.synthetic import SPECS

    if ns.agents < 1 or ns.turns < 1:
        raise ValueError(f"--agents and --turns must be at least 1, got {ns.agents} and {ns.turns}")
    if ns.dataset.lower() not in SPECS and not Path(ns.dataset).is_file():
        raise ValueError(f"--dataset must be one of {', '.join(SPECS)} or a trajectory JSONL file; {ns.dataset!r} is neither")


def prepare(ns, prog: str, **spec_fields) -> tuple[TestbedSpec, list[str]] | None:
    """Validate modes and topology, make the output dir and model; None (message printed) on bad input."""
    modes = [m.strip() for m in ns.modes.split(",") if m.strip()]
    if getattr(ns, "read_policy", "") == "split" and "split" not in modes:
        modes.append("split")
    if getattr(ns, "prefetch", False) and "prefetch" not in modes:
        modes.append("prefetch")
    try:
        topology = parse_topology(ns.topology, ns.engines_per_node)
        bad = [m for m in modes if m not in MODES]
        if bad:
            raise ValueError(f"unknown mode(s) {bad}; choose from {sorted(MODES)}")
        _check_load(ns)
        target = resolve_target(ns.target)  # a path made absolute for the services
        EmulationConfig(
            compute="modeled",
            target=target,
            gpu=ns.gpu,
            scale=ns.scale,
            gpus_per_node=ns.gpus_per_node,
            engines_per_node=ns.engines_per_node,
            snic_gbps=ns.snic_gbps,
            cnic_gbps=ns.cnic_gbps,
        ).validate()
    except (ValueError, LookupError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = TestbedSpec(
        model=ensure_model("", str(out), long_context=True),
        topology=topology,
        target=target,
        gpu=ns.gpu,
        scale=ns.scale,
        gpus_per_node=ns.gpus_per_node,
        snic_gbps=ns.snic_gbps,
        cnic_gbps=ns.cnic_gbps,
        dataset=ns.dataset,
        agents=ns.agents,
        turns=ns.turns,
        seed=ns.seed,
        out=out,
        **spec_fields,
    )
    return spec, modes
