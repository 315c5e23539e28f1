"""``make_tiny_model``: a small random Qwen2 checkpoint on disk, built for exactness tests.

Random weights would give flat, near-tied output distributions, and cached KV differs from
recomputed KV in the last bits, so greedy decoding would diverge between the two paths for
reasons that are not bugs. The weights are therefore constructed, not merely sampled:

- **Positional attention heads.** Each head's query and key come almost entirely from the
  q/k biases, tuned per RoPE frequency pair so that the score peaks sharply at one relative
  offset ``d`` (1..4 tokens back): the head copies a (random projection of) the token ``d``
  back. Stacked layers compose offsets, so the next token is a random function of the last
  several tokens: continuations depend on the prompt and do not fall into short cycles.
- **Peaked, printable LM head.** ``lm_head`` rows are large random directions (logit std
  ~ ``LOGIT_SCALE`` nats) for the 62 ASCII letters and digits and zero for every other id,
  so a greedy step's top-1/top-2 margin is below 1 nat only ~0.1% of the time, and every
  generated token is a single printable byte that re-tokenizes to the same id.
- ``tie_embeddings=True`` reuses the random embedding as the head: it loads and runs, but
  its outputs are neither peaked nor printable-only (use it for plumbing, not exactness).

The tokenizer is byte-level without merges: ids 0..255 are the bytes, then
``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, then unreachable reserved entries up to
``vocab``; so one byte of text is one token and decode/encode round-trips exactly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from dualpath.model.rope import inverse_frequencies

__all__ = ["GENERATED_ALPHABET", "SPECIAL_TOKENS", "make_tiny_model"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258
GENERATED_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
ROPE_THETA = 10000.0
LOGIT_SCALE = 3000.0  # std of a target logit, nats
ATTENTION_SHARPNESS = 14.0
MLP_GAIN = 12.0
CODE_FRAC = 0.0
CODE_NORM = 1.0
CODE_PENALTY = 10.0
VERBOSE = False
GATE_SCALE = 1.0
PEAKS = 2
PEAK_SPACING = 4
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_tiny_model(
    out_dir: str | Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    seed: int = 0,
    intermediate: int | None = None,
    max_position: int = 4096,
    tie_embeddings: bool = False,
    torch_dtype: str = "float32",
) -> Path:
    """Write a random Qwen2 checkpoint with tokenizer to ``out_dir``; return its path.

    Same arguments give byte-identical ``model.safetensors``. ``torch_dtype`` is written to
    ``config.json`` and is the dtype of the stored tensors ("float32" or "bfloat16").

    Raises:
        ValueError: ``hidden`` not divisible by ``heads``, ``heads`` not by ``kv_heads``, an
            odd head dim, ``vocab`` below 259 (bytes + specials) or an unknown dtype.
    """
    if hidden % heads or heads % kv_heads or (hidden // heads) % 2:
        raise ValueError(f"bad shape: hidden={hidden} heads={heads} kv_heads={kv_heads}")
    if vocab < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab={vocab} is below the {256 + len(SPECIAL_TOKENS)} byte and special tokens")
    if torch_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"torch_dtype must be float32 or bfloat16, got {torch_dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(layers, hidden, heads, kv_heads, vocab, intermediate or 2 * hidden, max_position,
                     tie_embeddings, torch_dtype)
    tensors = _weights(config, torch.Generator().manual_seed(seed))
    dtype = torch.float32 if torch_dtype == "float32" else torch.bfloat16
    save_file({k: t.to(dtype).contiguous() for k, t in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": 256, "eos_token_id": [258, 256], "pad_token_id": 256, "do_sample": False,
    })
    (out / "tokenizer.json").write_text(_tokenizer(vocab).to_str(pretty=True), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": max_position,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(256 + i): {"content": t, "special": True, "normalized": False,
                                                "lstrip": False, "rstrip": False, "single_word": False}
                                 for i, t in enumerate(SPECIAL_TOKENS)},
    })
    return out


def _config(layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, intermediate: int,
            max_position: int, tie: bool, dtype: str) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_position, "max_window_layers": layers, "rms_norm_eps": 1e-6,
        "rope_theta": ROPE_THETA, "rope_scaling": None, "sliding_window": None, "use_sliding_window": False,
        "tie_word_embeddings": tie, "torch_dtype": dtype, "bos_token_id": 256, "eos_token_id": 258,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
    }


def _weights(cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """All tensors, in float32, drawn from ``gen`` in a fixed order."""
    h, v, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // nh
    r = max(4, int(h * CODE_FRAC)) if CODE_FRAC > 0 else 0
    rest = h - r

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    emb = randn(v, h, std=1.0)
    emb[:, :rest] *= math.sqrt(rest) / emb[:, :rest].norm(dim=-1, keepdim=True)
    if r:
        emb[:, rest:] *= CODE_NORM * math.sqrt(r) / emb[:, rest:].norm(dim=-1, keepdim=True)
    t = {"model.embed_tokens.weight": emb}  # [V, H]
    q_bias, k_bias = _positional_biases(hd, nh, nkv, cfg["max_position_embeddings"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = torch.zeros(nh * hd, h)
        t[p + "self_attn.q_proj.bias"] = q_bias(i)
        t[p + "self_attn.k_proj.weight"] = torch.zeros(nkv * hd, h)
        t[p + "self_attn.k_proj.bias"] = k_bias.clone()
        v_w = randn(nkv * hd, h, std=1.0 / math.sqrt(rest))  # [nkv * hd, H]
        v_w[:, rest:] = 0.0
        t[p + "self_attn.v_proj.weight"] = v_w
        t[p + "self_attn.v_proj.bias"] = randn(nkv * hd, std=0.1)
        o_w = randn(h, nh * hd, std=1.0 / math.sqrt(hd))
        o_w[rest:] = 0.0
        t[p + "self_attn.o_proj.weight"] = o_w
        gate_up = randn(2 * inter, h, std=1.0 / math.sqrt(rest))
        gate_up[:, rest:] = 0.0
        gate_up[:inter] *= GATE_SCALE
        t[p + "mlp.gate_proj.weight"] = gate_up[:inter].clone()
        t[p + "mlp.up_proj.weight"] = gate_up[inter:].clone()
        down = randn(h, inter, std=MLP_GAIN / math.sqrt(inter))
        down[rest:] = 0.0
        t[p + "mlp.down_proj.weight"] = down
        t[p + "input_layernorm.weight"] = torch.ones(h)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h)
    t["model.norm.weight"] = torch.ones(h)
    if not cfg["tie_word_embeddings"]:
        head = torch.zeros(v, h)  # [V, H]; zero rows: non-targets sit ~2.5 * LOGIT_SCALE below the top
        targets = torch.tensor([ord(c) for c in GENERATED_ALPHABET])
        rows = randn(len(targets), h, std=1.0)
        rows[:, :rest] *= math.sqrt(rest) / rows[:, :rest].norm(dim=-1, keepdim=True)
        rows[:, :rest] *= LOGIT_SCALE / math.sqrt(h)
        if r:
            code = emb[targets, rest:]
            rows[:, rest:] = -CODE_PENALTY * LOGIT_SCALE * code / code.norm(dim=-1, keepdim=True) ** 2
        head[targets] = rows
        t["lm_head.weight"] = head
        if r:
            _calibrate(cfg, t, rest, targets)
    return t


def _calibrate(cfg, t, rest, targets):
    from dualpath.model.config import ModelConfig
    from dualpath.model.decoder import Decoder
    config = ModelConfig.from_dict(cfg)
    dec = Decoder(config, t, torch.device("cpu"))
    g = torch.Generator().manual_seed(12345)
    ids = targets[torch.randint(0, len(targets), (256,), generator=g)]
    hidden = dec.embed(ids)
    pos = torch.arange(256)
    for layer in range(dec.num_layers):
        hidden, _, _ = dec.forward_layer(layer, hidden, pos, [(0, 256)], [None])
    rms = hidden.pow(2).mean(-1).sqrt().mean()
    # code part of h is C/rms: penalty currently CODE_PENALTY*S/rms; rescale to CODE_PENALTY*S
    t["lm_head.weight"][targets, rest:] *= float(rms)
    if VERBOSE: print("rms", float(rms))


def _head_offsets(layer: int, head: int, nh: int) -> tuple[int, ...]:
    k = layer * nh + head
    d = 1 + k % 4
    return tuple(d + PEAK_SPACING * j for j in range(PEAKS))


def _positional_biases(hd: int, nh: int, nkv: int, max_position: int):
    """q/k biases whose RoPE'd dot product peaks at relative offsets ``D`` per query head."""
    inv = inverse_frequencies(hd, ROPE_THETA, None).double()  # [hd/2]
    used = (2 * math.pi / inv <= 64.0) | (torch.arange(hd // 2) == 0)
    k_amp = torch.where(used, torch.tensor(2.0 * hd ** 0.25, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    k_bias = torch.cat((k_amp, torch.zeros(hd // 2, dtype=torch.float64))).repeat(nkv).float()  # [nkv * hd]
    deltas = torch.arange(0, max_position + 1, dtype=torch.float64)

    def q_head(offsets: tuple[int, ...]) -> torch.Tensor:
        unit = torch.zeros(hd // 2, dtype=torch.complex128)
        for d in offsets:
            unit = unit + torch.exp(-1j * d * inv)
        unit = unit * used
        score = (unit[None, :] * torch.exp(1j * deltas[:, None] * inv[None, :])).real.sum(-1)  # [deltas]
        inside = torch.zeros_like(score, dtype=torch.bool)
        inside[list(offsets)] = True
        gap = float(score[inside].min() - score[~inside].max())
        scale = ATTENTION_SHARPNESS / gap * math.sqrt(hd) / (2.0 * hd ** 0.25)
        q = unit * scale
        return torch.cat((q.real, q.imag))

    def q_bias(layer: int) -> torch.Tensor:
        return torch.cat([q_head(_head_offsets(layer, h, nh)) for h in range(nh)]).float()  # [nh * hd]

    return q_bias, k_bias


def _tokenizer(vocab: int) -> HFTokenizer:
    table = _bytes_to_unicode()
    entries = {table[b]: b for b in range(256)}
    for i, token in enumerate(SPECIAL_TOKENS):
        entries[token] = 256 + i
    for i in range(256 + len(SPECIAL_TOKENS), vocab):  # never produced by encode (no merges)
        entries[f"<|reserved_{i}|>"] = i
    tok = HFTokenizer(models.BPE(vocab=entries, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by ByteLevel pre-tokenizers."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")
