"""The per-token KV layout that storage, transfer and the engines share.

Per token per layer the stored values are the model's two KV parts back to back, in the
decoder dtype (``KvSpec`` in ``dualpath.model.config`` says their shapes): for GQA models
K then V, each ``[kv_heads, head_dim]``, K with RoPE already applied, exactly as
``Decoder.forward_layer`` returns it; for MLA models the normalised latent
``[kv_lora_rank]`` then the rotary key ``[qk_rope_head_dim]``. A Full Block of ``T`` tokens
is ``[layers, T, width]`` and one layer of it (a Layer Block) is ``[T, width]``.

``pack_kv`` / ``unpack_kv`` are the GQA case in its 4-D form ``[T, 2, kv_heads, head_dim]``
(the same bytes as ``[T, width]``).
"""

from __future__ import annotations

import torch

from dualpath.model.errors import ModelInputError

__all__ = ["pack_kv", "unpack_kv"]


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Interleave per-token K and V: ``[T, kvh, hd]`` twice -> ``[T, 2, kvh, hd]`` contiguous.

    Raises:
        ModelInputError: ``k`` and ``v`` differ in shape, dtype or device, or are not 3-D.
    """
    if k.dim() != 3 or k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
        raise ModelInputError(
            f"pack_kv needs k and v of equal shape [T, kv_heads, head_dim], dtype and device; "
            f"got {tuple(k.shape)} {k.dtype} {k.device} and {tuple(v.shape)} {v.dtype} {v.device}"
        )
    return torch.stack((k, v), dim=1)  # [T, 2, kvh, hd]


def unpack_kv(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``[T, 2, kvh, hd]`` into views ``k [T, kvh, hd]`` and ``v [T, kvh, hd]``.

    The views are not contiguous (they stride over the other half); ``forward_layer``
    accepts them as ``past`` without a copy on the caller's side.

    Raises:
        ModelInputError: ``kv`` is not 4-D with size 2 in dimension 1.
    """
    if kv.dim() != 4 or kv.shape[1] != 2:
        raise ModelInputError(f"unpack_kv needs [T, 2, kv_heads, head_dim], got {tuple(kv.shape)}")
    return kv[:, 0], kv[:, 1]
