"""Rotary position embedding, computed as transformers computes it.

Two pair layouts: "rotate half" (Qwen, Llama: pair ``i`` of a head is dimensions
``(i, i + d/2)``) and "interleaved" (DeepSeek: pair ``i`` is ``(2i, 2i+1)``; the rotated
vector comes out with the pairs' first halves then their second halves, as transformers'
``apply_rotary_pos_emb_interleave`` returns it, so q and k always agree). At position ``p``
pair ``i`` is rotated by ``p * inv_freq[i]``. The angles depend only on the absolute
position, so K computed in a long prefill and K computed one token at a time get identical
rotations; this is what makes cached K (stored with RoPE applied) reusable.

Scalings: ``linear``, ``llama3`` and ``yarn`` (whose ``attention_factor`` scales cos and
sin; MLA models also fold ``mscale_all_dim`` into the softmax scale, ``mla_softmax_scale``).
"""

from __future__ import annotations

import math

import torch

from dualpath.model.config import ModelConfig, RopeScaling

__all__ = ["RotaryEmbedding", "attention_factor", "inverse_frequencies", "mla_softmax_scale", "yarn_mscale"]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling: RopeScaling | None) -> float:
    """The factor on cos and sin (YaRN only; 1 otherwise)."""
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def mla_softmax_scale(qk_head_dim: int, scaling: RopeScaling | None) -> float:
    """MLA's softmax scale: ``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim)**2``
    under a scaled RoPE that sets ``mscale_all_dim`` (as DeepSeek's reference and transformers do)."""
    scale = qk_head_dim**-0.5
    if scaling is not None and scaling.mscale_all_dim:
        m = yarn_mscale(scaling.factor, scaling.mscale_all_dim)
        scale *= m * m
    return scale


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """``inv_freq[i] = theta ** (-2i / head_dim)``, adjusted by ``rope_scaling``.  # [head_dim/2]"""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between
    # them interpolated (transformers `_compute_llama3_parameters`).
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: fast pairs extrapolated, slow pairs interpolated by ``factor``, a linear ramp
    between (transformers ``_compute_yarn_parameters``)."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp  # share of extrapolation per pair
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryEmbedding:
    """Applies RoPE to ``[N, heads, dim]`` tensors at given absolute positions."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        inv = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        self.inv_freq = inv.to(device)  # [dim/2] float32
        self.scale = attention_factor(config.rope_scaling)
        self.interleave = config.rope_interleave

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotation tables for ``positions [N]`` -> ``cos, sin [N, 1, dim]`` in ``dtype``.

        Angles are formed in float32 elementwise (never a matmul, whose blocking could
        depend on N), then cast, as transformers does.
        """
        freqs = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq[None, :]  # [N, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [N, 1, d]
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x [N, heads, dim]`` in this model's pair layout: a new tensor, or ``out``
        (``x``'s shape, any strides). ``x`` may be a permuted view (heads first, say) when
        ``cos`` and ``sin`` are permuted alike."""
        if not self.interleave:
            return self.apply(x, cos, sin, out)
        half = x.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1, out=out)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x [N, heads, dim]`` ("rotate half" layout) by the tables from ``cos_sin``:
        ``x cos + (-x2, x1) sin``, each half updated in place (no rotated copy of ``x``)."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.mul(x, cos, out=out)
        out[..., :half].sub_(x2 * sin[..., :half])
        out[..., half:].add_(x1 * sin[..., half:])
        return out
