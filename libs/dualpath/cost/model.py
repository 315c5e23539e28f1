"""Roofline cost model: how long prefill and decode take for a target model on one GPU.

Deployment assumed (the paper's): each engine is one GPU running data-parallel attention,
so attention, dense-MLP, shared-expert and embedding weights are replicated on every GPU.
Routed experts are expert-parallel over ``ep`` GPUs: each holds ``ceil(E / ep)`` of them
and, with balanced routing, computes as many expert-token products as its own tokens
need (``tokens * top_k``). Communication is assumed overlapped and is not modelled, with
one exception: a decode step whose expert-parallel group spans nodes pays each MoE layer's
all-to-all latency (DeepEP's low-latency dispatch + combine, ``GpuProfile.decode_all_to_all_s``;
e.g. 58 x 428 us = 24.8 ms per step at EP 32), which two-micro-batch overlap cannot hide at
decode batch sizes and without which the paper's 660B TPOT (36-39 ms) is not reached.
Activation bytes are not modelled either (small next to weights and KV).

FLOPs (one multiply-add = 2 FLOPs), per layer, for ``n`` new tokens (``ModelTarget``,
``dualpath.cost.arch``, derives each term from the target's ``config.json``):

- projections: ``2 n P_attn``; GQA ``P_attn = 2 h (H d) + 2 h (H_kv d)`` (q, o and k, v);
  MLA ``P_attn = h r_q + r_q H (d_nope + d_rope) + h (r_kv + d_rope)
  + r_kv H (d_nope + d_v) + H d_v h`` (the ``r_kv H (d_nope + d_v)`` up-projection is
  absorbed into the query and the output, costing the same per token), plus the
  indexer's ``r_q H_i d_i + h d_i + h H_i`` where there is one.
- dense MLP (SwiGLU): ``2 n * 3 h I``; MoE: ``2 n (k 3 h I_e + 3 h I_s + h E)`` (top-``k``
  routed experts, the shared experts' fused width ``I_s``, the router).
- attention, per query-key pair: GQA ``2 H (d + d)`` (QK^T and PV);
  MLA in the weight-absorbed (MQA) form ``2 H ((r_kv + d_rope) + r_kv)`` = 2 H 1088.
  A new token at position ``c + i`` (``i`` = 1..n after ``c`` cached) attends to
  ``c + i`` keys, or ``min(c + i, top_k)`` with sparse attention.
- lightning indexer (FP8), per query-key pair: ``2 H_i d_i`` over all ``c + i`` keys.
- LM head: ``2 h V`` for the last token of a prefill, for every token of a decode step.

Roofline: each op group (replicated GEMMs, routed experts, attention, indexer, LM head)
takes ``max(FLOPs / (peak * mfu), bytes / (hbm * hbm_efficiency))``; groups run one
after another, plus a fixed per-layer overhead. GEMMs run at the FP8 peak for FP8 weights,
attention at the BF16 peak, the indexer at the FP8 peak. Bytes: weights are read once per
layer (routed experts: only those the batch can touch, ``min(local, n k)``); dense
attention reads each request's KV once, sparse attention reads ``top_k`` entries per
query, the indexer reads every cached key once per request.

Cache-compute ratio (PAPER.md's GB/PFLOP table): ``kv_bytes(c) / prefill_flops(c, n)``
with ``c`` cached tokens and ``n`` = 429 appended. KV grows linearly with ``c`` while
FLOPs grow as ``fixed + slope * c``, so the ratio *rises* with context for dense and
sparse attention alike: 16K is the low end of each table range and 64K the high end.
With these formulas (context = cached tokens) the model gives Qwen2.5-32B 118.9 / 269.5
(paper 117-267), DeepSeek-V3.2 12.3 / 35.2 (13-36; 21.7 at 32K, paper ~22) and
DeepSeek-V3 4.3 / 5.1 (4.8-5.8). MLA is counted in its absorbed form because that is what
reproduces the V3 row (the non-absorbed form, which up-projects the cached latents,
gives ~6.6 / 8.6); the V3 row's remaining ~10% shortfall is within the stated tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

from dualpath.cost.arch import ModelTarget
from dualpath.cost.calibration import value
from dualpath.cost.errors import InvalidWorkloadError, ModelDoesNotFitError
from dualpath.cost.gpu import GpuProfile, get_gpu
from dualpath.cost.targets import get_target

__all__ = ["CostModel", "cost_model"]

DEFAULT_RESERVE_FRACTION = value("hbm_reserve_fraction")  # HBM kept for activations, CUDA context, allocator slack


class _Work:
    """Token counts of one batch that the per-layer formulas need (a plain slotted class:
    the simulator builds hundreds of thousands of these a minute)."""

    __slots__ = ("attn_pairs", "heads_out", "index_pairs", "index_read", "kv_read", "tokens")

    def __init__(self, tokens: int, heads_out: int, attn_pairs: int, kv_read: int, index_pairs: int, index_read: int) -> None:
        self.tokens = tokens  # new tokens (query rows of every GEMM)
        self.heads_out = heads_out  # tokens that need logits
        self.attn_pairs = attn_pairs  # query-key pairs scored by attention
        self.kv_read = kv_read  # KV entries attention reads from HBM
        self.index_pairs = index_pairs  # query-key pairs scored by the indexer
        self.index_read = index_read  # indexer keys read from HBM


_PAIR_CACHE_MAX: Final = 4096  # (cached, new) -> span sums kept between calls; cleared when full
_PAIR_KEY: Final = 1 << 32  # a pair's cache key is cached * _PAIR_KEY + new: an int, no tuple per lookup


def _span_sum(cached: int, new: int, cap: int) -> int:
    """Sum over i = 1..new of min(cached + i, cap); cap 0 means no cap."""
    full = new * cached + new * (new + 1) // 2
    if not cap:
        return full
    m = min(max(cap - cached, 0), new)  # tokens that still see fewer than cap keys
    return m * cached + m * (m + 1) // 2 + (new - m) * cap


class CostModel:
    """Predicted FLOPs, times and HBM capacity of one engine (one GPU) for a target model."""

    __slots__ = ("_c", "_decode_a2a_s", "_gemm_rate", "_hbm_rate", "_local_experts", "_pairs", "_replicated", "ep", "gpu", "target")

    def __init__(self, target: ModelTarget, gpu: GpuProfile, *, ep: int | None = None) -> None:
        """Build the model; ``ep`` (default ``target.default_ep``) is the expert-parallel size.

        Raises:
            InvalidWorkloadError: ``ep`` is smaller than 1.
        """
        ep = target.default_ep if ep is None else ep
        if ep < 1:
            raise InvalidWorkloadError("expert-parallel size ep", ep)
        self.target, self.gpu, self.ep = target, gpu, ep
        self._local_experts = math.ceil(target.routed_experts / ep)
        # a decode step's all-to-all latency over every MoE layer (0 within one node)
        self._decode_a2a_s = target.moe_layers * gpu.decode_all_to_all_s(ep) if target.routed_experts else 0.0
        peak = gpu.fp8_flops if target.weight_bytes == 1 else gpu.bf16_flops
        self._gemm_rate = peak * gpu.mfu_dense
        self._hbm_rate = gpu.hbm_bytes_per_s * gpu.hbm_efficiency
        # Replicated weights of one layer: [dense layer, MoE layer]
        t = target
        self._replicated = (t.attn_proj_params() + t.dense_mlp_params(), t.attn_proj_params() + t.moe_replicated_params())
        self._pairs: dict[int, tuple[int, int, int]] = {}  # (cached, new) as one int -> (attn, index, dense KV) sums
        # Every factor of _total_time that does not depend on the batch, computed once with the
        # same operations as the per-layer methods, so the fused form gives the same floats.
        rep0, rep1 = self._replicated
        wb = t.weight_bytes
        self._c = (
            self._hbm_rate,
            self._gemm_rate,
            gpu.layer_overhead_s,
            t.attention_pair_flops(),
            gpu.bf16_flops * gpu.mfu_attention,
            t.kv_bytes_per_token_layer,
            t.index_pair_flops(),
            gpu.fp8_flops * gpu.mfu_attention,
            t.index_bytes_per_token_layer,
            rep0,
            rep1,
            rep0 * wb / self._hbm_rate,
            rep1 * wb / self._hbm_rate,
            t.experts_per_token,
            self._local_experts,
            t.expert_params(),
            wb,
            t.dense_layers,
            t.moe_layers,
            t.vocab * t.hidden,
            t.vocab * t.hidden * wb / self._hbm_rate,
            t.sparse_topk,
            bool(t.index_heads),
        )

    # -- work descriptions ------------------------------------------------------------
    def _prefill_work(self, batch: Sequence[tuple[int, int]]) -> _Work:
        topk, has_index = self._c[21], self._c[22]
        pairs = self._pairs
        tokens = attn = dense_kv = index = 0
        for cached, new in batch:
            if cached < 0 or not 0 < new < _PAIR_KEY:  # checked before the lookup: the key is unique only in range
                raise InvalidWorkloadError("prefill request (cached, new)", (cached, new))
            key = cached * _PAIR_KEY + new
            sums = pairs.get(key)
            if sums is None:  # a batcher asks for the same pairs many times while it packs
                if len(pairs) >= _PAIR_CACHE_MAX:
                    pairs.clear()
                sums = pairs[key] = (_span_sum(cached, new, topk), _span_sum(cached, new, 0), cached + new)
            tokens += new
            attn += sums[0]
            index += sums[1]
            dense_kv += sums[2]
        # Sparse attention gathers its own top-k keys per query; dense reads the KV once.
        kv = attn if topk else dense_kv
        return _Work(tokens, len(batch), attn, kv, index * has_index, dense_kv * has_index)

    def _decode_work(self, context_lens: Sequence[int]) -> _Work:
        t = self.target
        keys = attn = 0
        for ctx in context_lens:
            if ctx < 1:
                raise InvalidWorkloadError("decode context length", ctx)
            keys += ctx + 1  # the new token attends to its context and itself
            attn += min(ctx + 1, t.sparse_topk) if t.sparse_topk else ctx + 1
        has_index = bool(t.index_heads)
        n = len(context_lens)
        # Sparse decode gathers top-k entries; the indexer scores and reads every key.
        return _Work(n, n, attn, attn, keys * has_index, keys * has_index)

    # -- roofline -----------------------------------------------------------------------
    def _roof(self, flops: float, rate: float, nbytes: float) -> float:
        return max(flops / rate, nbytes / self._hbm_rate)

    def _attention_layer_time(self, w: _Work) -> float:
        hbm, _, _, pair_flops, attn_rate, kvb, index_flops, index_rate, ib = self._c[:9]
        a, b = pair_flops * w.attn_pairs / attn_rate, w.kv_read * kvb / hbm
        attn = a if a >= b else b  # the roofline: max(compute, memory), as _roof
        a, b = index_flops * w.index_pairs / index_rate, w.index_read * ib / hbm
        return attn + (a if a >= b else b)

    def _layer_time(self, w: _Work, *, moe: bool) -> float:
        t, wb = self.target, self.target.weight_bytes
        replicated = self._replicated[moe]
        total = self._roof(2 * w.tokens * replicated, self._gemm_rate, replicated * wb)
        if moe:
            slots = w.tokens * t.experts_per_token  # expert-token products on this GPU
            touched = min(self._local_experts, slots)
            total += self._roof(2 * slots * t.expert_params(), self._gemm_rate, touched * t.expert_params() * wb)
        return total + self._attention_layer_time(w) + self.gpu.layer_overhead_s

    def _head_time(self, w: _Work) -> float:
        params = self.target.vocab * self.target.hidden
        nbytes = params * self.target.weight_bytes
        return self._roof(2 * w.heads_out * params, self._gemm_rate, nbytes)

    def _total_time(self, w: _Work) -> float:
        """All layers and the LM head: ``(L - M) * _layer_time(dense) + M * _layer_time(MoE) +
        _head_time``, fused (the simulator's hottest arithmetic) with the same operations in
        the same order, so it returns exactly what those methods would."""
        (hbm, gemm, overhead, pair_flops, attn_rate, kvb, index_flops, index_rate, ib, rep0, rep1, rep0_s, rep1_s, k, local, ep, wb,
         dense_layers, moe_layers, head_params, head_s, _, _) = self._c  # fmt: skip
        # attention and indexer (_attention_layer_time), the same in every layer
        a, b = pair_flops * w.attn_pairs / attn_rate, w.kv_read * kvb / hbm
        attn = a if a >= b else b
        a, b = index_flops * w.index_pairs / index_rate, w.index_read * ib / hbm
        attn += a if a >= b else b
        tokens = w.tokens
        a = 2 * tokens * rep0 / gemm
        dense = ((a if a >= rep0_s else rep0_s) + attn) + overhead
        a = 2 * tokens * rep1 / gemm
        moe = a if a >= rep1_s else rep1_s
        slots = tokens * k
        a, b = 2 * slots * ep / gemm, (local if local < slots else slots) * ep * wb / hbm
        moe += a if a >= b else b
        moe = (moe + attn) + overhead
        a = 2 * w.heads_out * head_params / gemm
        return dense_layers * dense + moe_layers * moe + (a if a >= head_s else head_s)

    # -- public API ---------------------------------------------------------------------
    def prefill_flops(self, cached: int, new: int) -> float:
        """FLOPs to prefill ``new`` tokens of one request on top of ``cached`` ones (all layers).

        Raises:
            InvalidWorkloadError: ``cached < 0`` or ``new < 1``.
        """
        t = self.target
        w = self._prefill_work([(cached, new)])
        gemm = sum(t.layer_gemm_flops_per_token(layer) for layer in range(t.layers))
        per_layer_attn = t.attention_pair_flops() * w.attn_pairs + t.index_pair_flops() * w.index_pairs
        return float(new * gemm + t.layers * per_layer_attn + t.lm_head_flops_per_token())

    def prefill_layer_time(self, batch: Sequence[tuple[int, int]], *, layer: int | None = None) -> float:
        """Seconds for one layer of a prefill batch of ``(cached, new)`` requests.

        With ``layer`` the time of that layer (dense and MoE layers differ); without it the
        mean layer, LM head included, so ``layers * prefill_layer_time(b) == prefill_time(b)``.

        Raises:
            InvalidWorkloadError: a request has ``cached < 0`` or ``new < 1``, or ``layer``
                is outside ``[0, layers)``.
        """
        t = self.target
        if layer is None:
            return self.prefill_time(batch) / t.layers
        if not 0 <= layer < t.layers:
            raise InvalidWorkloadError("layer index", layer)
        if not batch:
            return 0.0
        return self._layer_time(self._prefill_work(batch), moe=t.is_moe_layer(layer))

    def prefill_head_time(self, batch: Sequence[tuple[int, int]]) -> float:
        """Seconds of the LM head of a prefill batch (one row per request): with the layers'
        ``prefill_layer_time(batch, layer=l)`` it sums to ``prefill_time(batch)``.

        Raises:
            InvalidWorkloadError: a request has ``cached < 0`` or ``new < 1``.
        """
        return self._head_time(self._prefill_work(batch)) if batch else 0.0

    def prefill_time(self, batch: Sequence[tuple[int, int]]) -> float:
        """Seconds to prefill a batch of ``(cached, new)`` requests through all layers.

        Raises:
            InvalidWorkloadError: a request has ``cached < 0`` or ``new < 1``.
        """
        return self._total_time(self._prefill_work(batch)) if batch else 0.0

    def attention_time(self, batch: Sequence[tuple[int, int]]) -> float:
        """Seconds of attention (and indexer) alone in a prefill batch, all layers.

        This is what the intra-engine scheduler compares with its compute quota.

        Raises:
            InvalidWorkloadError: a request has ``cached < 0`` or ``new < 1``.
        """
        if not batch:
            return 0.0
        return self.target.layers * self._attention_layer_time(self._prefill_work(batch))

    def decode_step_time(self, context_lens: Sequence[int]) -> float:
        """Seconds for one decode step (one token per request) of a batch, all layers, with
        the expert-parallel all-to-all when the EP group spans nodes (module docstring).

        Raises:
            InvalidWorkloadError: a context length is smaller than 1.
        """
        return self._total_time(self._decode_work(context_lens)) + self._decode_a2a_s if context_lens else 0.0

    def decode_step_time_totals(self, requests: int, keys: int, attended: int) -> float:
        """``decode_step_time`` from the batch's totals instead of its context lengths:
        ``requests`` sequences, ``keys`` = Σ (ctx + 1), ``attended`` = Σ min(ctx + 1, top_k)
        (= ``keys`` for dense attention). The simulator keeps these sums incrementally, so a
        step's time costs O(1) however large the batch.

        Raises:
            InvalidWorkloadError: a negative total, or fewer keys than requests.
        """
        if requests <= 0:
            return 0.0
        if keys < requests or attended < 0:
            raise InvalidWorkloadError("decode totals (requests, keys, attended)", (requests, keys, attended))
        index = keys * self._c[22]
        return self._total_time(_Work(requests, requests, attended, attended, index, index)) + self._decode_a2a_s

    def kv_bytes(self, tokens: int) -> int:
        """KV-cache bytes of ``tokens`` tokens over all layers (what storage moves).

        Raises:
            InvalidWorkloadError: ``tokens < 0``.
        """
        if tokens < 0:
            raise InvalidWorkloadError("token count", tokens)
        return tokens * self.target.kv_bytes_per_token()

    def weight_bytes_per_gpu(self) -> int:
        """Bytes of weights one GPU holds: replicated weights plus its share of the experts."""
        t = self.target
        routed = t.moe_layers * t.routed_experts * t.expert_params()
        local = t.moe_layers * self._local_experts * t.expert_params()
        return (t.total_params() - routed + local) * t.weight_bytes

    def hbm_kv_capacity_tokens(self, *, reserve_fraction: float = DEFAULT_RESERVE_FRACTION) -> int:
        """Tokens of KV-cache (with indexer keys) one engine's HBM holds beside its weights.

        ``reserve_fraction`` of HBM is kept for activations, the CUDA context and slack.

        Raises:
            InvalidWorkloadError: ``reserve_fraction`` is outside ``[0, 1)``.
            ModelDoesNotFitError: the weights leave no room for KV-cache.
        """
        if not 0.0 <= reserve_fraction < 1.0:
            raise InvalidWorkloadError("reserve_fraction", reserve_fraction)
        usable = int(self.gpu.hbm_capacity_bytes * (1.0 - reserve_fraction))
        weights = self.weight_bytes_per_gpu()
        if weights >= usable:
            raise ModelDoesNotFitError(self.target.name, weights, usable)
        return (usable - weights) // self.target.hbm_bytes_per_token()

    def prefill_tokens_per_s(self, context: int = 32768, append: int = 429, *, requests: int = 16) -> float:
        """New tokens per second one GPU prefills in a batch of ``requests`` equal turns.

        The scheduler's beta is this times 5 s.

        Raises:
            InvalidWorkloadError: ``context < 0``, ``append < 1`` or ``requests < 1``.
        """
        if requests < 1:
            raise InvalidWorkloadError("request count", requests)
        return requests * append / self.prefill_time([(context, append)] * requests)

    def cache_compute_ratio(self, context: int, append: int = 429) -> float:
        """GB of KV loaded per PFLOP computed for one turn (10^9 bytes per 10^15 FLOP).

        ``context`` cached tokens are loaded; ``append`` tokens are prefilled on top.

        Raises:
            InvalidWorkloadError: ``context < 0`` or ``append < 1``.
        """
        return self.kv_bytes(context) / self.prefill_flops(context, append) * 1e6


def cost_model(target: str, gpu: str = "h800", *, ep: int | None = None) -> CostModel:
    """Build the cost model of target ``target`` (a name of TARGETS or a path to a
    ``config.json``) on GPU ``gpu`` (a name of GPUS).

    Raises:
        UnknownTargetError: ``target`` is neither a known name nor an existing path.
        TargetConfigError: the path's ``config.json`` cannot be used.
        UnknownGpuError: ``gpu`` is not a known GPU profile.
        InvalidWorkloadError: ``ep`` is smaller than 1.
    """
    return CostModel(get_target(target), get_gpu(gpu), ep=ep)
