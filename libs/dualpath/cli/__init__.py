"""The ``dualpath`` command: one entry point for serving, services, tools and benchmarks.

dualpath up --model DIR --topology 1P1D [--port 8000] [--storage PATH]
dualpath netns up|status|link|shape|down   (the deployment across network namespaces, one per host; root)
dualpath nats-auth --out DIR --topology 1P1D|--roles [--tls --host H]   (NATS identities for compose, k8s)
dualpath make-tiny-model DIR [--arch qwen2|llama|qwen3|qwen3_moe|deepseek_v2|deepseek_v3 --layers N --hidden H ...]
dualpath service NAME [service flags]      (gateway, scheduler, kv-persistence, traffic-manager,
                                            prefill-engine, decode-engine)
dualpath demo                              (a multi-turn conversation against a fresh stack)
dualpath bench scheduler|transfer|loadgen [--json]
dualpath loadgen --url URL --dataset 32k|48k|64k|FILE ...
dualpath experiment offline|online ...     (the paper's experiments on the emulated testbed)
dualpath trace show REQUEST_ID --file F | --jaeger URL
dualpath sim offline|online|paper|validate|plan ...   (the paper's experiments in a cluster simulator)
dualpath compiled build|status             (the simulator's hot path as mypyc extensions)
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main"]

SERVICES = {
    "gateway": "services.gateway.service",
    "scheduler": "services.scheduler.service",
    "kv-persistence": "services.kv_persistence.service",
    "traffic-manager": "services.traffic_manager.service",
    "prefill-engine": "services.prefill_engine.service",
    "decode-engine": "services.decode_engine.service",
}

# Sub-commands whose flags belong to another module: everything after the name is passed on.
PASSTHROUGH = {
    "service": None,
    "loadgen": "loadgen.cli",
    "up": "dualpath.cli.launcher.up",
    "netns": "dualpath.cli.launcher.netns_up",
    "demo": "dualpath.cli.launcher.demo",
    "bench": "dualpath.bench",
    "experiment": "dualpath.cli.experiment",
    "trace": "dualpath.cli.trace",
    "sim": "dualpath.cli.sim",
    "compiled": "dualpath.compiled",
    "nats-auth": "dualpath.cli.nats_auth",
}


def _make_tiny_model(argv: list[str]) -> int:
    from dualpath.model.tiny import ARCHS

    p = argparse.ArgumentParser(
        prog="dualpath make-tiny-model", description="write a tiny random checkpoint (HF layout) of a supported family"
    )
    p.add_argument("dir", help="output directory")
    p.add_argument("--arch", choices=ARCHS, default="qwen2", help="model family (config.json model_type)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-position", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=None, help="dense MLP width (default 2 x hidden)")
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--experts", type=int, default=8, help="MoE families: routed experts")
    p.add_argument("--experts-per-token", type=int, default=2, help="MoE families: experts per token")
    p.add_argument("--moe-intermediate", type=int, default=None, help="MoE families: width of one expert (default hidden)")
    p.add_argument("--kv-lora-rank", type=int, default=32, help="DeepSeek: the latent a token keeps per layer")
    p.add_argument("--q-lora-rank", type=int, default=None, help="DeepSeek: q's low-rank width (V2 default none, V3 hidden/2)")
    p.add_argument("--rope-head-dim", type=int, default=8, help="DeepSeek: the rotary key a token keeps per layer")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ns = p.parse_args(argv)
    from dualpath.model import ModelLoadError, make_tiny_model

    try:
        path = make_tiny_model(
            ns.dir,
            layers=ns.layers,
            hidden=ns.hidden,
            heads=ns.heads,
            kv_heads=ns.kv_heads,
            vocab=ns.vocab,
            seed=ns.seed,
            max_position=ns.max_position,
            tie_embeddings=ns.tie_embeddings,
            intermediate=ns.intermediate,
            torch_dtype=ns.dtype,
            arch=ns.arch,
            experts=ns.experts,
            experts_per_token=ns.experts_per_token,
            moe_intermediate=ns.moe_intermediate,
            kv_lora_rank=ns.kv_lora_rank,
            q_lora_rank=ns.q_lora_rank,
            rope_head_dim=ns.rope_head_dim,
        )
    except (ValueError, OSError) as exc:
        p.error(str(exc))
    except ModelLoadError as exc:  # a combination of sizes config.json cannot express
        p.error(str(exc))
    print(f"wrote {path} (config.json, model.safetensors, tokenizer.json)")
    return 0


def _usage() -> int:
    print(__doc__.strip())
    return 2


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["sim"]:  # this process is the simulator: its heap on huge pages
        from dualpath.sim.hugepages import prepare

        prepare()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "make-tiny-model":
        return _make_tiny_model(rest)
    if cmd == "service":
        if not rest or rest[0] not in SERVICES:
            print(f"dualpath service NAME: NAME is one of {', '.join(SERVICES)}", file=sys.stderr)
            return 2
        return importlib.import_module(SERVICES[rest[0]]).main(rest[1:])
    module = PASSTHROUGH.get(cmd)
    if module is None:
        print(f"dualpath: unknown command {cmd!r}\n", file=sys.stderr)
        return _usage()
    return importlib.import_module(module).main(rest)


if __name__ == "__main__":
    sys.exit(main())
