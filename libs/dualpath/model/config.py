"""``ModelConfig``: the architecture fields of a Hugging Face ``config.json``.

Supported families (``SUPPORTED_MODEL_TYPES``):

- ``qwen2``, ``llama``: RMSNorm, RoPE, GQA attention, SwiGLU MLP;
- ``qwen3``: as qwen2 with a per-head RMSNorm on q and k (``q_norm``/``k_norm``) and an
  explicit ``head_dim``; ``qwen3_moe`` adds sparse MoE MLPs (``num_experts``,
  ``decoder_sparse_step``, ``mlp_only_layers``);
- ``deepseek_v2``, ``deepseek_v3``: multi-head latent attention (MLA: the KV of a token is
  one compressed latent plus one shared rotary key) and MoE MLPs with shared experts,
  grouped routing and softmax or sigmoid scoring.

Other ``model_type`` values are refused at load time rather than silently mis-run. Both
the Hub's spelling (``rope_theta`` + ``rope_scaling``) and transformers 5's
(``rope_parameters``) are read.
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

__all__ = ["DTYPES", "SUPPORTED_MODEL_TYPES", "KvSpec", "MlaConfig", "ModelConfig", "MoeConfig", "RopeScaling", "dtype_from_name"]

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3")
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
DTYPES = ("float32", "bfloat16", "float16")  # names; torch is imported only when a dtype is needed
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # for figures that must not import torch (the gateway)
_ROPE_KINDS = ("default", "linear", "llama3", "yarn")
_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


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
    """``rope_scaling`` of ``config.json``: ``linear``, Llama 3's ``llama3`` or ``yarn``.

    ``yarn`` fields (``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``,
    ``attention_factor``, ``truncate``) are read as transformers reads them; ``None`` means
    the field was absent.
    """

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3)."""

    q_lora_rank: int | None  # None: q comes from one q_proj
    kv_lora_rank: int  # the latent a token keeps per layer (after kv_a_layernorm)
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # the rotary key a token keeps per layer, shared by all heads
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True, kw_only=True)
class MoeConfig:
    """Sparse mixture-of-experts MLPs: which layers have them and how tokens are routed."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int  # per routed expert
    shared_intermediate_size: int  # all shared experts fused into one MLP (0: none)
    norm_topk_prob: bool
    scoring: str  # "softmax" | "sigmoid"
    topk_method: str  # "greedy" | "group_limited_greedy" | "noaux_tc"
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    correction_bias: bool  # a per-expert e_score_correction_bias added for the choice only
    router_fp32: bool  # router logits in float32 whatever the model dtype (DeepSeek)
    layers: tuple[int, ...]  # indices of the MoE layers; the others are dense


@dataclass(frozen=True, slots=True)
class KvSpec:
    """What one token keeps per layer: two parts ``k`` and ``v`` laid out back to back.

    GQA: ``k`` and ``v`` are ``[kv_heads, head_dim]`` each (K with RoPE applied).
    MLA: ``k`` is the latent ``[1, kv_lora_rank]`` (after its norm), ``v`` the rotary key
    ``[1, qk_rope_head_dim]`` (RoPE applied). Storage, buffers, both read paths and the
    decode engine's memory all hold exactly these ``width`` values per token per layer.
    """

    kind: str  # "gqa" | "mla"
    k_shape: tuple[int, int]
    v_shape: tuple[int, int]

    @property
    def k_width(self) -> int:
        return self.k_shape[0] * self.k_shape[1]

    @property
    def width(self) -> int:
        """Values per token per layer."""
        return self.k_width + self.v_shape[0] * self.v_shape[1]

    def bytes_per_token_layer(self, dtype: torch.dtype) -> int:
        return self.width * dtype.itemsize

    def unpack(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, width]`` -> views ``k [T, *k_shape]``, ``v [T, *v_shape]`` (no copy)."""
        t = kv.shape[0]
        return kv[:, : self.k_width].view(t, *self.k_shape), kv[:, self.k_width :].view(t, *self.v_shape)

    def pack_into(self, out: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k [T, *k_shape]`` and ``v [T, *v_shape]`` into ``out [T, width]``."""
        t = out.shape[0]
        out[:, : self.k_width].copy_(k.reshape(t, self.k_width))
        out[:, self.k_width :].copy_(v.reshape(t, -1))

    @property
    def rows(self) -> tuple[int, int]:
        """``(heads, head_width)``: a token's ``width`` values as rows, one per KV head (K's
        heads then V's for GQA; MLA's one row of latent and rotary key). The decode engine's
        memory keeps each row's tokens back to back (head-major, ``[heads, T, head_width]``),
        so that attention reads one head's keys as one contiguous run."""
        if self.kind == "gqa":
            return self.k_shape[0] + self.v_shape[0], self.k_shape[1]
        return 1, self.width

    def as_rows(self, kv: torch.Tensor) -> torch.Tensor:
        """Token-major ``[..., T, width]`` as a view ``[..., T, heads, head_width]`` (``rows``)."""
        return kv.unflatten(-1, self.rows)

    def pack_rows_into(self, out: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k [T, *k_shape]`` and ``v [T, *v_shape]`` into head-major ``out [heads, T, head_width]``."""
        if self.kind == "gqa":
            out[: self.k_shape[0]].copy_(k.transpose(0, 1))
            out[self.k_shape[0] :].copy_(v.transpose(0, 1))
        else:
            self.pack_into(out[0], k, v)

    def unpack_rows(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Head-major ``[heads, T, head_width]`` -> views ``k [T, *k_shape]``, ``v [T, *v_shape]`` (no copy)."""
        if self.kind == "gqa":
            return buf[: self.k_shape[0]].transpose(0, 1), buf[self.k_shape[0] :].transpose(0, 1)
        return self.unpack(buf[0])


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """Architecture of a supported decoder, as read from ``config.json``.

    ``head_dim`` is the per-head width of q and k for GQA families; for MLA it is the rotary
    part's width (``qk_rope_head_dim``), as transformers sets it.
    """

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
    qk_norm: bool = False
    mla: MlaConfig | None = None
    moe: MoeConfig | None = None
    rope_interleave: bool = False  # DeepSeek: rotary pairs are (2i, 2i+1), not (i, i + d/2)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``<path>/config.json`` (or ``path`` itself when it names a ``.json`` file).

        Raises:
            ModelLoadError: the file is missing or not a JSON object, a required field is
                missing or mistyped, or the architecture is not supported.
        """
        path = Path(path)
        file = path if path.suffix == ".json" and not path.is_dir() else path / "config.json"
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
            raise ModelLoadError(
                source, f"field 'model_type': {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(source, f"field 'hidden_act': {act!r} unsupported (only 'silu')")
        if raw.get("mlp_bias"):
            raise ModelLoadError(source, "field 'mlp_bias': true is unsupported")
        heads = f.positive("num_attention_heads")
        hidden = f.positive("hidden_size")
        # MLA has no KV heads (a token keeps one latent); the field is left at a default there
        kv_heads = heads if model_type in MLA_MODEL_TYPES else f.positive("num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise ModelLoadError(source, f"field 'num_key_value_heads': {heads} heads not divisible by {kv_heads}")
        mla = _mla(f) if model_type in MLA_MODEL_TYPES else None
        if mla is not None:
            head_dim = mla.qk_rope_head_dim
        else:
            head_dim = f.positive("head_dim", default=hidden // heads if hidden % heads == 0 else None)
        if head_dim % 2:
            raise ModelLoadError(source, f"field 'head_dim': {head_dim} is odd (RoPE needs pairs)")
        dtype = raw.get("torch_dtype", raw.get("dtype", "float32"))
        if dtype not in DTYPES:
            raise ModelLoadError(source, f"field 'torch_dtype': {dtype!r} is not one of {tuple(DTYPES)}")
        layers = f.positive("num_hidden_layers")
        rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else raw.get("rope_scaling")
        theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else 10000.0)
        return cls(
            model_type=model_type,
            vocab_size=f.positive("vocab_size"),
            hidden_size=hidden,
            intermediate_size=f.positive("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=f.number("rms_norm_eps", default=1e-6),
            rope_theta=_Fields({"rope_theta": theta}, Path(source)).number("rope_theta", default=10000.0),
            max_position_embeddings=f.positive("max_position_embeddings", default=2048),
            tie_word_embeddings=f.get("tie_word_embeddings", bool, default=False),
            attention_bias=f.get("attention_bias", bool, default=model_type == "qwen2"),
            torch_dtype=dtype,
            bos_token_id=f.token_ids("bos_token_id", allow_list=False),
            eos_token_id=f.token_ids("eos_token_id", allow_list=True),
            rope_scaling=_rope_scaling(rope, Path(source)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            mla=mla,
            moe=_moe(f, model_type, layers),
            rope_interleave=model_type == "deepseek_v2" or (model_type == "deepseek_v3" and f.get("rope_interleave", bool, default=True)),
        )

    @property
    def dtype(self) -> torch.dtype:
        """The checkpoint's torch dtype (``torch_dtype``)."""
        return dtype_from_name(self.torch_dtype)

    @property
    def attention(self) -> str:
        """``"mla"`` for multi-head latent attention, else ``"gqa"`` (MHA and MQA included)."""
        return "mla" if self.mla is not None else "gqa"

    @property
    def kv_spec(self) -> KvSpec:
        """What one token keeps per layer (see ``KvSpec``)."""
        if self.mla is not None:
            return KvSpec("mla", (1, self.mla.kv_lora_rank), (1, self.mla.qk_rope_head_dim))
        shape = (self.num_key_value_heads, self.head_dim)
        return KvSpec("gqa", shape, shape)

    def kv_bytes_per_token_layer(self, dtype: torch.dtype) -> int:
        """Bytes of one token's KV in one layer: GQA ``2 * kv_heads * head_dim * itemsize``,
        MLA ``(kv_lora_rank + qk_rope_head_dim) * itemsize``."""
        return self.kv_spec.bytes_per_token_layer(dtype)

    def serving_dtype(self, device: str, dtype: str = "") -> str:
        """The dtype an engine on ``device`` computes and keeps KV in: ``dtype`` when given,
        else float32 on CPU (half precision is slow and inexact there) and the checkpoint's
        ``torch_dtype`` elsewhere (what ``Decoder.load`` does)."""
        if dtype:
            return dtype
        return "float32" if device.split(":")[0] == "cpu" else self.torch_dtype

    def describe(self, dtype: str) -> dict[str, Any]:
        """What a client may want to know of the architecture: ``/v1/models``' ``dualpath`` object."""
        spec = self.kv_spec
        return {
            "model_type": self.model_type,
            "attention": self.attention,
            "moe": self.moe is not None,
            "layers": self.num_hidden_layers,
            "kv_layout": spec.kind,
            "kv_values_per_token_layer": spec.width,
            "dtype": dtype,
            "kv_bytes_per_token": spec.width * DTYPE_BYTES[dtype] * self.num_hidden_layers,
        }

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers


def _mla(f: _Fields) -> MlaConfig:
    q_lora = f.raw.get("q_lora_rank")
    if q_lora is not None:
        q_lora = f.positive("q_lora_rank")
    mla = MlaConfig(
        q_lora_rank=q_lora,
        kv_lora_rank=f.positive("kv_lora_rank"),
        qk_nope_head_dim=f.positive("qk_nope_head_dim"),
        qk_rope_head_dim=f.positive("qk_rope_head_dim"),
        v_head_dim=f.positive("v_head_dim"),
    )
    if mla.qk_rope_head_dim % 2:
        raise ModelLoadError(f.source, f"field 'qk_rope_head_dim': {mla.qk_rope_head_dim} is odd (RoPE needs pairs)")
    return mla


def _moe(f: _Fields, model_type: str, layers: int) -> MoeConfig | None:
    if model_type == "qwen3_moe":
        # transformers 5 writes num_local_experts; the Hub's configs say num_experts
        experts = f.get("num_experts", int, default=f.get("num_local_experts", int, default=0))
        if experts <= 0:
            return None
        step = f.positive("decoder_sparse_step", default=1)
        dense = f.raw.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise ModelLoadError(f.source, f"field 'mlp_only_layers': expected a list of layer indices, got {dense!r}")
        moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        return _check_moe(
            f,
            MoeConfig(
                num_experts=experts,
                experts_per_token=f.positive("num_experts_per_tok"),
                intermediate_size=f.positive("moe_intermediate_size"),
                shared_intermediate_size=0,
                norm_topk_prob=f.get("norm_topk_prob", bool, default=False),
                scoring="softmax",
                topk_method="greedy",
                n_group=1,
                topk_group=1,
                routed_scaling_factor=1.0,
                correction_bias=False,
                router_fp32=False,
                layers=moe_layers,
            ),
        )
    if model_type not in MLA_MODEL_TYPES:
        return None
    experts = f.raw.get("n_routed_experts")
    if experts is None:
        return None
    v3 = model_type == "deepseek_v3"
    first_dense = f.get("first_k_dense_replace", int, default=0)
    freq = f.positive("moe_layer_freq", default=1)
    scoring = f.get("scoring_func", str, default="sigmoid" if v3 else "softmax")
    method = f.get("topk_method", str, default="noaux_tc" if v3 else "greedy")
    if scoring not in ("softmax", "sigmoid"):
        raise ModelLoadError(f.source, f"field 'scoring_func': {scoring!r} is not one of ('softmax', 'sigmoid')")
    if method not in _TOPK_METHODS:
        raise ModelLoadError(f.source, f"field 'topk_method': {method!r} is not one of {_TOPK_METHODS}")
    n_group = f.raw.get("n_group") or 1
    topk_group = f.raw.get("topk_group") or n_group
    return _check_moe(
        f,
        MoeConfig(
            num_experts=f.positive("n_routed_experts"),
            experts_per_token=f.positive("num_experts_per_tok"),
            intermediate_size=f.positive("moe_intermediate_size"),
            shared_intermediate_size=f.positive("moe_intermediate_size") * f.get("n_shared_experts", int, default=0),
            norm_topk_prob=f.get("norm_topk_prob", bool, default=v3),
            scoring=scoring,
            topk_method=method,
            n_group=int(n_group),
            topk_group=int(topk_group),
            routed_scaling_factor=f.number("routed_scaling_factor", default=1.0),
            correction_bias=method == "noaux_tc",
            router_fp32=True,
            layers=tuple(i for i in range(layers) if i >= first_dense and i % freq == 0),
        ),
    )


def _check_moe(f: _Fields, moe: MoeConfig) -> MoeConfig:
    if moe.experts_per_token > moe.num_experts:
        raise ModelLoadError(f.source, f"field 'num_experts_per_tok': {moe.experts_per_token} exceeds {moe.num_experts} experts")
    if moe.num_experts % moe.n_group or not 1 <= moe.topk_group <= moe.n_group:
        raise ModelLoadError(
            f.source, f"fields 'n_group'/'topk_group': {moe.n_group}/{moe.topk_group} do not fit {moe.num_experts} experts"
        )
    if moe.topk_method != "greedy" and moe.experts_per_token > moe.topk_group * (moe.num_experts // moe.n_group):
        raise ModelLoadError(f.source, "field 'num_experts_per_tok': more experts than the chosen groups hold")
    return moe


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

    def opt(name: str) -> float | None:
        value = raw.get(name)
        return None if value is None else float(value)

    try:
        return RopeScaling(
            kind=kind,
            factor=float(raw.get("factor", 1.0)),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
            beta_fast=float(raw.get("beta_fast") or 32.0),
            beta_slow=float(raw.get("beta_slow") or 1.0),
            mscale=opt("mscale"),
            mscale_all_dim=opt("mscale_all_dim"),
            attention_factor=opt("attention_factor"),
            truncate=bool(raw.get("truncate", True)),
        )
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(source, f"field 'rope_scaling': {exc}") from None
