"""``dualpath bench engine``: our decoder's prefill and decode speed against transformers'.

Both run the same checkpoint, dtype, device and thread count, in one process, one after
the other:

- **prefill**: one sequence of ``--prefill-tokens`` tokens from position 0 through every
  layer, ending with the last token's logits (ours: ``Decoder.forward_layer`` per layer, the
  prefill engine's call; transformers: ``model(ids, use_cache=True, logits_to_keep=1)``);
- **decode**: ``--batch`` sequences of ``--context`` cached tokens each, ``--decode-steps``
  greedy steps (ours: ``engine.decode.decode_step`` over ``KvMemory``, the decode engine's
  step; transformers: ``model(next_ids, cache=cache, logits_to_keep=1)``). Both start from
  the KV of a prefill of the same tokens, and both write each step's KV in place into memory
  allocated beforehand, as a server does: transformers gets a ``StaticCache`` (its
  ``DynamicCache`` would copy the whole cache at every layer of every step, a cost no server
  pays; ``transformers_cache`` says ``dynamic`` where the installed version has no layered
  ``StaticCache``).

Each figure is the median of ``--repeats`` timed runs after one warm-up, ours and
transformers' runs alternating. ``prefill_ratio`` and
``decode_ratio`` are ours / transformers (above 1: ours is faster). Without ``--model``,
``--arch`` makes a checkpoint of ~100M-parameter shape (12 layers, hidden 768) with
``make_tiny_model`` in a temporary folder.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "run_bench"]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _once(fn, setup, device) -> float:
    state = setup()
    _sync(device)
    t0 = time.perf_counter()
    fn(state)
    _sync(device)
    return time.perf_counter() - t0


def _compare(ours, theirs, device, repeats: int) -> tuple[float, float]:
    """Median seconds of each ``(fn, setup)`` pair (``fn(setup())``, setup not timed) over
    ``repeats`` runs after a warm-up each, the two alternating so that a noisy neighbour
    slows both alike."""
    for fn, setup in (ours, theirs):
        _once(fn, setup, device)  # warm-up (allocator, kernels, caches)
    a, b = [], []
    for _ in range(repeats):
        a.append(_once(ours[0], ours[1], device))
        b.append(_once(theirs[0], theirs[1], device))
    return statistics.median(a), statistics.median(b)


def _none() -> None:
    return None


def _static_cache(model, prefix, batch: int, max_len: int):
    """A transformers ``StaticCache`` of ``max_len`` tokens for ``batch`` sequences, filled
    by ``_refill``, or None where the installed transformers has no ``StaticCache`` made of
    layers with a ``cumulative_length`` tensor."""
    import torch
    import transformers

    layers = getattr(prefix, "layers", None)
    if layers is None or not hasattr(transformers, "StaticCache"):
        return None
    cache: Any = transformers.StaticCache(config=model.config, max_cache_len=max_len)  # layers typed loosely across versions
    if len(cache.layers) != len(layers) or not all(isinstance(getattr(x, "cumulative_length", None), torch.Tensor) for x in cache.layers):
        return None
    for dst, src in zip(cache.layers, layers):
        dst.lazy_initialization(src.keys.expand(batch, -1, -1, -1), src.values.expand(batch, -1, -1, -1))
    return _refill(cache, prefix)


def _refill(cache, prefix):
    """``cache`` (from ``_static_cache``) holding the ``DynamicCache`` ``prefix`` (one
    sequence) for each of its sequences, and nothing after it: copied afresh, as our decode
    run copies its sequences' KV into newly allocated memory."""
    for dst, src in zip(cache.layers, prefix.layers):
        t = src.keys.shape[2]
        dst.keys[:, :, :t].copy_(src.keys.expand(dst.keys.shape[0], -1, -1, -1))  # [B, kvh, T, hd]
        dst.values[:, :, :t].copy_(src.values.expand(dst.values.shape[0], -1, -1, -1))
        dst.cumulative_length.fill_(t)
    return cache


