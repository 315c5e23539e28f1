"""Target models of the cost model: the architecture numbers the roofline needs.

Each target is a frozen ``ModelTarget``. The parameter counts derived here feed the FLOP
formulas in ``dualpath.cost.model`` (documented there). Sources: the HF ``config.json`` of
Qwen2.5-32B, DeepSeek-V3 and DeepSeek-V3.2-Exp, and PAPER.md for the DeepSeek 27B.

KV bytes per token per layer:

- GQA (Qwen2.5-32B, bf16): K and V, ``2 * kv_heads * head_dim * 2`` = 4,096 B.
- MLA in FlashMLA's FP8 format (DeepSeek-V3.2 and the 27B): 512 FP8 latent values,
  4 FP32 scales and 64 bf16 RoPE values, ``512 + 16 + 128`` = 656 B.
- DeepSeek-V3 (dense MLA): also 656 B. Stored in bf16 (``576 * 2`` = 1,152 B) the paper's
  cache-compute ratio would be 7.6-9.0 GB/PFLOP instead of its 4.8-5.8; 656 B gives
  4.4-5.2, so the paper evidently counts V3 in the same FP8 format.
- The V3.2 lightning indexer also keeps an FP8 key per token per layer (128 values plus
  one FP32 scale, 132 B). The paper's ratio (13-36) matches only without it, so it is not
  part of ``kv_bytes_per_token_layer``; it is counted in HBM capacity and decode reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dualpath.cost.errors import UnknownTargetError

__all__ = ["TARGETS", "ModelTarget", "get_target"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelTarget:
    """Architecture of one target model, as much as the roofline needs.

    Fields that do not apply to a target are zero (``sparse_topk=0`` means dense
    attention; ``routed_experts=0`` means a dense MLP in every layer).
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
    intermediate: int = 0  # dense MLP width (all layers of a dense model, first layers of MoE)
    dense_layers: int = 0
    routed_experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    expert_intermediate: int = 0
    weight_bytes: int = 2  # bytes per weight: 2 = bf16, 1 = FP8 (GEMMs then run at FP8 peak)
    kv_bytes_per_token_layer: int
    default_ep: int = 1  # expert-parallel group size (GPUs sharing the routed experts)

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes of one token over all layers (what storage holds and loads)."""
        return self.kv_bytes_per_token_layer * self.layers

    def hbm_bytes_per_token(self) -> int:
        """HBM bytes one cached token occupies on an engine: KV plus indexer keys."""
        return (self.kv_bytes_per_token_layer + self.index_bytes_per_token_layer) * self.layers

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts."""
        return self.layers - self.dense_layers if self.routed_experts else 0

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
        """Weights of one SwiGLU expert (routed and shared experts have the same shape)."""
        return 3 * self.hidden * self.expert_intermediate

    def total_params(self) -> int:
        """All weights, embeddings and LM head included (untied)."""
        return self._params(self.routed_experts)

    def active_params(self) -> int:
        """Weights one token touches (top-k routed plus shared experts; both embeddings)."""
        return self._params(self.experts_per_token)

    def _params(self, routed: int) -> int:
        moe = self.moe_layers * (
            (routed + self.shared_experts) * self.expert_params() + self.hidden * self.routed_experts
        )  # experts and router
        mlp_layers = self.dense_layers if self.routed_experts else self.layers
        return self.layers * self.attn_proj_params() + mlp_layers * self.dense_mlp_params() + moe + 2 * self.vocab * self.hidden


_QWEN_32B = ModelTarget(
    name="Qwen2.5-32B",
    layers=64,
    hidden=5120,
    vocab=152064,
    attention="gqa",
    heads=40,
    kv_heads=8,
    head_dim=128,
    intermediate=27648,
    weight_bytes=2,
    kv_bytes_per_token_layer=2 * 8 * 128 * 2,
)

# DeepSeek-V3.2-Exp: MLA with the lightning indexer selecting the top-2048 keys per query.
# default_ep=16: the paper's 660B prefill side is 2 nodes x 8 GPUs; EP 8 would not fit.
_DS_V32 = ModelTarget(
    name="DeepSeek-V3.2",
    layers=61,
    hidden=7168,
    vocab=129280,
    attention="mla",
    heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_dim=128,
    qk_rope_dim=64,
    v_head_dim=128,
    sparse_topk=2048,
    index_heads=64,
    index_head_dim=128,
    index_bytes_per_token_layer=128 + 4,
    intermediate=18432,
    dense_layers=3,
    routed_experts=256,
    experts_per_token=8,
    shared_experts=1,
    expert_intermediate=2048,
    weight_bytes=1,
    kv_bytes_per_token_layer=512 + 4 * 4 + 64 * 2,
    default_ep=16,
)

_DS_V3 = ModelTarget(
    name="DeepSeek-V3",
    layers=61,
    hidden=7168,
    vocab=129280,
    attention="mla",
    heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_dim=128,
    qk_rope_dim=64,
    v_head_dim=128,
    intermediate=18432,
    dense_layers=3,
    routed_experts=256,
    experts_per_token=8,
    shared_experts=1,
    expert_intermediate=2048,
    weight_bytes=1,
    kv_bytes_per_token_layer=512 + 4 * 4 + 64 * 2,
    default_ep=16,
)

# DeepSeek 27B: PAPER.md gives hidden 2560, 30 layers, 72 routed + 2 shared experts,
# top-6, sparse top-k 1024, V3.2's MLA/FP8 format. Assumed (not published): 32 heads,
# q_lora 768, one dense first layer, expert width 1536 (this makes the total ~27B),
# dense width = 8 experts, V3.2's indexer shape; default_ep=8 (the paper runs it 1P1D).
_DS_27B = ModelTarget(
    name="DeepSeek-27B",
    layers=30,
    hidden=2560,
    vocab=129280,
    attention="mla",
    heads=32,
    q_lora_rank=768,
    kv_lora_rank=512,
    qk_nope_dim=128,
    qk_rope_dim=64,
    v_head_dim=128,
    sparse_topk=1024,
    index_heads=64,
    index_head_dim=128,
    index_bytes_per_token_layer=128 + 4,
    intermediate=8 * 1536,
    dense_layers=1,
    routed_experts=72,
    experts_per_token=6,
    shared_experts=2,
    expert_intermediate=1536,
    weight_bytes=1,
    kv_bytes_per_token_layer=512 + 4 * 4 + 64 * 2,
    default_ep=8,
)

TARGETS: dict[str, ModelTarget] = {
    "qwen32b": _QWEN_32B,
    "ds660b": _DS_V32,
    "ds27b": _DS_27B,
    "dsv3": _DS_V3,
}


def get_target(name: str) -> ModelTarget:
    """Return the target called ``name`` (a key of ``TARGETS``).

    Raises:
        UnknownTargetError: ``name`` is not a key of ``TARGETS``; the message lists them.
    """
    try:
        return TARGETS[name]
    except KeyError:
        raise UnknownTargetError(name, list(TARGETS)) from None
