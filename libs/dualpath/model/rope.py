"""Rotary position embedding in the Hugging Face "rotate half" layout.

Pair ``i`` of a head is dimensions ``(i, i + head_dim/2)``; at position ``p`` it is
rotated by ``p * inv_freq[i]``. The angles depend only on the absolute position, so K
computed in a long prefill and K computed one token at a time get identical rotations;
this is what makes cached K (stored with RoPE applied) reusable.
"""

from __future__ import annotations

import math

import torch

from dualpath.model.config import ModelConfig, RopeScaling

__all__ = ["RotaryEmbedding", "inverse_frequencies"]


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """``inv_freq[i] = theta ** (-2i / head_dim)``, adjusted by ``rope_scaling``.  # [head_dim/2]"""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
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


class RotaryEmbedding:
    """Applies RoPE to ``[N, heads, head_dim]`` tensors at given absolute positions."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        inv = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        self.inv_freq = inv.to(device)  # [head_dim/2] float32

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotation tables for ``positions [N]`` -> ``cos, sin [N, 1, head_dim]`` in ``dtype``.

        Angles are formed in float32 elementwise (never a matmul, whose blocking could
        depend on N), then cast, as transformers does.
        """
        freqs = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq[None, :]  # [N, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [N, 1, hd]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [N, heads, head_dim]`` by the tables from ``cos_sin``."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
