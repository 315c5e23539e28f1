"""``ModelConfig``: the architecture fields of a Hugging Face ``config.json``.

Only the Qwen2 / Llama family is supported (RMSNorm, RoPE, GQA attention, SwiGLU MLP);
other ``model_type`` values are refused at load time rather than silently mis-run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dualpath.model.errors import ModelLoadError

__all__ = ["DTYPES", "ModelConfig", "RopeScaling", "dtype_from_name"]

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
DTYPES = ("float32", "bfloat16", "float16")  # names; torch is imported only when a dtype is needed
_ROPE_KINDS = ("default", "linear", "llama3")


def dtype_from_name(name: str) -> torch.dtype:
    """Map ``"float32" | "bfloat16" | "float16"`` to the torch dtype.

    Raises:
        KeyError: for any other name.
    """
    if name not in DTYPES:
        raise KeyError(name)
    import torch

    return getattr(torch, name)


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeScaling:
    """``rope_scaling`` of ``config.json`` (``linear`` or Llama 3's ``llama3``)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """Architecture of a Qwen2 / Llama decoder, as read from ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    rope_scaling: RopeScaling | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``<path>/config.json``.

        Raises:
            ModelLoadError: the file is missing or not a JSON object, a required field is
                missing or mistyped, or the architecture is not supported.
        """
        file = Path(path) / "config.json"
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelLoadError(file, "config.json not found") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelLoadError(file, f"cannot read config.json: {exc}") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(file, "config.json is not a JSON object")
        return cls.from_dict(raw, source=file)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str | Path = "config.json") -> ModelConfig:
        """Build from the parsed ``config.json`` object; ``source`` names it in errors.

        Raises:
            ModelLoadError: as ``from_dir``.
        """
        f = _Fields(raw, Path(source))
        model_type = f.get("model_type", str)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(source, f"field 'model_type': {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(source, f"field 'hidden_act': {act!r} unsupported (only 'silu')")
        heads = f.positive("num_attention_heads")
        hidden = f.positive("hidden_size")
        kv_heads = f.positive("num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise ModelLoadError(source, f"field 'num_key_value_heads': {heads} heads not divisible by {kv_heads}")
        head_dim = f.positive("head_dim", default=hidden // heads if hidden % heads == 0 else None)
        if head_dim % 2:
            raise ModelLoadError(source, f"field 'head_dim': {head_dim} is odd (RoPE needs pairs)")
        dtype = raw.get("torch_dtype", raw.get("dtype", "float32"))
        if dtype not in DTYPES:
            raise ModelLoadError(source, f"field 'torch_dtype': {dtype!r} is not one of {tuple(DTYPES)}")
        return cls(
            model_type=model_type,
            vocab_size=f.positive("vocab_size"),
            hidden_size=hidden,
            intermediate_size=f.positive("intermediate_size"),
            num_hidden_layers=f.positive("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=f.number("rms_norm_eps", default=1e-6),
            rope_theta=f.number("rope_theta", default=10000.0),
            max_position_embeddings=f.positive("max_position_embeddings", default=2048),
            tie_word_embeddings=f.get("tie_word_embeddings", bool, default=False),
            attention_bias=f.get("attention_bias", bool, default=model_type == "qwen2"),
            torch_dtype=dtype,
            bos_token_id=f.token_ids("bos_token_id", allow_list=False),
            eos_token_id=f.token_ids("eos_token_id", allow_list=True),
            rope_scaling=_rope_scaling(raw.get("rope_scaling"), Path(source)),
        )

    @property
    def dtype(self) -> torch.dtype:
        """The checkpoint's torch dtype (``torch_dtype``)."""
        return dtype_from_name(self.torch_dtype)

    def kv_bytes_per_token_layer(self, dtype: torch.dtype) -> int:
        """Bytes of one token's K and V in one layer: ``2 * kv_heads * head_dim * itemsize``."""
        return 2 * self.num_key_value_heads * self.head_dim * dtype.itemsize


class _Fields:
    """Typed reads of ``config.json`` fields whose errors name the file and field."""

    _MISSING = object()

    def __init__(self, raw: dict[str, Any], source: Path) -> None:
        self.raw, self.source = raw, source

    def get(self, name: str, kind: type, *, default: Any = _MISSING) -> Any:
        value = self.raw.get(name)
        if value is None:
            if default is self._MISSING or default is None:
                raise ModelLoadError(self.source, f"required field {name!r} is missing")
            return default
        # bool is an int subclass; a JSON true is never a valid layer count.
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ModelLoadError(self.source, f"field {name!r}: expected {kind.__name__}, got {value!r}")
        return value

    def positive(self, name: str, *, default: Any = _MISSING) -> int:
        value = self.get(name, int, default=default)
        if value <= 0:
            raise ModelLoadError(self.source, f"field {name!r}: must be positive, got {value}")
        return value

    def number(self, name: str, *, default: float) -> float:
        value = self.raw.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ModelLoadError(self.source, f"field {name!r}: expected a positive number, got {value!r}")
        return float(value)

    def token_ids(self, name: str, *, allow_list: bool) -> Any:
        value = self.raw.get(name)
        if value is None:
            return None
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        if allow_list and isinstance(value, list):
            ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
            value = list(value)
        if not ok:
            raise ModelLoadError(self.source, f"field {name!r}: expected token id(s), got {value!r}")
        return value


def _rope_scaling(raw: Any, source: Path) -> RopeScaling | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ModelLoadError(source, f"field 'rope_scaling': expected an object, got {raw!r}")
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind not in _ROPE_KINDS:
        raise ModelLoadError(source, f"field 'rope_scaling': rope_type {kind!r} unsupported {_ROPE_KINDS}")
    if kind == "default":
        return None
    try:
        return RopeScaling(
            kind=kind,
            factor=float(raw.get("factor", 1.0)),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
        )
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(source, f"field 'rope_scaling': {exc}") from None
