"""``dualpath up``: serve a model with the whole stack on this machine until Ctrl-C.

    dualpath up [--model DIR] [--topology 1P1D] [--engines-per-node 1] [--port 8000]
                [--storage PATH] [--policy dualpath] [--read-path auto|pe|de] [--device cpu]
                [--replicas 2] [--nats-cluster 3] [--data-tls]

Every service is supervised: a child that dies is restarted with back-off while the others
keep serving, and the event is printed and logged (``<run-dir>/logs/supervisor.log``).
``--api-key-file FILE`` gives each caller a tenant (``KEY TENANT`` lines): tenants share no KV
cache block, and ``--tenant-max-concurrency`` / ``--tenant-tokens-per-minute`` limit each one.
``--replicas 2`` runs the redundant form (two schedulers, one active behind a JetStream
lease; two kv-persistence replicas of a JetStream-replicated index); ``--nats-cluster 3``
runs three clustered nats-servers instead of one. ``--data-tls`` sends the KV between nodes
over mutual TLS (a throwaway CA and per-host certificates in ``<run-dir>/data-tls``).

Without ``--model`` a tiny random checkpoint is made in ``<run-dir>/tiny-model`` (first run)
and served, so the command works on a fresh machine with no downloads.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from dualpath.cli.launcher.stack import Stack, StackConfig, StackError
from dualpath.cli.launcher.topology import parse_topology
from dualpath.config import (
    EmulationConfig,
    EngineConfig,
    GatewayConfig,
    ModelConfigSpec,
    NodeConfig,
    SchedulerConfig,
    default_of,
)
from dualpath.tenant import configured_keys

__all__ = ["build_parser", "ensure_model", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpath up", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="checkpoint directory (HF layout); default: a tiny model made on first run")
    p.add_argument("--topology", default="1P1D", help="xPyD: prefill and decode nodes (default 1P1D)")
    p.add_argument("--engines-per-node", type=int, default=1, help="engines (GPUs) per node")
    p.add_argument("--port", type=int, default=default_of(GatewayConfig, "port"), help="gateway port on 127.0.0.1")
    p.add_argument("--host", default=default_of(GatewayConfig, "host"), help="gateway listen address")
    p.add_argument("--run-dir", default=".dualpath", help="logs, storage and the tiny model live here")
    p.add_argument("--storage", default="", help="KV storage root (default: <run-dir>/storage); a shared mount at scale")
    p.add_argument("--policy", default=default_of(SchedulerConfig, "policy"), help="dualpath, round_robin, least_tokens, basic")
    p.add_argument(
        "--read-path",
        "--read-policy",
        dest="read_path",
        default=default_of(SchedulerConfig, "read_path"),
        choices=("auto", "pe", "de", "split"),
        help="which side reads hit KV: auto (shorter read queue), pe, de, or split (each request's hit blocks "
        "divided between both sides' storage NICs, beyond the paper)",
    )
    p.add_argument(
        "--prefetch",
        action="store_true",
        help="agent-aware prefetch: when a session's answer ends, stage its blocks in its prefill node's "
        "DRAM while the agent runs its tool (session from X-Session-ID, the user field or dualpath_session)",
    )
    p.add_argument(
        "--prefetch-mb", type=int, default=256, help="prefetch cache per node, MiB, in host DRAM beside --buffer-mb (with --prefetch)"
    )
    p.add_argument(
        "--prefetch-ttl",
        type=float,
        default=default_of(NodeConfig, "prefetch_ttl_s"),
        help="seconds a prefetched block waits for its session's next turn (with --prefetch)",
    )
    p.add_argument("--device", default=default_of(ModelConfigSpec, "device"), help="torch device for engines (cpu, cuda)")
    p.add_argument("--buffer-mb", type=int, default=default_of(NodeConfig, "buffer_mb"), help="DRAM buffer per node, MiB")
    p.add_argument(
        "--compute-quota-ms",
        type=float,
        default=default_of(EngineConfig, "compute_quota_ms"),
        help="prefill compute quota per batch, ms (paper §6.2): FIFO packing while the predicted batch time fits",
    )
    p.add_argument("--nats-url", default="", help="use this NATS server instead of an embedded one")
    p.add_argument(
        "--data-tls",
        action="store_true",
        help="run the tcp data plane (KV between nodes) over mutual TLS, with a throwaway CA and one "
        "certificate per data-plane host made in <run-dir>/data-tls",
    )
    p.add_argument(
        "--api-key", default="", help="require this key on every route but /health (Authorization: Bearer or x-api-key); tenant 'default'"
    )
    p.add_argument(
        "--api-key-file",
        default=default_of(GatewayConfig, "api_key_file"),
        help="one 'KEY TENANT [max_concurrency=N] [tokens_per_minute=N]' per line (# comments): each caller's tenant, "
        "whose KV cache no other tenant can hit, and its limits",
    )
    p.add_argument(
        "--tenant-max-concurrency",
        type=int,
        default=default_of(GatewayConfig, "tenant_max_concurrency"),
        help="requests in flight per tenant; beyond, 429 with Retry-After (0: no limit; the key file may set its own)",
    )
    p.add_argument(
        "--tenant-tokens-per-minute",
        type=int,
        default=default_of(GatewayConfig, "tenant_tokens_per_minute"),
        help="prompt plus generated tokens per tenant per minute; beyond, 429 with Retry-After (0: no limit)",
    )
    p.add_argument(
        "--tool-parser",
        default=default_of(GatewayConfig, "tool_parser"),
        help="tool-call format: auto (from the template), hermes, llama3_json",
    )
    p.add_argument(
        "--reasoning-parser",
        default=default_of(GatewayConfig, "reasoning_parser"),
        choices=("", "deepseek_r1", "qwen3"),
        help="return <think>…</think> apart from the content: deepseek_r1, qwen3 (default: none)",
    )
    p.add_argument("--replicas", type=int, default=1, help="schedulers and kv-persistence replicas (2+: no single point of failure)")
    p.add_argument("--nats-cluster", type=int, default=1, choices=(1, 3, 5), help="local nats-servers (3 or 5: a JetStream cluster)")
    p.add_argument(
        "--nats-tls",
        action="store_true",
        help="local nats-servers speak mutual TLS (a throwaway CA under --run-dir; one client certificate per service)",
    )
    p.add_argument(
        "--nats-open",
        action="store_true",
        help="local nats-servers without authorization (any local process may read every prompt and token; "
        "default: one identity per service, least-privilege permissions)",
    )
    p.add_argument("--no-restart", action="store_true", help="do not restart services that die (stop the stack instead)")
    p.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for every engine")
    t = p.add_argument_group("testbed (emulated cluster hardware, modeled compute)")
    t.add_argument(
        "--compute",
        default=default_of(EmulationConfig, "compute"),
        choices=("torch", "modeled"),
        help="real torch model or cost-model time",
    )
    t.add_argument(
        "--target",
        default=default_of(EmulationConfig, "target"),
        help="modeled target: a name (ds660b, ds27b, qwen32b, dsv3) or a path to a model's config.json (any supported architecture)",
    )
    t.add_argument("--gpu", default=default_of(EmulationConfig, "gpu"), help="modeled GPU: h800, h100")
    t.add_argument(
        "--scale", type=float, default=default_of(EmulationConfig, "scale"), help="testbed scale factor (bytes and bandwidths / scale)"
    )
    t.add_argument(
        "--snic-gbps",
        type=float,
        default=default_of(EmulationConfig, "snic_gbps"),
        help="emulated storage NIC per node (0 = none; testbed default 400)",
    )
    t.add_argument(
        "--cnic-gbps",
        type=float,
        default=default_of(EmulationConfig, "cnic_gbps"),
        help="emulated compute NIC per GPU (0 = none; testbed default 400)",
    )
    t.add_argument(
        "--gpus-per-node",
        type=int,
        default=default_of(EmulationConfig, "gpus_per_node"),
        help="emulated GPUs per node (SNIC share per engine)",
    )
    t.add_argument(
        "--mode",
        default="",
        choices=("", "basic", "dualpath", "oracle"),
        help="paper modes: basic (PE read path, round robin), dualpath, oracle (no reads or KV transfers)",
    )
    return p


def emulation_from(ns):
    """The ``EmulationConfig`` the flags describe (None for a plain real-model deployment)."""
    from dualpath.config import EmulationConfig
    from dualpath.cost import resolve_target

    if ns.compute != "modeled" and not ns.snic_gbps and not ns.cnic_gbps and ns.mode != "oracle":
        return None
    modeled = ns.compute == "modeled"
    return EmulationConfig(
        compute=ns.compute,
        target=resolve_target(ns.target) if modeled else ns.target,  # a path made absolute for the services
        gpu=ns.gpu,
        scale=ns.scale if modeled else 1.0,
        gpus_per_node=ns.gpus_per_node,
        engines_per_node=ns.engines_per_node,
        snic_gbps=ns.snic_gbps or (400.0 if modeled else 0.0),
        cnic_gbps=ns.cnic_gbps or (400.0 if modeled else 0.0),
        oracle=ns.mode == "oracle",
    )


def mode_policy(mode: str, policy: str, read_path: str) -> tuple[str, str]:
    """(policy, read path) for a paper mode; explicit flags otherwise."""
    if mode == "basic":
        return "basic", "pe"
    if mode in ("dualpath", "oracle"):
        return "dualpath", "split" if mode == "dualpath" and read_path == "split" else "auto"
    return policy, read_path


def ensure_model(model: str, run_dir: str, *, long_context: bool = False) -> str:
    """The model directory to serve: ``model`` as given, or the tiny model (made if absent).

    ``long_context``: a tiny model whose context fits the testbed's 64K+ token agents (modeled
    compute uses only its tokenizer and config).
    """
    if model:
        if not (Path(model) / "config.json").exists():
            raise FileNotFoundError(f"--model {model}: no config.json there (expected a Hugging Face checkpoint directory)")
        return model
    path = Path(run_dir) / ("tiny-model-long" if long_context else "tiny-model")
    if not (path / "config.json").exists():
        from dualpath.model import make_tiny_model

        print(f"making a tiny random model in {path} ...", file=sys.stderr, flush=True)
        make_tiny_model(path, max_position=262144 if long_context else 4096)
    return str(path)


def _print_event(event) -> None:
    if event.kind == "exited":
        print(f"dualpath up: {event.name} exited (code {event.code}); restarting in {event.backoff_s:.1f}s", file=sys.stderr, flush=True)
    elif event.kind == "restarted":
        print(f"dualpath up: {event.name} restarted (restart #{event.restarts}, pid {event.pid})", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        if ns.replicas < 1:
            raise ValueError("--replicas must be at least 1")
        if ns.prefetch and (ns.prefetch_mb < 1 or not ns.prefetch_ttl > 0):
            raise ValueError(f"--prefetch needs --prefetch-mb >= 1 and --prefetch-ttl > 0, got {ns.prefetch_mb} and {ns.prefetch_ttl:g}")
        if not ns.compute_quota_ms > 0:
            raise ValueError(f"--compute-quota-ms must be positive, got {ns.compute_quota_ms:g}")
        if ns.tenant_max_concurrency < 0 or ns.tenant_tokens_per_minute < 0:
            raise ValueError("--tenant-max-concurrency and --tenant-tokens-per-minute must be >= 0 (0: no limit)")
        configured_keys(ns.api_key, ns.api_key_file)  # a bad key file is refused now, naming its line (KeyFileError)
        topology = parse_topology(ns.topology, ns.engines_per_node)
        emu = emulation_from(ns)
        if emu is not None:
            emu.validate()
        model = ensure_model(ns.model, ns.run_dir, long_context=ns.compute == "modeled")
    except (ValueError, LookupError, FileNotFoundError) as exc:
        print(f"dualpath up: {exc}", file=sys.stderr)
        return 2
    policy, read_path = mode_policy(ns.mode, ns.policy, ns.read_path)
    cfg = StackConfig(
        model=model,
        topology=topology,
        storage=ns.storage or str(Path(ns.run_dir) / "storage"),
        run_dir=ns.run_dir,
        port=ns.port,
        host=ns.host,
        policy=policy,
        read_path=read_path,
        device=ns.device,
        buffer_mb=ns.buffer_mb,
        compute_quota_ms=ns.compute_quota_ms,
        nats_url=ns.nats_url,
        data_tls=ns.data_tls,
        api_key=ns.api_key,
        api_key_file=ns.api_key_file,
        tenant_max_concurrency=ns.tenant_max_concurrency,
        tenant_tokens_per_minute=ns.tenant_tokens_per_minute,
        tool_parser=ns.tool_parser,
        reasoning_parser=ns.reasoning_parser,
        emulation=emu,
        replicas=ns.replicas,
        nats_cluster=ns.nats_cluster,
        nats_auth=not ns.nats_open,
        nats_tls=ns.nats_tls,
        supervise=not ns.no_restart,
        prefetch_mb=ns.prefetch_mb if ns.prefetch else 0,
        prefetch_ttl_s=ns.prefetch_ttl,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stack = Stack(cfg, on_event=_print_event)
    t0 = time.monotonic()
    try:
        stack.start(timeout=ns.ready_timeout, progress=lambda msg: print(msg, flush=True))
    except StackError as exc:
        print(f"dualpath up: {exc}", file=sys.stderr)
        return 1
    name = Path(model).resolve().name
    print(
        f"ready in {time.monotonic() - t0:.1f}s: topology {topology}, model {name!r}, storage {cfg.storage}\n"
        f"  OpenAI API: {stack.url}/v1  (try: curl {stack.url}/v1/models)\n  Ctrl-C stops everything.",
        flush=True,
    )
    code = 0
    try:
        while not stop.is_set():
            try:
                if not cfg.supervise:  # supervised stacks restart what dies instead
                    stack.check_alive()
            except StackError as exc:
                print(f"dualpath up: {exc}", file=sys.stderr)
                code = 1
                break
            stop.wait(0.5)
    finally:
        print("stopping ...", flush=True)
        codes = stack.stop()
        bad = {k: v for k, v in codes.items() if v not in (0, None, -signal.SIGTERM)}
        print("stopped" + (f" (non-zero exits: {bad})" if bad else ""), flush=True)
    return code