def make_bench_model(out: Path, arch: str) -> Path:
    """A ~100M-parameter checkpoint of family ``arch`` (12 layers, hidden 768)."""
    from dualpath.model import make_tiny_model

    kw: dict = {"layers": 12, "hidden": 768, "heads": 12, "kv_heads": 4, "vocab": 4096, "intermediate": 2048, "max_position": 8192}
    if arch in ("qwen3_moe", "deepseek_v2", "deepseek_v3"):
        kw.update(experts=16, experts_per_token=2, moe_intermediate=512)
    if arch in ("deepseek_v2", "deepseek_v3"):
        kw.update(kv_lora_rank=256, rope_head_dim=32, q_lora_rank=None if arch == "deepseek_v2" else 384)
    return make_tiny_model(out, arch=arch, **kw)


def run_bench(
    model: str | Path, *, batch: int = 8, context: int = 1024, prefill_tokens: int = 2048, decode_steps: int = 16,
    device: str = "cpu", dtype: str = "float32", repeats: int = 3, progress=None,
) -> dict:  # fmt: skip
    """Measure both engines on ``model``; see the module docstring."""
    import torch
    import transformers

    from dualpath.engine.decode import DecodeSequence, KvMemory, decode_step
    from dualpath.model import Decoder
    from dualpath.model.config import dtype_from_name

    say = progress or (lambda _msg: None)
    dev, dt = torch.device(device), dtype_from_name(dtype)
    ours = Decoder.load(model, device=dev, dtype=dt)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dt).to(dev).eval()  # type: ignore[arg-type]
    vocab = ours.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, min(vocab, 256), (max(prefill_tokens, context),), generator=gen)
    result: dict = {
        "model": str(model),
        "arch": ours.config.model_type,
        "attention": ours.config.attention,
        "moe": ours.config.moe is not None,
        "params_m": round(sum(p.numel() for p in theirs.parameters()) / 1e6, 1),
        "kv_bytes_per_token": ours.config.kv_bytes_per_token_layer(dt) * ours.num_layers,
        "device": str(dev),
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "batch": batch,
        "context": context,
        "prefill_tokens": prefill_tokens,
        "decode_steps": decode_steps,
    }

    with torch.inference_mode():
        ids = prompt[:prefill_tokens].to(dev)

        def ours_prefill(_):
            hidden, pos = ours.embed(ids), torch.arange(prefill_tokens, device=dev)
            for layer in range(ours.num_layers):
                hidden, _, _ = ours.forward_layer(layer, hidden, pos, [(0, prefill_tokens)], [None])
            return ours.logits(hidden[-1:])

        def theirs_prefill(_):
            return theirs(ids[None], use_cache=True, logits_to_keep=1).logits

        say(f"prefill {prefill_tokens} tokens: ours and transformers, {repeats} runs each")
        t_ours, t_theirs = _compare((ours_prefill, _none), (theirs_prefill, _none), dev, repeats)
        result.update(
            prefill_tok_s_ours=round(prefill_tokens / t_ours, 1),
            prefill_tok_s_transformers=round(prefill_tokens / t_theirs, 1),
            prefill_ratio=round(t_theirs / t_ours, 3),
        )

        ctx = prompt[:context].to(dev)
        logits, k, v = ours.forward_full(ctx.tolist())
        first = int(logits[-1].argmax())
        spec = ours.kv_spec
        memory = KvMemory(
            layers=ours.num_layers,
            spec=spec,
            dtype=dt,
            device=dev,
            capacity_tokens=batch * (context + decode_steps + 64) * 2,
            block_tokens=64,
        )
        base = torch.empty((ours.num_layers, context, spec.width), dtype=dt, device=dev)
        for layer in range(ours.num_layers):
            spec.pack_into(base[layer], k[layer], v[layer])

        def ours_setup():
            seqs = []
            for i in range(batch):
                kv = memory.allocate(context + decode_steps)
                memory.tokens(kv)[:, :context].copy_(spec.as_rows(base))
                seqs.append(DecodeSequence(request_id=str(i), tokens=[], kv=kv, kv_len=context))
            return seqs

        def ours_decode(seqs):
            tokens = [first] * batch
            for _ in range(decode_steps):
                tokens = decode_step(ours, memory, seqs, tokens).argmax(-1).tolist()
            for s in seqs:
                memory.release(s.kv)

        cache_kw = "cache" if "cache" in inspect.signature(theirs.forward).parameters else "past_key_values"
        out = theirs(ctx[None], use_cache=True)
        cache0 = out.cache if cache_kw == "cache" else out.past_key_values
        static = _static_cache(theirs, cache0, batch, context + decode_steps)
        result["transformers_cache"] = "dynamic" if static is None else "static"

        def theirs_setup():
            if static is not None:
                return _refill(static, cache0)  # the run before's steps forgotten, its memory kept
            cache = copy.deepcopy(cache0)
            cache.batch_repeat_interleave(batch)
            return cache

        def theirs_decode(cache):
            nxt = torch.full((batch, 1), first, device=dev)
            for _ in range(decode_steps):
                step = theirs(nxt, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
                cache = cache if static is not None else step[cache_kw]
                nxt = step.logits[:, -1].argmax(-1, keepdim=True)

        say(f"decode {batch} x {context} context, {decode_steps} steps: ours and transformers, {repeats} runs each")
        d_ours, d_theirs = _compare((ours_decode, ours_setup), (theirs_decode, theirs_setup), dev, repeats)
        tokens = batch * decode_steps
        result.update(
            decode_tok_s_ours=round(tokens / d_ours, 1),
            decode_tok_s_transformers=round(tokens / d_theirs, 1),
            decode_ratio=round(d_theirs / d_ours, 3),
        )
    return result


def format_report(r: dict) -> str:
    return "\n".join(
        [
            f"{r['arch']} ({r['attention']}{', MoE' if r['moe'] else ''}, {r['params_m']}M params, KV {r['kv_bytes_per_token']} B/token)"
            f" on {r['device']} {r['dtype']}, {r['threads']} threads",
            f"  prefill {r['prefill_tokens']} tokens:   ours {r['prefill_tok_s_ours']:>10.1f} tok/s   transformers "
            f"{r['prefill_tok_s_transformers']:>10.1f} tok/s   ratio {r['prefill_ratio']:.2f}",
            f"  decode {r['batch']} x {r['context']} ctx:    ours {r['decode_tok_s_ours']:>10.1f} tok/s   transformers "
            f"{r['decode_tok_s_transformers']:>10.1f} tok/s   ratio {r['decode_ratio']:.2f}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    from dualpath.model.tiny import ARCHS

    p = argparse.ArgumentParser(prog="dualpath bench engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint directory (HF layout)")
    src.add_argument(
        "--arch", action="append", choices=ARCHS, help="make a ~100M-parameter checkpoint of this family (repeatable; default qwen2)"
    )
    p.add_argument("--batch", type=int, default=8, help="decode: sequences in the batch")
    p.add_argument("--context", type=int, default=1024, help="decode: cached tokens per sequence")
    p.add_argument("--prefill-tokens", type=int, default=2048, help="prefill: tokens from position 0")
    p.add_argument("--decode-steps", type=int, default=16, help="decode: greedy steps timed")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per figure (median)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    ns = p.parse_args(argv)
    if min(ns.batch, ns.context, ns.prefill_tokens, ns.decode_steps, ns.repeats) < 1:
        p.error("--batch, --context, --prefill-tokens, --decode-steps and --repeats must be >= 1")
    try:
        import transformers  # noqa: F401
    except ImportError:
        p.error("needs transformers (pip install transformers): it is what the engine is compared with")

    def progress(msg: str) -> None:
        print(f"[bench engine] {msg}", file=sys.stderr, flush=True)

    kw = dict(batch=ns.batch, context=ns.context, prefill_tokens=ns.prefill_tokens, decode_steps=ns.decode_steps)
    kw.update(device=ns.device, dtype=ns.dtype, repeats=ns.repeats, progress=progress)
    results = []
    if ns.model:
        if not (Path(ns.model) / "config.json").is_file():
            p.error(f"--model {ns.model}: no config.json there")
        results.append(run_bench(ns.model, **kw))
    else:
        with tempfile.TemporaryDirectory(prefix="dualpath-bench-engine-") as tmp:
            for arch in ns.arch or ["qwen2"]:
                progress(f"making a {arch} checkpoint (12 layers, hidden 768)")
                results.append(run_bench(make_bench_model(Path(tmp) / arch, arch), **kw))
    if ns.json:
        json.dump(results[0] if len(results) == 1 else results, sys.stdout, indent=2)
        print()
    else:
        print("\n".join(format_report(r) for r in results))
    return 0
