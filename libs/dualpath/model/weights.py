"""Reading HF-layout safetensors checkpoints: which tensor lives in which file, and load.

A checkpoint is ``model.safetensors``, or shards named by
``model.safetensors.index.json`` (``{"weight_map": {tensor: file}}``), or, without an
index, every ``*.safetensors`` file in the directory. Tensors the decoder does not use
(e.g. old ``rotary_emb.inv_freq`` buffers) are ignored; every tensor it does use must be
present with the shape ``config.json`` implies.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dualpath.model.config import ModelConfig
from dualpath.model.errors import ModelLoadError

__all__ = ["INDEX_FILE", "expected_shapes", "locate_tensors", "read_tensors"]

INDEX_FILE = "model.safetensors.index.json"


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for every tensor the decoder reads."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(_attention_shapes(cfg, p + "self_attn."))
        shapes.update(_mlp_shapes(cfg, i, p + "mlp."))
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def _attention_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    h, heads, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.mla is not None:
        m = cfg.mla
        if m.q_lora_rank is None:
            shapes[p + "q_proj.weight"] = (heads * m.qk_head_dim, h)
        else:
            shapes[p + "q_a_proj.weight"] = (m.q_lora_rank, h)
            shapes[p + "q_a_layernorm.weight"] = (m.q_lora_rank,)
            shapes[p + "q_b_proj.weight"] = (heads * m.qk_head_dim, m.q_lora_rank)
            if bias:
                shapes[p + "q_a_proj.bias"] = (m.q_lora_rank,)
        shapes[p + "kv_a_proj_with_mqa.weight"] = (m.kv_lora_rank + m.qk_rope_head_dim, h)
        shapes[p + "kv_a_layernorm.weight"] = (m.kv_lora_rank,)
        shapes[p + "kv_b_proj.weight"] = (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
        shapes[p + "o_proj.weight"] = (h, heads * m.v_head_dim)
        if bias:
            shapes[p + "kv_a_proj_with_mqa.bias"] = (m.kv_lora_rank + m.qk_rope_head_dim,)
            shapes[p + "o_proj.bias"] = (h,)
        return shapes
    hd = cfg.head_dim
    q_out, kv_out = heads * hd, cfg.num_key_value_heads * hd
    shapes[p + "q_proj.weight"] = (q_out, h)
    shapes[p + "k_proj.weight"] = (kv_out, h)
    shapes[p + "v_proj.weight"] = (kv_out, h)
    shapes[p + "o_proj.weight"] = (h, q_out)
    if bias:
        shapes[p + "q_proj.bias"] = (q_out,)
        shapes[p + "k_proj.bias"] = (kv_out,)
        shapes[p + "v_proj.bias"] = (kv_out,)
        if cfg.model_type != "qwen2":  # Llama and Qwen3 put attention_bias on o_proj too
            shapes[p + "o_proj.bias"] = (h,)
    if cfg.qk_norm:
        shapes[p + "q_norm.weight"] = (hd,)
        shapes[p + "k_norm.weight"] = (hd,)
    return shapes


def _mlp_shapes(cfg: ModelConfig, layer: int, p: str) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    moe = cfg.moe
    if moe is None or not cfg.is_moe_layer(layer):
        return _swiglu(p, h, cfg.intermediate_size)
    shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (moe.num_experts, h)}
    if moe.correction_bias:
        shapes[p + "gate.e_score_correction_bias"] = (moe.num_experts,)
    for e in range(moe.num_experts):
        shapes.update(_swiglu(f"{p}experts.{e}.", h, moe.intermediate_size))
    if moe.shared_intermediate_size:
        shapes.update(_swiglu(p + "shared_experts.", h, moe.shared_intermediate_size))
    return shapes


def _swiglu(p: str, h: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {p + "gate_proj.weight": (inter, h), p + "up_proj.weight": (inter, h), p + "down_proj.weight": (h, inter)}


def locate_tensors(path: Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint at ``path`` to the file holding it.

    Raises:
        ModelLoadError: no weight file, an unreadable index, a shard it names missing, or a
            safetensors header that cannot be parsed.
    """
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            located = {str(name): path / str(file) for name, file in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(index, f"cannot read 'weight_map': {exc!r}") from None
        for file in sorted(set(located.values())):
            if not file.is_file():
                raise ModelLoadError(file, f"weight shard named by {INDEX_FILE} is missing")
        return located
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(path / "model.safetensors", "no *.safetensors weight file in the checkpoint")
    located = {}
    for file in files:
        for name in _keys(file):
            located[name] = file
    return located


def read_tensors(
    located: dict[str, Path], shapes: dict[str, tuple[int, ...]], *, device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for each name in ``shapes``, cast to ``dtype`` on ``device``.

    One tensor is materialised at a time so a large model never sits twice in host memory.

    Raises:
        ModelLoadError: a tensor is missing, has the wrong shape, or its file is corrupt.
    """
    by_file: dict[Path, list[str]] = {}
    for name in shapes:
        if name not in located:
            anywhere = next(iter(sorted(set(located.values()))), Path("model.safetensors"))
            raise ModelLoadError(anywhere.parent / anywhere.name, f"tensor {name!r} missing from the checkpoint")
        by_file.setdefault(located[name], []).append(name)
    for file, names in by_file.items():
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in names:
                    tensor = handle.get_tensor(name)
                    if tuple(tensor.shape) != shapes[name]:
                        raise ModelLoadError(file, f"tensor {name!r} has shape {tuple(tensor.shape)}, config.json implies {shapes[name]}")
                    yield name, tensor.to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(file, f"cannot read safetensors file: {exc}") from None


def _keys(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            return list(handle.keys())
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(file, f"cannot read safetensors header: {exc}") from None
