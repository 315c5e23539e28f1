"""``make_tiny_model``: a small random checkpoint on disk, built for exactness tests.

``arch`` picks the family: ``qwen2`` (the default), ``llama``, ``qwen3``, ``qwen3_moe``,
``deepseek_v2`` or ``deepseek_v3``; the files are what transformers' own model class of that
family reads (``config.json`` fields and tensor names), written without transformers.

Cached KV and recomputed KV come from differently shaped matmuls and differ in the last
bits, so a model whose greedy choices are near-ties would diverge between the two paths
for reasons that are not bugs; a plain random model is exactly that (flat outputs, and
greedy loops that forget the prompt). The weights are therefore constructed:

- **Positional attention heads.** q and k come from the q/k biases (the weights add small
  noise). Through RoPE they give a score that depends only on the distance and peaks
  ``ATTENTION_SHARPNESS`` nats above every other distance in ``[0, max_position]`` at two
  offsets, ``d`` and ``d + 6`` (``d = 1..4``): each head copies a random projection of those
  two tokens. Layers compose offsets, so even a one-layer, two-head model reads a window of
  five tokens, and the next token depends on the prompt.
- **A loud MLP** (``MLP_GAIN``) makes the next token a hash-like, not additive, function of
  that window.
- **Peaked, printable, unbiased LM head.** Only the 62 ASCII letters and digits
  (``GENERATED_ALPHABET``) have non-zero head rows: random directions, whitened against the
  model's own final states so that logits have std ``LOGIT_SCALE`` nats and no token is
  favoured (favoured tokens are what greedy loops lock onto). So the top-1/top-2 margin is
  below 1 nat at ~0.02% of greedy steps, EOS and other special tokens are never generated,
  and every generated token is one printable byte that re-tokenizes to the same id. The
  price: sampling at temperature 1 is nearly greedy, and other tokens' logprobs are in
  the thousands.
- Measured over 15 shapes (layers 1-8, hidden 32-256, GQA 1-4, vocab 300-4096) x 6 seeds x
  40 prompts, 48 greedy tokens each: every model gave 40 different continuations, none had
  fewer than 24 distinct tokens, and margins under 1 nat were 0.02% of steps (worst model
  0.16%).
- Other families get the same peaked head and loud MLP (every expert and shared expert is
  such an MLP; routers are random). Llama and Qwen3 get the positional heads too (through
  ``attention_bias``; Qwen3's q/k norms are set so the biases keep their scale). MLA has
  no bias on its queries, so its heads are random, not positional.
- ``tie_embeddings=True`` reuses the random embedding as the head: it loads and runs, but
  its outputs are neither peaked nor printable-only (use it for plumbing, not exactness).
- The default ``torch_dtype`` is float32, so ``Decoder.load`` computes in float32 on CUDA
  too; in bfloat16 the rounding noise is ~1% of a logit and near-ties are common.

The tokenizer is byte-level without merges: ids 0..255 are the bytes, then
``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, then unreachable reserved entries up to
``vocab``; one byte of text is one token and decode/encode round-trips exactly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from dualpath.model.config import SUPPORTED_MODEL_TYPES, ModelConfig
from dualpath.model.rope import inverse_frequencies

__all__ = ["ARCHS", "GENERATED_ALPHABET", "SPECIAL_TOKENS", "make_tiny_model"]

ARCHS = SUPPORTED_MODEL_TYPES
_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258
GENERATED_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
LOGIT_SCALE = 10000.0  # std of a target logit (nats): near-ties become ~1e-4 rare
ATTENTION_SHARPNESS = 14.0  # nats between a head's attended offsets and any other
MLP_GAIN = 12.0
CALIBRATION_TOKENS = 256
WHITEN_SHRINK = 0.05
MIN_GAP = 0.05  # score units; below it a head reads one offset instead of two
QK_NOISE = 0.02
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
    arch: str = "qwen2",
    experts: int = 8,
    experts_per_token: int = 2,
    moe_intermediate: int | None = None,
    kv_lora_rank: int = 32,
    q_lora_rank: int | None = None,
    rope_head_dim: int = 8,
) -> Path:
    """Write a random checkpoint of family ``arch`` with tokenizer to ``out_dir``; return its path.

    MoE families use ``experts`` routed experts of ``moe_intermediate`` (default ``hidden``),
    ``experts_per_token`` per token; DeepSeek adds one shared expert, makes layer 0 dense
    and routes in 4 groups (V3: sigmoid scores with a correction bias, 2 groups kept). MLA
    uses ``kv_lora_rank``, ``q_lora_rank`` (None: one q_proj; V3 defaults to ``hidden // 2``),
    ``rope_head_dim`` and a no-rope / value head dim of ``hidden // heads``.

    Same arguments give byte-identical ``model.safetensors``. ``torch_dtype`` is written to
    ``config.json`` and is the dtype of the stored tensors ("float32" or "bfloat16").

    Raises:
        ValueError: ``hidden`` not divisible by ``heads``, ``heads`` not by ``kv_heads``, an
            odd head dim, ``vocab`` below 259 (bytes + specials), ``layers < 1``,
            ``max_position < 16`` or an unknown dtype.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    if hidden % heads or heads % kv_heads or (hidden // heads) % 2:
        raise ValueError(f"bad shape: hidden={hidden} heads={heads} kv_heads={kv_heads}")
    if vocab < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab={vocab} is below the {256 + len(SPECIAL_TOKENS)} byte and special tokens")
    if layers < 1 or max_position < 16:
        raise ValueError(f"need layers >= 1 and max_position >= 16, got {layers}, {max_position}")
    if torch_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"torch_dtype must be float32 or bfloat16, got {torch_dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(layers, hidden, heads, kv_heads, vocab, intermediate or 2 * hidden, max_position, tie_embeddings, torch_dtype)
    if arch != "qwen2":
        if arch == "deepseek_v3" and q_lora_rank is None:
            q_lora_rank = hidden // 2
        moe = (experts, experts_per_token, moe_intermediate or hidden)
        config = _family_config(config, arch, moe, kv_lora_rank, q_lora_rank, rope_head_dim)
    tensors = _weights(config, torch.Generator().manual_seed(seed))
    dtype = torch.float32 if torch_dtype == "float32" else torch.bfloat16
    save_file({k: t.to(dtype).contiguous() for k, t in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": 256,
            "eos_token_id": [258, 256],
            "pad_token_id": 256,
            "do_sample": False,
        },
    )
    (out / "tokenizer.json").write_text(_tokenizer(vocab).to_str(pretty=True), encoding="utf-8")
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "model_max_length": max_position,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
            "added_tokens_decoder": {
                str(256 + i): {"content": t, "special": True, "normalized": False, "lstrip": False, "rstrip": False, "single_word": False}
                for i, t in enumerate(SPECIAL_TOKENS)
            },
        },
    )
    return out


