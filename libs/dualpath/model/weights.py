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
    h, hd = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if cfg.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


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
