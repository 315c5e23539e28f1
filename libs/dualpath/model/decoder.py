"""``Decoder``: a Qwen2 / Llama decoder with layer-wise forward over externally held KV.

The engines own the KV cache (it arrives from storage, another engine, or their own
earlier steps); the decoder owns only weights. ``forward_layer`` runs one layer for the new
tokens of several sequences at once: the linear layers see all ``N`` tokens as one matrix,
attention runs per sequence over ``past_i ++ new_i`` with a causal mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dualpath.model.config import ModelConfig
from dualpath.model.errors import ModelInputError
from dualpath.model.rope import RotaryEmbedding
from dualpath.model.weights import expected_shapes, locate_tensors, read_tensors

__all__ = ["Decoder", "PastKV"]

PastKV = tuple[torch.Tensor, torch.Tensor] | None  # (k, v) each [P, kv_heads, head_dim]


@dataclass(frozen=True, slots=True)
class _Layer:
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, H]
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim]
    o: torch.Tensor  # [H, heads * head_dim]
    gate_up: torch.Tensor  # [2 * I, H]
    down: torch.Tensor  # [H, I]
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]


class Decoder:
    """Qwen2/Llama decoder: RMSNorm, RoPE (rope_theta), GQA attention, SwiGLU MLP.

    Tied or untied embeddings. Loads any HF-layout checkpoint directory (``config.json``
    plus one or more ``*.safetensors``, including ``model.safetensors.index.json``
    sharding). Inference only: every method runs under ``torch.no_grad``.
    """

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        """Wrap already loaded tensors (HF names, one dtype, on ``device``); see ``load``."""
        self.config = config
        self.device = device
        self.dtype = tensors["model.embed_tokens.weight"].dtype
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self._embed = tensors["model.embed_tokens.weight"]  # [V, H]
        self._lm_head = self._embed if config.tie_word_embeddings else tensors["lm_head.weight"]  # [V, H]
        self._norm = tensors["model.norm.weight"]  # [H]
        self._layers = [self._fuse(tensors, f"model.layers.{i}.") for i in range(self.num_layers)]
        self._rope = RotaryEmbedding(config, device)

    @classmethod
    def load(cls, path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Decoder:
        """Load the checkpoint directory ``path`` onto ``device``.

        ``dtype`` defaults to float32 on CPU (where half precision is slow and inexact)
        and to the checkpoint's ``torch_dtype`` elsewhere.

        Raises:
            ModelLoadError: ``config.json`` or a weight file/tensor is missing or invalid.
        """
        path = Path(path)
        config = ModelConfig.from_dir(path)
        device = torch.device(device)
        if dtype is None:
            dtype = torch.float32 if device.type == "cpu" else config.dtype
        shapes = expected_shapes(config)
        tensors = dict(read_tensors(locate_tensors(path), shapes, device=device, dtype=dtype))
        return cls(config, tensors, device)

    def _fuse(self, t: dict[str, torch.Tensor], p: str) -> _Layer:
        # One [q; k; v] and one [gate; up] matmul per layer instead of five.
        names = ("q_proj", "k_proj", "v_proj")
        qkv = torch.cat([t[f"{p}self_attn.{n}.weight"] for n in names])
        bias = torch.cat([t[f"{p}self_attn.{n}.bias"] for n in names]) if self.config.attention_bias else None
        gate_up = torch.cat((t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]))
        return _Layer(
            qkv=qkv,
            qkv_bias=bias,
            o=t[p + "self_attn.o_proj.weight"],
            gate_up=gate_up,
            down=t[p + "mlp.down_proj.weight"],
            input_norm=t[p + "input_layernorm.weight"],
            post_norm=t[p + "post_attention_layernorm.weight"],
        )

    @torch.no_grad()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: ``[N]`` int -> ``[N, H]`` in the decoder dtype.

        Raises:
            ModelInputError: ``token_ids`` is not 1-D or holds an id outside the vocabulary.
        """
        ids = torch.as_tensor(token_ids, device=self.device)
        if ids.dim() != 1 or ids.dtype.is_floating_point:
            raise ModelInputError(f"token_ids must be a 1-D integer tensor, got {tuple(ids.shape)} {ids.dtype}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ModelInputError(f"token id outside [0, {self.config.vocab_size})")
        return F.embedding(ids.long(), self._embed)

    @torch.no_grad()
    def forward_layer(
        self,
        layer: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        segments: Sequence[tuple[int, int]],
        past: Sequence[PastKV],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run layer ``layer`` for the new tokens of several sequences.

        ``hidden [N, H]`` is the new tokens of all sequences concatenated, ``positions [N]``
        their absolute positions, ``segments[i] = (start, length)`` sequence ``i``'s rows,
        ``past[i]`` its cached ``(k, v)``, each ``[P_i, kv_heads, head_dim]`` for positions
        ``0..P_i-1`` (K with RoPE applied, as returned here; views such as ``unpack_kv``'s
        are fine) or ``None``. Sequence ``i``'s queries attend causally to
        ``past_i ++ new_i``.

        Returns ``(hidden_out [N, H], k_new [N, kvh, hd] with RoPE, v_new [N, kvh, hd])``.

        Raises:
            ModelInputError: shapes, dtypes or segments that do not fit (see ``_check``).
        """
        self._check(layer, hidden, positions, segments, past)
        w = self._layers[layer]
        n, hd = hidden.shape[0], self.head_dim
        x = self._rms_norm(hidden, w.input_norm)
        qkv = F.linear(x, w.qkv, w.qkv_bias)  # [N, (heads + 2 kvh) * hd]
        q, k, v = qkv.split([self.num_heads * hd, self.kv_heads * hd, self.kv_heads * hd], dim=-1)
        cos, sin = self._rope.cos_sin(positions, self.dtype)
        q = RotaryEmbedding.apply(q.reshape(n, self.num_heads, hd), cos, sin)  # [N, heads, hd]
        k = RotaryEmbedding.apply(k.reshape(n, self.kv_heads, hd), cos, sin)  # [N, kvh, hd]
        v = v.reshape(n, self.kv_heads, hd).contiguous()  # [N, kvh, hd]
        attn = torch.empty_like(q)  # [N, heads, hd]
        for (start, length), cached in zip(segments, past):
            if length:
                end = start + length
                attn[start:end] = self._attend(q[start:end], k[start:end], v[start:end], cached)
        out = hidden + F.linear(attn.reshape(n, -1), w.o)
        gate, up = F.linear(self._rms_norm(out, w.post_norm), w.gate_up).chunk(2, dim=-1)
        out = out + F.linear(F.silu(gate) * up, w.down)
        return out, k, v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: PastKV) -> torch.Tensor:
        """Causal GQA attention of ``q [n, heads, hd]`` over ``cached ++ (k, v)``."""
        n, past_len = q.shape[0], 0
        if cached is not None:
            past_len = cached[0].shape[0]
            k, v = torch.cat((cached[0], k)), torch.cat((cached[1], v))  # [P + n, kvh, hd]
        group = self.num_heads // self.kv_heads
        keys = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [heads, P + n, hd]
        values = v.transpose(0, 1).repeat_interleave(group, dim=0)
        mask = None
        if n > 1:  # query j (absolute past_len + j) sees keys 0..past_len + j
            cols = torch.arange(past_len + n, device=q.device)
            rows = torch.arange(n, device=q.device) + past_len
            mask = cols[None, :] <= rows[:, None]  # [n, P + n]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask)
        return out.transpose(0, 1)  # [n, heads, hd]

    @torch.no_grad()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's last RMSNorm: ``[M, H]`` -> ``[M, H]``, the input of the LM head."""
        return self._rms_norm(hidden, self._norm)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: ``[M, H]`` -> ``[M, V]`` float32."""
        return F.linear(self._rms_norm(hidden, self._norm), self._lm_head).float()

    @torch.no_grad()
    def forward_full(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Reference full recompute of one sequence from position 0.

        Returns ``(logits [T, V] float32, k [layers, T, kvh, hd], v [layers, T, kvh, hd])``.

        Raises:
            ModelInputError: empty ``token_ids`` or an id outside the vocabulary.
        """
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        if ids.numel() == 0:
            raise ModelInputError("forward_full needs at least one token")
        hidden = self.embed(ids)
        positions = torch.arange(ids.numel(), device=self.device)
        ks, vs = [], []
        for layer in range(self.num_layers):
            hidden, k, v = self.forward_layer(layer, hidden, positions, [(0, ids.numel())], [None])
            ks.append(k)
            vs.append(v)
        return self.logits(hidden), torch.stack(ks), torch.stack(vs)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # In float32 then back, as transformers' Qwen2RMSNorm / LlamaRMSNorm do.
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * x32.to(x.dtype)

    def _check(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor, segments: Sequence[tuple[int, int]], past: Sequence[PastKV]
    ) -> None:
        """Raise ``ModelInputError`` unless the arguments of ``forward_layer`` fit."""
        if not 0 <= layer < self.num_layers:
            raise ModelInputError(f"layer {layer} outside [0, {self.num_layers})")
        n = hidden.shape[0]
        if hidden.dim() != 2 or hidden.shape[1] != self.config.hidden_size or hidden.dtype != self.dtype:
            raise ModelInputError(f"hidden must be [N, {self.config.hidden_size}] {self.dtype}, got {tuple(hidden.shape)} {hidden.dtype}")
        if positions.shape != (n,):
            raise ModelInputError(f"positions must be [{n}], got {tuple(positions.shape)}")
        if len(segments) != len(past):
            raise ModelInputError(f"{len(segments)} segments but {len(past)} past entries")
        covered = 0
        for start, length in sorted(segments):
            if start != covered or length < 0:
                raise ModelInputError(f"segments must tile [0, {n}) without overlap; got {list(segments)}")
            covered += length
        if covered != n:
            raise ModelInputError(f"segments cover {covered} tokens, hidden has {n}")
        want = (self.kv_heads, self.head_dim)
        for cached in past:
            if cached is None:
                continue
            k, v = cached
            if (
                k.dim() != 3
                or k.shape[1:] != want
                or v.shape != k.shape
                or k.dtype != self.dtype
                or v.dtype != self.dtype
                or k.device != hidden.device
                or v.device != hidden.device
            ):
                raise ModelInputError(
                    f"past KV must be [P, {want[0]}, {want[1]}] {self.dtype}, got {tuple(k.shape)} {k.dtype} / {tuple(v.shape)} {v.dtype}"
                )
