"""``ModelTarget``: the numbers the roofline needs, derived from a ``ModelConfig``.

The same ``ModelConfig`` the torch engine loads (``dualpath.model.config``) is flattened
here into weight counts, FLOPs per token and bytes per token; ``dualpath.cost.model`` turns
them into times. Per layer, with ``h`` hidden, ``H`` query heads, ``d`` head width:

- attention projections, GQA: ``2 h (H d) + 2 h (H_kv d)`` (q, o and k, v);
  MLA: ``h r_q + r_q H (d_nope + d_rope)`` (q_a, q_b; ``h H (d_nope + d_rope)`` without
  ``q_lora_rank``) ``+ h (r_kv + d_rope)`` (kv_a) ``+ r_kv H (d_nope + d_v)`` (kv_b)
  ``+ H d_v h`` (o), plus the lightning indexer's ``r_q H_i d_i + h d_i + h H_i`` where
  the model has one (DeepSeek-V3.2).
- MLP (SwiGLU): a dense layer ``3 h I``; a MoE layer ``k`` routed experts of ``3 h I_e``
  each, the shared experts ``3 h I_s`` (all of them fused, as the config describes them)
  and the router ``h E``. All ``E`` experts count for memory, ``k`` for FLOPs.
- attention scores, per (query, key) pair: GQA ``2 H (d + d)`` (QK^T and PV); MLA in
  the weight-absorbed (MQA) form ``2 H ((r_kv + d_rope) + r_kv)``; the indexer
  ``2 H_i d_i`` over every key.
- LM head: ``2 h V`` per token that needs logits.

One multiply-add is 2 FLOPs. Norm weights, biases and rotary tables are not counted (well
under 0.1% of any target's weights or FLOPs).

KV bytes per token per layer follow the engine's ``KvSpec`` (``ModelConfig.kv_spec``):
its ``width`` values times the KV cache dtype's size. ``kv_cache_dtype="auto"`` is the
checkpoint's ``torch_dtype``, what the torch engine stores, so a served checkpoint and its
modeled twin agree. ``"fp8"`` is the serving format of the DeepSeek targets: MLA in
FlashMLA's FP8 layout (the latent in FP8 with one FP32 scale per 128 values, the rotary key
in BF16: ``512 + 16 + 128`` = 656 B for V3), GQA one byte per value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from dualpath.model.config import ModelConfig

__all__ = ["KV_CACHE_DTYPES", "ModelTarget", "SparseAttention", "kv_cache_bytes_per_token_layer"]

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8")
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
_FP8_SCALE_GROUP = 128  # FlashMLA FP8: one FP32 scale per 128 latent values
_INDEX_SCALE_BYTES = 4  # the indexer's FP8 key keeps one FP32 scale


@dataclass(frozen=True, slots=True, kw_only=True)
class SparseAttention:
    """DeepSeek sparse attention (V3.2's ``index_*`` fields): a lightning indexer of
    ``heads`` x ``head_dim`` scores every key and each query attends to the ``topk`` best."""

    topk: int
    heads: int
    head_dim: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelTarget:
    """Architecture of one target model, as much as the roofline needs.

    Built by ``from_config``; fields that do not apply are zero (``sparse_topk=0``: dense
    attention; ``routed_experts=0``: a dense MLP in every layer).
    """

    name: str
    layers: int
    hidden: int
    vocab: int
    attention: Literal["gqa", "mla"]
    heads: int  # query heads
    kv_heads: int = 0  # GQA only
    head_dim: int = 0  # GQA only
    q_lora_rank: int = 0  # MLA: 0 means a direct hidden -> heads query projection
    kv_lora_rank: int = 0  # MLA latent width (the cached "c_kv")
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0  # MLA: the decoupled RoPE key, cached next to the latent
    v_head_dim: int = 0
    sparse_topk: int = 0  # DeepSeek sparse attention: keys each query attends; 0 = dense
    index_heads: int = 0  # lightning indexer (FP8)
    index_head_dim: int = 0
    index_bytes_per_token_layer: int = 0
    intermediate: int = 0  # dense MLP width (every layer of a dense model, the non-MoE layers of a MoE one)
    moe_layer_ids: frozenset[int] = frozenset()  # layers whose MLP is a mixture of experts
    routed_experts: int = 0
    experts_per_token: int = 0
    shared_intermediate: int = 0  # all shared experts of a MoE layer as one SwiGLU (0: none)
    expert_intermediate: int = 0
    tied_embeddings: bool = False
    weight_bytes: int = 2  # bytes per weight: 1 = FP8 (GEMMs then run at FP8 peak)
    kv_bytes_per_token_layer: int
    default_ep: int = 1  # expert-parallel group size (GPUs sharing the routed experts)
    config: ModelConfig | None = field(default=None, compare=False, repr=False)  # what it was derived from

    @classmethod
    def from_config(
        cls,
        cfg: ModelConfig,
        *,
        name: str,
        sparse: SparseAttention | None = None,
        kv_cache_dtype: str = "auto",
        weight_bytes: int | None = None,
        default_ep: int = 1,
    ) -> ModelTarget:
        """Flatten ``cfg`` (any supported architecture) into a target.

        ``weight_bytes`` defaults to the size of ``cfg.torch_dtype``; ``kv_cache_dtype`` is one
        of ``KV_CACHE_DTYPES`` (module docstring).

        Raises:
            ValueError: an unknown ``kv_cache_dtype``, or ``sparse`` on a non-MLA model.
        """
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        mla, moe = cfg.mla, cfg.moe
        if sparse is not None and mla is None:
            raise ValueError("sparse attention is modelled for MLA models only")
        attn: dict[str, Any] = (
            {
                "attention": "mla",
                "q_lora_rank": mla.q_lora_rank or 0,
                "kv_lora_rank": mla.kv_lora_rank,
                "qk_nope_dim": mla.qk_nope_head_dim,
                "qk_rope_dim": mla.qk_rope_head_dim,
                "v_head_dim": mla.v_head_dim,
            }
            if mla is not None
            else {"attention": "gqa", "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim}
        )
        experts: dict[str, Any] = (
            {
                "moe_layer_ids": frozenset(moe.layers),
                "routed_experts": moe.num_experts,
                "experts_per_token": moe.experts_per_token,
                "shared_intermediate": moe.shared_intermediate_size,
                "expert_intermediate": moe.intermediate_size,
            }
            if moe is not None and moe.layers
            else {}
        )
        index: dict[str, Any] = (
            {
                "sparse_topk": sparse.topk,
                "index_heads": sparse.heads,
                "index_head_dim": sparse.head_dim,
                "index_bytes_per_token_layer": sparse.head_dim + _INDEX_SCALE_BYTES,
            }
            if sparse is not None
            else {}
        )
        return cls(
            name=name,
            layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            vocab=cfg.vocab_size,
            heads=cfg.num_attention_heads,
            intermediate=cfg.intermediate_size,
            tied_embeddings=cfg.tie_word_embeddings,
            weight_bytes=_ITEMSIZE[cfg.torch_dtype] if weight_bytes is None else weight_bytes,
            kv_bytes_per_token_layer=kv_cache_bytes_per_token_layer(cfg, kv_cache_dtype),
            default_ep=default_ep,
            config=cfg,
            **attn,
            **experts,
            **index,
        )

    # -- KV and HBM per token -----------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes of one token over all layers (what storage holds and loads)."""
        return self.kv_bytes_per_token_layer * self.layers

    def hbm_bytes_per_token(self) -> int:
        """HBM bytes one cached token occupies on an engine: KV plus indexer keys."""
        return (self.kv_bytes_per_token_layer + self.index_bytes_per_token_layer) * self.layers

    # -- layers -------------------------------------------------------------------------
    @property
    def moe_layers(self) -> int:
        """How many layers have a mixture-of-experts MLP."""
        return len(self.moe_layer_ids)

    @property
    def dense_layers(self) -> int:
        """How many layers have a dense MLP."""
        return self.layers - self.moe_layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layer_ids

    # -- weights ------------------------------------------------------------------------
    def attn_proj_params(self) -> int:
        """Weights of one layer's attention projections (and indexer projections)."""
        h = self.hidden
        if self.attention == "gqa":
            return 2 * h * self.heads * self.head_dim + 2 * h * self.kv_heads * self.head_dim
        qk = self.qk_nope_dim + self.qk_rope_dim
        q = h * self.q_lora_rank + self.q_lora_rank * self.heads * qk if self.q_lora_rank else h * self.heads * qk
        kv_a = h * (self.kv_lora_rank + self.qk_rope_dim)
        kv_b = self.kv_lora_rank * self.heads * (self.qk_nope_dim + self.v_head_dim)
        out = self.heads * self.v_head_dim * h
        q_src = self.q_lora_rank or h
        index = (
            q_src * self.index_heads * self.index_head_dim  # indexer queries
            + h * self.index_head_dim
            + h * self.index_heads
        )  # its key and head weights
        return q + kv_a + kv_b + out + (index if self.index_heads else 0)

    def dense_mlp_params(self) -> int:
        """Weights of one dense SwiGLU MLP (gate, up, down)."""
        return 3 * self.hidden * self.intermediate

    def expert_params(self) -> int:
        """Weights of one routed SwiGLU expert."""
        return 3 * self.hidden * self.expert_intermediate

    def shared_expert_params(self) -> int:
        """Weights of a MoE layer's shared experts together (0 without any)."""
        return 3 * self.hidden * self.shared_intermediate

    def moe_replicated_params(self) -> int:
        """Weights of a MoE layer's MLP that every token uses: shared experts and router."""
        return self.shared_expert_params() + self.hidden * self.routed_experts

    def embedding_params(self) -> int:
        """Input embedding and LM head (one matrix when tied)."""
        return (1 if self.tied_embeddings else 2) * self.vocab * self.hidden

    def total_params(self) -> int:
        """All weights, embeddings and LM head included: what the checkpoint stores."""
        return self._params(self.routed_experts)

    def active_params(self) -> int:
        """Weights one token touches (top-k routed plus shared experts; both embeddings)."""
        return self._params(self.experts_per_token)

    def _params(self, routed: int) -> int:
        moe = self.moe_layers * (routed * self.expert_params() + self.moe_replicated_params())
        return self.layers * self.attn_proj_params() + self.dense_layers * self.dense_mlp_params() + moe + self.embedding_params()

    def weight_bytes_total(self) -> int:
        """HBM bytes of all weights (every expert), on one GPU without expert parallelism."""
        return self.total_params() * self.weight_bytes

    def active_weight_bytes(self) -> int:
        """HBM bytes of the weights one token's forward reads (``active_params``)."""
        return self.active_params() * self.weight_bytes

    # -- FLOPs --------------------------------------------------------------------------
    def layer_gemm_flops_per_token(self, layer: int) -> int:
        """FLOPs of one token's projections and MLP in ``layer`` (no attention scores)."""
        mlp = (
            self.experts_per_token * self.expert_params() + self.moe_replicated_params()
            if self.is_moe_layer(layer)
            else self.dense_mlp_params()
        )
        return 2 * (self.attn_proj_params() + mlp)

    def attention_pair_flops(self) -> int:
        """FLOPs per (query token, key) pair of attention, summed over heads."""
        if self.attention == "gqa":
            return 2 * self.heads * (2 * self.head_dim)
        return 2 * self.heads * ((self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank)

    def index_pair_flops(self) -> int:
        """FLOPs per (query, key) pair of the lightning indexer (0 without one)."""
        return 2 * self.index_heads * self.index_head_dim

    def attention_flops_per_token(self, keys: int) -> int:
        """FLOPs of one query's attention (and indexer) over ``keys`` keys in one layer."""
        attended = min(keys, self.sparse_topk) if self.sparse_topk else keys
        return self.attention_pair_flops() * attended + self.index_pair_flops() * keys

    def lm_head_flops_per_token(self) -> int:
        return 2 * self.vocab * self.hidden


def kv_cache_bytes_per_token_layer(cfg: ModelConfig, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one token's KV in one layer of ``cfg`` stored as ``kv_cache_dtype``.

    ``"auto"`` and the float names give ``kv_spec.width * itemsize``, as the engine computes
    ``ModelConfig.kv_bytes_per_token_layer``; ``"fp8"`` is FlashMLA's layout for MLA and
    one byte per value for GQA (module docstring).
    """
    spec = cfg.kv_spec
    dtype = cfg.torch_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    if dtype == "fp8" and cfg.mla is not None:
        latent = cfg.mla.kv_lora_rank
        return latent + 4 * math.ceil(latent / _FP8_SCALE_GROUP) + _ITEMSIZE["bfloat16"] * cfg.mla.qk_rope_head_dim
    return spec.width * _ITEMSIZE[dtype]
