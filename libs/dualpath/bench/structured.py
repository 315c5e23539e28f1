"""``dualpath bench structured``: the per-token cost of constrained decoding (llguidance token masks).

Samples the same random logits greedily with and without a grammar, through the engines' own
``sample`` (so the figure includes the mask computation, its unpacking and the ``-inf`` fill),
over a vocabulary of realistic size: a byte-level BPE trained here on the Python standard
library (``--vocab`` tokens), or a checkpoint's ``tokenizer.json`` (``--model DIR``). The
grammar is a JSON schema with strings, integers, enums, nested objects and arrays; when a
sentence ends, a new one starts. Also reported: the grammar's first compile and a cached start.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

__all__ = ["main", "run_bench"]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "count": {"type": "integer", "minimum": 0, "maximum": 100000},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "ok": {"type": "boolean"},
        "items": {
            "type": "array",
            "maxItems": 8,
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "note": {"type": "string", "maxLength": 16}},
                "required": ["id", "note"],
            },
        },
    },
    "required": ["name", "count", "kind", "ok", "items"],
}


def _train_tokenizer(out: Path, vocab: int) -> Path:
    """A byte-level BPE with ``vocab`` tokens trained on the standard library, as a checkpoint dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    texts, size = [], 0
    for f in files:
        texts.append(f.read_text(encoding="utf-8", errors="ignore"))
        size += len(texts[-1])
        if size > 16 << 20:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return out


def _tokens_per_second(model_dir: str, vocab: int, tokens: int, grammar: str | None) -> tuple[list[float], int]:
    import torch

    from dualpath.model.sampling import SamplingParams, grammar_constraint, sample
    from dualpath.model.tokenizer import Tokenizer

    eos = Tokenizer.from_dir(model_dir).eos_token_ids
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=gen)  # [N, V] made before timing
    params = SamplingParams(temperature=0.0, max_tokens=tokens, grammar=grammar)
    cons = grammar_constraint(params, model_dir)
    times, sentences = [], 1
    for i in range(tokens):
        row = logits[i : i + 1]
        t0 = time.perf_counter()
        tok = sample(row, [params], [None], eos_ids=eos, constraints=[cons])[0]
        times.append(time.perf_counter() - t0)
        if cons is not None and (tok.token_id in eos or cons.finished):
            cons = grammar_constraint(params, model_dir)  # a new sentence (cached grammar: a copy)
            sentences += 1
    return times, sentences


