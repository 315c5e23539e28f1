"""Target models of the cost model: Hugging Face ``config.json`` files.

A target is any ``config.json`` that ``dualpath.model.config.ModelConfig`` reads (the file
the torch engine loads), flattened by ``ModelTarget.from_config`` (``dualpath.cost.arch``,
where the formulas are). ``get_target`` takes a name of ``TARGETS`` or a path to a
``config.json`` (or its directory), so every ``--target`` flag takes either.

The named targets ship as config files in ``configs/``:

- ``qwen32b``: Qwen2.5-32B's published ``config.json``; KV in bf16 (``2 * 8 * 128 * 2`` =
  4,096 B per token per layer).
- ``dsv3``: DeepSeek-V3's published ``config.json``.
- ``ds660b``: DeepSeek-V3.2-Exp's, the paper's 660B: V3's file with ``model_type``
  ``deepseek_v32`` and the lightning indexer's ``index_n_heads``, ``index_head_dim``,
  ``index_topk`` (top-2048 sparse attention). The torch engine does not serve V3.2 (no
  indexer), so this module reads it as ``deepseek_v3`` plus those three fields.
- ``ds27b``: the paper's DeepSeek 27B, an internal model. The file is V3.2's format with
  the sizes PAPER.md states (hidden 2560, 30 layers, 72 routed + 2 shared experts, top-6,
  sparse top-k 1024) and assumed values where the paper says nothing: 32 heads, q_lora
  768, one dense first layer, expert width 1536 (this makes the total ~27B), dense width
  12,288 (8 experts), V3's vocabulary and V3.2's indexer shape.

What a config file does not say is the deployment, kept here per name: the DeepSeek
targets serve FP8 weights (their ``quantization_config``) and an FP8 KV cache in
FlashMLA's format (656 B per token per layer, ``dualpath.cost.arch``), and their default
expert-parallel group (16 for the 660B: the paper's prefill side is 2 nodes x 8 GPUs and
EP 8 would not fit; 8 for the 27B, which the paper runs 1P1D). In bf16 (1,152 B) V3's
cache-compute ratio would be 7.6-9.0 GB/PFLOP, not the paper's 4.8-5.8, so the paper
evidently counts the FP8 format. V3.2's indexer keys (132 B per token per layer) count in
HBM capacity and decode reads but not in the KV that storage moves: the paper's 13-36
matches only without them.

A path target is served as its checkpoint says: weights in ``torch_dtype`` (FP8 when its
``quantization_config`` says so), KV in ``torch_dtype`` (what the torch engine stores),
no expert parallelism.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dualpath.cost.arch import ModelTarget, SparseAttention
from dualpath.cost.errors import TargetConfigError, UnknownTargetError
from dualpath.model.config import ModelConfig
from dualpath.model.errors import ModelLoadError

__all__ = ["CONFIG_DIR", "NAMED_TARGETS", "TARGETS", "ModelTarget", "NamedTarget", "get_target", "load_target", "resolve_target"]

CONFIG_DIR = Path(__file__).with_name("configs")


@dataclass(frozen=True, slots=True, kw_only=True)
class NamedTarget:
    """A named target: its config file in ``CONFIG_DIR`` and how it is deployed."""

    file: str
    title: str  # what reports and errors call it
    kv_cache_dtype: str = "auto"
    default_ep: int = 1


NAMED_TARGETS: dict[str, NamedTarget] = {
    "qwen32b": NamedTarget(file="qwen32b.json", title="Qwen2.5-32B"),
    "ds660b": NamedTarget(file="ds660b.json", title="DeepSeek-V3.2", kv_cache_dtype="fp8", default_ep=16),
    "ds27b": NamedTarget(file="ds27b.json", title="DeepSeek-27B", kv_cache_dtype="fp8", default_ep=8),
    "dsv3": NamedTarget(file="dsv3.json", title="DeepSeek-V3", kv_cache_dtype="fp8", default_ep=16),
}

_V32 = "deepseek_v32"  # DeepSeek-V3.2: V3 plus the lightning indexer


def _read(file: Path) -> dict[str, Any]:
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TargetConfigError(str(file), "config.json not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TargetConfigError(str(file), f"cannot read it: {exc}") from None
    if not isinstance(raw, dict):
        raise TargetConfigError(str(file), "not a JSON object")
    return raw


def _sparse(raw: dict[str, Any], file: Path) -> SparseAttention:
    fields = {}
    for key, name in (("index_topk", "topk"), ("index_n_heads", "heads"), ("index_head_dim", "head_dim")):
        value = raw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise TargetConfigError(str(file), f"field {key!r}: expected a positive integer, got {value!r}")
        fields[name] = value
    return SparseAttention(**fields)


def load_target(path: str | Path, *, name: str = "", kv_cache_dtype: str = "auto", default_ep: int = 1) -> ModelTarget:
    """The target described by ``path``: a ``config.json`` or a directory holding one.

    ``name`` (default: the file's path) names it in reports and errors.

    Raises:
        TargetConfigError: the file is missing or unreadable, or ``ModelConfig`` refuses it
            (an unsupported ``model_type``, a missing or mistyped field).
    """
    path = Path(path)
    file = path if path.suffix == ".json" and not path.is_dir() else path / "config.json"
    raw = _read(file)
    sparse = None
    if raw.get("model_type") == _V32:
        sparse = _sparse(raw, file)
        raw = {**raw, "model_type": "deepseek_v3"}
    try:
        cfg = ModelConfig.from_dict(raw, source=file)
    except ModelLoadError as exc:
        raise TargetConfigError(str(file), exc.detail) from None
    quant = raw.get("quantization_config")
    fp8 = isinstance(quant, dict) and quant.get("quant_method") == "fp8"
    return ModelTarget.from_config(
        cfg,
        name=name or str(file),
        sparse=sparse,
        kv_cache_dtype=kv_cache_dtype,
        weight_bytes=1 if fp8 else None,
        default_ep=default_ep,
    )


def _named(name: str) -> ModelTarget:
    n = NAMED_TARGETS[name]
    return load_target(CONFIG_DIR / n.file, name=n.title, kv_cache_dtype=n.kv_cache_dtype, default_ep=n.default_ep)


TARGETS: dict[str, ModelTarget] = {name: _named(name) for name in NAMED_TARGETS}


@functools.lru_cache(maxsize=64)
def _path_target(resolved: str, mtime_ns: int) -> ModelTarget:
    return load_target(resolved)


def resolve_target(spec: str) -> str:
    """``spec`` as a command line should pass it on: a name unchanged, a path as the absolute
    path of its ``config.json`` (child processes may run elsewhere), checked by loading it.

    Raises:
        UnknownTargetError, TargetConfigError: as ``get_target``.
    """
    get_target(spec)
    if spec in TARGETS:
        return spec
    path = Path(spec).expanduser()
    return str((path / "config.json" if path.is_dir() else path).resolve())


def get_target(spec: str) -> ModelTarget:
    """The target ``spec`` names: a key of ``TARGETS``, or a path to a ``config.json`` (or
    to the checkpoint directory holding it), read once per file version.

    Raises:
        UnknownTargetError: ``spec`` is neither a name nor an existing path; the message
            lists the names.
        TargetConfigError: the path's config cannot be used (``load_target``).
    """
    target = TARGETS.get(spec)
    if target is not None:
        return target
    path = Path(spec).expanduser()
    if not path.exists():
        raise UnknownTargetError(spec, list(TARGETS))
    file = path / "config.json" if path.is_dir() else path
    try:
        mtime = file.stat().st_mtime_ns
    except OSError:
        raise TargetConfigError(str(file), "config.json not found") from None
    return _path_target(str(file.resolve()), mtime)