def _config(
    layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, intermediate: int, max_position: int, tie: bool, dtype: str
) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_position,
        "max_window_layers": layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta_for(hidden // heads, max_position),
        "rope_scaling": None,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": tie,
        "torch_dtype": dtype,
        "bos_token_id": 256,
        "eos_token_id": 258,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def _family_config(base: dict, arch: str, moe: tuple[int, int, int], kv_lora_rank: int, q_lora_rank: int | None, rope_dim: int) -> dict:
    """``base`` (a Qwen2 config) turned into family ``arch``'s config.json."""
    cfg = {k: v for k, v in base.items() if k not in ("max_window_layers", "sliding_window", "use_sliding_window")}
    cfg["architectures"], cfg["model_type"] = [_ARCHITECTURES[arch]], arch
    experts, per_token, moe_inter = moe
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    if arch in ("llama", "qwen3", "qwen3_moe"):
        cfg["attention_bias"] = True  # the positional heads ride on the q/k biases
        cfg["head_dim"] = cfg["hidden_size"] // heads
    if arch == "qwen3_moe":
        cfg.update(num_experts=experts, num_experts_per_tok=per_token, moe_intermediate_size=moe_inter)
        cfg.update(decoder_sparse_step=1, mlp_only_layers=[0] if layers > 1 else [], norm_topk_prob=True)
    if arch in ("deepseek_v2", "deepseek_v3"):
        head = cfg["hidden_size"] // heads
        cfg["num_key_value_heads"] = heads  # MLA keeps no KV heads; transformers reads the field as MHA
        cfg.update(q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=head, qk_rope_head_dim=rope_dim, v_head_dim=head)
        cfg.update(n_routed_experts=experts, num_experts_per_tok=per_token, moe_intermediate_size=moe_inter, n_shared_experts=1)
        cfg.update(first_k_dense_replace=1 if layers > 1 else 0, moe_layer_freq=1, routed_scaling_factor=1.0, attention_bias=False)
        groups = 4 if experts % 4 == 0 and experts // 4 * 2 >= per_token else 1
        if arch == "deepseek_v3":
            cfg.update(n_group=groups, topk_group=min(2, groups), topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True)
            cfg.update(routed_scaling_factor=2.5, rope_interleave=True)
        else:
            method = "group_limited_greedy" if groups > 1 else "greedy"
            cfg.update(n_group=groups, topk_group=min(2, groups), topk_method=method, scoring_func="softmax", norm_topk_prob=False)
        cfg["rope_theta"] = rope_theta_for(rope_dim, cfg["max_position_embeddings"])
    return cfg


def _weights(cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """All tensors, in float32, drawn from ``gen`` in a fixed order."""
    if cfg["model_type"] != "qwen2":
        return _family_weights(cfg, gen)
    h, v, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // nh

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def unit_rows(x: torch.Tensor, norm: float) -> torch.Tensor:
        # Equal row norms: no token is "louder" than another, so none becomes an attractor.
        return x * (norm / x.norm(dim=-1, keepdim=True))

    def norm_weight() -> torch.Tensor:
        return 1.0 + randn(h, std=0.05)

    t = {"model.embed_tokens.weight": unit_rows(randn(v, h, std=1.0), math.sqrt(h))}  # [V, H]
    q_bias, k_bias = _positional_biases(hd, nh, nkv, cfg["max_position_embeddings"], cfg["rope_theta"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        # q and k come from the biases; the small weights add content noise well below the
        # ATTENTION_SHARPNESS gap, so the heads stay positional.
        t[p + "self_attn.q_proj.weight"] = randn(nh * hd, h, std=QK_NOISE / math.sqrt(h))
        t[p + "self_attn.q_proj.bias"] = q_bias(i)
        t[p + "self_attn.k_proj.weight"] = randn(nkv * hd, h, std=QK_NOISE / math.sqrt(h))
        t[p + "self_attn.k_proj.bias"] = k_bias.clone()
        t[p + "self_attn.v_proj.weight"] = randn(nkv * hd, h, std=1.0 / math.sqrt(h))
        t[p + "self_attn.v_proj.bias"] = randn(nkv * hd, std=0.1)
        # Each head adds about as much to the residual as the token's own embedding.
        t[p + "self_attn.o_proj.weight"] = randn(h, nh * hd, std=1.0 / math.sqrt(hd))
        t[p + "mlp.gate_proj.weight"] = randn(inter, h, std=1.0 / math.sqrt(h))
        t[p + "mlp.up_proj.weight"] = randn(inter, h, std=1.0 / math.sqrt(h))
        # A loud MLP makes the next token a hash-like, not additive, function of the window.
        t[p + "mlp.down_proj.weight"] = randn(h, inter, std=MLP_GAIN / math.sqrt(inter))
        t[p + "input_layernorm.weight"] = norm_weight()
        t[p + "post_attention_layernorm.weight"] = norm_weight()
    t["model.norm.weight"] = norm_weight()
    if not cfg["tie_word_embeddings"]:
        targets = torch.tensor([ord(c) for c in GENERATED_ALPHABET])
        directions = unit_rows(randn(len(targets), h, std=1.0), LOGIT_SCALE)  # [62, H]
        head = torch.zeros(v, h)  # [V, H]; zero rows keep other ids ~2.5 * LOGIT_SCALE below the top
        head[targets] = (directions.double() @ _whitener(cfg, t, targets, gen)).float()
        t["lm_head.weight"] = head
    return t


def _family_weights(cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The tensors of any family by name (``expected_shapes``), drawn in sorted-name order:
    the Qwen2 recipe where the tensor has a Qwen2 twin, MLPs and experts loud, the head
    whitened."""
    from dualpath.model.weights import expected_shapes

    model = ModelConfig.from_dict(cfg)
    h, v = cfg["hidden_size"], cfg["vocab_size"]

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    positional = model.mla is None and model.attention_bias
    if positional:
        nh, nkv, hd = model.num_attention_heads, model.num_key_value_heads, model.head_dim
        q_bias, k_bias = _positional_biases(hd, nh, nkv, cfg["max_position_embeddings"], cfg["rope_theta"])
    t: dict[str, torch.Tensor] = {}
    for name, shape in sorted(expected_shapes(model).items()):
        leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
        if name == "model.embed_tokens.weight":
            x = randn(*shape, std=1.0)
            t[name] = x * (math.sqrt(h) / x.norm(dim=-1, keepdim=True))
        elif name == "lm_head.weight":
            continue  # whitened below, from the finished model
        elif name.endswith("norm.weight") and leaf in ("q_norm", "k_norm"):
            # Qwen3 normalises q and k per head: scale them back to the biases' size.
            layer_q = q_bias(0).view(nh, hd)
            rms = (
                float(layer_q.pow(2).mean(-1).sqrt().mean())
                if leaf == "q_norm"
                else float(k_bias.view(nkv, hd).pow(2).mean(-1).sqrt().mean())
            )
            t[name] = torch.full(shape, rms)
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            t[name] = 1.0 + randn(*shape, std=0.05)
        elif name.endswith("e_score_correction_bias"):
            t[name] = randn(*shape, std=0.1)
        elif name.endswith(".bias"):
            layer = int(name.split(".")[2])
            if positional and leaf == "q_proj":
                t[name] = q_bias(layer)
            elif positional and leaf == "k_proj":
                t[name] = k_bias.clone()
            elif leaf == "o_proj":
                t[name] = torch.zeros(shape)
            else:
                t[name] = randn(*shape, std=0.1)
        elif positional and leaf in ("q_proj", "k_proj"):
            t[name] = randn(*shape, std=QK_NOISE / math.sqrt(h))
        elif leaf == "down_proj":
            t[name] = randn(*shape, std=MLP_GAIN / math.sqrt(shape[1]))
        elif leaf == "o_proj":
            heads_in = shape[1] // max(1, model.num_attention_heads)
            t[name] = randn(*shape, std=1.0 / math.sqrt(heads_in))
        else:
            t[name] = randn(*shape, std=1.0 / math.sqrt(shape[1]))
    if not cfg["tie_word_embeddings"]:
        targets = torch.tensor([ord(c) for c in GENERATED_ALPHABET])
        directions = randn(len(targets), h, std=1.0)
        directions = directions * (LOGIT_SCALE / directions.norm(dim=-1, keepdim=True))
        head = torch.zeros(v, h)
        head[targets] = (directions.double() @ _whitener(cfg, t, targets, gen)).float()
        t["lm_head.weight"] = head
    return t


def rope_theta_for(head_dim: int, max_position: int) -> float:
    """10000, raised where needed so the slowest RoPE pair turns < pi over ``max_position``.

    The slow pairs are what keep a positional head's score from recurring at far distances.
    """
    return max(10000.0, (max_position / 2) ** (head_dim / (head_dim - 2))) if head_dim > 2 else 10000.0


def _whitener(cfg: dict, t: dict[str, torch.Tensor], targets: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``W [H, H]`` such that ``W @ h`` has zero mean and unit covariance over typical contexts.

    The final hidden states are not isotropic (the MLP has a mean output and favoured
    directions), so plain random head rows would make a few tokens "popular", and popular
    tokens are what greedy loops lock onto. Whitening the states of random target-alphabet
    sequences first makes every head row ``g @ W`` give logits of std ``|g|`` and no token
    favoured; the mean direction is projected out because the head has no bias to absorb it.
    Computed in float64 from the model itself, so it is as deterministic as the weights.
    """
    from dualpath.model.decoder import Decoder  # late: the decoder is not needed to write files

    tensors = {name: x.double() for name, x in t.items()}
    tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
    decoder = Decoder(ModelConfig.from_dict(cfg), tensors, torch.device("cpu"))
    ids = targets[torch.randint(0, len(targets), (4, CALIBRATION_TOKENS), generator=gen)]  # [4, T]
    rows: list[torch.Tensor] = []
    with _one_thread():
        for row in ids:
            hidden = decoder.embed(row)
            positions = torch.arange(CALIBRATION_TOKENS)
            for layer in range(decoder.num_layers):
                hidden, _, _ = decoder.forward_layer(layer, hidden, positions, [(0, CALIBRATION_TOKENS)], [None])
            rows.append(decoder.final_norm(hidden)[16:])  # skip the first tokens' short windows
        states = torch.cat(rows)  # [M, H] float64
        mean = states.mean(0)
        unit = mean / mean.norm()
        project = torch.eye(states.shape[1], dtype=torch.float64) - unit[:, None] * unit[None, :]
        values, vectors = torch.linalg.eigh(project @ torch.cov(states.T) @ project)
    # Shrinkage bounds the gain of weak directions (<= 1/sqrt(WHITEN_SHRINK) over the mean),
    # so rounding noise in them is not amplified into the logits.
    scale = (values.clamp_min(0.0) + WHITEN_SHRINK * values.mean()).rsqrt()
    return project @ vectors @ torch.diag(scale) @ vectors.T  # rows of g @ W stay orthogonal to the mean


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch single-threaded for a moment.

    Keeps the float reductions in a fixed order (same bytes whatever the thread setting)
    and avoids OpenMP spinning, which makes small matmuls ~10x slower on a busy machine.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _positional_biases(hd: int, nh: int, nkv: int, max_position: int, theta: float):
    """q/k biases that make each query head attend to two fixed relative offsets.

    RoPE turns a constant q and k into a score that depends only on the distance ``delta``:
    with k's pairs at phase 0 and q's pair ``i`` equal to ``sum_d exp(-1j * d * theta_i)``
    the score is ``sum_d sum_i cos((delta - d) * theta_i)``, peaking at each ``d``. All pairs
    take part with equal weight: the fast ones separate neighbours, the slow ones push down
    the near recurrences of the fast ones at large distances. A head reads offsets ``d`` and
    ``d + spacing`` (``d = 1..4``); the spacing (5..7, near the fastest pair's period 2*pi,
    so both peaks stay the highest) is the one with the widest gap for this head size, or
    a single offset if none has one. The gain puts the peaks ``ATTENTION_SHARPNESS`` nats
    above every other distance in ``[0, max_position]``.

    Returns ``(q_bias(layer) -> [nh * hd], k_bias [nkv * hd])``.
    """
    inv = inverse_frequencies(hd, theta, None).double()  # [hd/2]
    rel = torch.arange(-4, max_position + 1, dtype=torch.float64)  # delta - d for d in 1..4

    def gap(spacing: int) -> float:
        offsets = (0, spacing) if spacing else (0,)
        score = cast(torch.Tensor, sum(torch.cos((rel[:, None] - o) * inv[None, :]).sum(-1) for o in offsets))  # [rel]
        peaks = (rel == 0) | (rel == offsets[-1])
        return float(score[peaks].min() - score[~peaks].max())

    spacing, width = max(((s, gap(s)) for s in (6, 5, 7)), key=lambda x: x[1])
    if width < MIN_GAP:
        spacing, width = 0, gap(0)
    amp = math.sqrt(ATTENTION_SHARPNESS / width * math.sqrt(hd))  # amp^2 / sqrt(hd) = nats per unit
    k_bias = torch.cat((torch.full((hd // 2,), amp, dtype=torch.float64), torch.zeros(hd // 2, dtype=torch.float64)))

    def q_bias(layer: int) -> torch.Tensor:
        heads = []
        for head in range(nh):
            d = 1 + (layer * nh + head) % 4
            z = cast(torch.Tensor, amp * sum(torch.exp(-1j * o * inv) for o in {d, d + spacing}))
            heads.append(torch.cat((z.real, z.imag)))  # rotate-half layout
        return torch.cat(heads).float()

    return q_bias, k_bias.repeat(nkv).float()


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