def _mask_only(model_dir: str, vocab: int, tokens: int, grammar: str) -> list[float]:
    """llguidance's own share: computing the next-token bitmask, nothing else."""
    import llguidance as llg
    import numpy as np
    import torch

    from dualpath.structured.grammar import vocabulary

    tok = vocabulary(model_dir, vocab)
    logits = torch.randn(tokens, vocab, generator=torch.Generator().manual_seed(0)).numpy()  # [N, V]
    mask = np.zeros((vocab + 31) // 32, dtype=np.int32)
    m, times = llg.LLMatcher(tok, grammar), []
    for i in range(tokens):
        t0 = time.perf_counter()
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        times.append(time.perf_counter() - t0)
        allowed = np.unpackbits(mask.view(np.uint8), count=vocab, bitorder="little").view(np.bool_)
        m.consume_token(int(np.where(allowed, logits[i], -np.inf).argmax()))
        if m.is_stopped():
            m = llg.LLMatcher(tok, grammar)
    return times


def run_bench(*, model: str | None = None, vocab: int = 32000, tokens: int = 2000) -> dict:
    """Measure; returns the figures (microseconds per token, milliseconds to compile)."""
    from dualpath.structured.constraint import TokenConstraint
    from dualpath.structured.grammar import json_schema_grammar, vocabulary

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model_dir = model or str(_train_tokenizer(Path(tmp) / "tok", vocab))
        train_s = time.perf_counter() - t0
        import tokenizers

        n_vocab = tokenizers.Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
        t0 = time.perf_counter()
        vocabulary(model_dir, n_vocab)
        vocab_s = time.perf_counter() - t0
        grammar = json_schema_grammar(SCHEMA)
        import torch

        row = torch.zeros(n_vocab)
        t0 = time.perf_counter()
        TokenConstraint(grammar, model_dir).apply(row)
        first_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        TokenConstraint(grammar, model_dir).apply(row)
        cached_s = time.perf_counter() - t0
        plain, _ = _tokens_per_second(model_dir, n_vocab, tokens, None)
        constrained, sentences = _tokens_per_second(model_dir, n_vocab, tokens, grammar)
        mask_only = _mask_only(model_dir, n_vocab, tokens, grammar)
    p50 = statistics.median
    return {
        "vocab": n_vocab,
        "tokens": tokens,
        "sentences": sentences,
        "tokenizer_source": model or f"BPE trained on the stdlib ({train_s:.1f} s)",
        "vocabulary_build_ms": vocab_s * 1e3,
        "grammar_first_start_ms": first_s * 1e3,
        "grammar_cached_start_ms": cached_s * 1e3,
        "sample_us_p50": p50(plain) * 1e6,
        "sample_us_mean": statistics.fmean(plain) * 1e6,
        "constrained_us_p50": p50(constrained) * 1e6,
        "constrained_us_mean": statistics.fmean(constrained) * 1e6,
        "constrained_us_p99": sorted(constrained)[int(0.99 * len(constrained))] * 1e6,
        "overhead_us_per_token_p50": (p50(constrained) - p50(plain)) * 1e6,
        "llguidance_mask_us_p50": p50(mask_only) * 1e6,
        "llguidance_mask_us_mean": statistics.fmean(mask_only) * 1e6,
    }


def format_report(r: dict) -> str:
    return "\n".join(
        [
            f"constrained decoding, vocabulary {r['vocab']} tokens ({r['tokenizer_source']}), "
            f"{r['tokens']} tokens, {r['sentences']} JSON sentences",
            f"  vocabulary build (once per checkpoint):   {r['vocabulary_build_ms']:9.1f} ms",
            f"  grammar compile (first request):          {r['grammar_first_start_ms']:9.2f} ms",
            f"  grammar start (cached, later requests):   {r['grammar_cached_start_ms']:9.2f} ms",
            f"  sample() per token, unconstrained:        {r['sample_us_p50']:9.1f} us p50  {r['sample_us_mean']:9.1f} us mean",
            (
                f"  sample() per token, under the grammar:    {r['constrained_us_p50']:9.1f} us p50  "
                f"{r['constrained_us_mean']:9.1f} us mean  {r['constrained_us_p99']:9.1f} us p99"
            ),
            f"  cost of the mask per token (p50):         {r['overhead_us_per_token_p50']:9.1f} us",
            f"  of which llguidance's bitmask:            {r['llguidance_mask_us_p50']:9.1f} us p50  "
            f"{r['llguidance_mask_us_mean']:9.1f} us mean",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dualpath bench structured", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint directory whose tokenizer.json to use (default: train a BPE)")
    p.add_argument("--vocab", type=int, default=32000, help="size of the trained BPE vocabulary (without --model)")
    p.add_argument("--tokens", type=int, default=2000, help="tokens sampled per variant")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    ns = p.parse_args(argv)
    if ns.vocab < 300 or ns.tokens < 10:
        print("dualpath bench structured: --vocab must be >= 300 and --tokens >= 10", file=sys.stderr)
        return 2
    if ns.model and not (Path(ns.model) / "tokenizer.json").is_file():
        print(f"dualpath bench structured: no tokenizer.json in {ns.model}", file=sys.stderr)
        return 2
    r = run_bench(model=ns.model, vocab=ns.vocab, tokens=ns.tokens)
    print(json.dumps(r, indent=2) if ns.json else format_report(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
