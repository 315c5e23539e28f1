"""``Decoder``: the supported decoder families with a layer-wise forward over externally held KV.

The engines own the KV cache (it arrives from storage, another engine, or their own
earlier steps); the decoder owns only weights. ``forward_layer`` runs one layer for the new
tokens of several sequences at once: the linear layers (and the MoE experts) see all ``N``
tokens as one matrix, attention runs per sequence over ``past_i ++ new_i`` with a causal
mask.

A layer is an attention part and an MLP part, each chosen by ``config.json``:

- ``_GqaAttention``: q/k/v projections (fused into one matmul), optional biases, optional
  per-head q/k RMSNorm (Qwen3), RoPE, grouped-query attention. A token keeps K and V.
- ``_MlaAttention``: multi-head latent attention (DeepSeek-V2/V3). A token keeps only the
  normalised latent ``c`` (``kv_lora_rank``) and the rotary key ``k_pe`` (``qk_rope_head_dim``,
  shared by every head). Attention either expands the latents per head (``kv_b_proj``; cheap
  when many queries share few keys, as in a prefill) or absorbs ``kv_b_proj`` into the
  queries and the output (no per-token expansion; cheap in decode). Both are exact; the
  cheaper one by FLOPs is taken per sequence.
- ``_Mlp``: SwiGLU, gate and up fused. ``_Moe``: a router (softmax or sigmoid scores,
  optional correction bias, grouped top-k), tokens grouped by expert (one matmul per active
  expert, never a loop over tokens), weights normalised and scaled as the config says,
  plus the shared experts.

The KV one token keeps per layer is described by ``config.kv_spec`` (``KvSpec``): what
``forward_layer`` returns as ``(k, v)`` and accepts as ``past``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dualpath.model.config import KvSpec, ModelConfig, MoeConfig
from dualpath.model.errors import ModelInputError
from dualpath.model.rope import RotaryEmbedding, mla_softmax_scale
from dualpath.model.weights import expected_shapes, locate_tensors, read_tensors

__all__ = ["Decoder", "PastKV"]

PastKV = tuple[torch.Tensor, torch.Tensor] | None  # (k, v): [P, *kv_spec.k_shape], [P, *kv_spec.v_shape]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # In float32 then back, as transformers' RMSNorm modules do (the same operations, fewer
    # temporaries: the per-row scale and the product are updated in place).
    x32 = x.to(torch.float32)
    scale = x32.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()  # [..., 1]
    return (x32 * scale).to(x.dtype).mul_(weight)


def _transposed(w: torch.Tensor) -> torch.Tensor:
    """A linear layer's weight ``[out, in]`` kept as ``[in, out]`` (contiguous) for ``_linear``."""
    return w.t().contiguous()


def _linear(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w_t.T, bias)`` for ``x [N, in]`` and a weight kept transposed, ``w_t [in, out]``.

    The same product; on CPU, MKL's float32 GEMM streams an ``[in, out]`` weight faster when
    ``N`` is small (a decode step's batch, an expert's tokens) and as fast for a prefill.
    """
    return x @ w_t if bias is None else torch.addmm(bias, x, w_t)


def _causal_mask(n: int, past_len: int, device: torch.device) -> torch.Tensor:
    """Query ``j`` (absolute ``past_len + j``) sees keys ``0..past_len + j``."""
    cols = torch.arange(past_len + n, device=device)
    rows = torch.arange(n, device=device) + past_len
    return cols[None, :] <= rows[:, None]  # [n, P + n]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_len: int, scale: float, gqa: bool = False) -> torch.Tensor:
    """Causal attention of ``q [H, n, E]`` over ``k [Hk, T, E]``, ``v [Hk, T, Ev]`` -> ``[H, n, Ev]``:
    query ``j`` is position ``past_len + j`` and sees the keys up to it.

    Shaped for the fused kernels (flash on CPU and GPU): 4-D inputs, one head dim for q, k
    and v (v is zero-padded; its extra columns are sliced off), ``is_causal`` instead of a
    mask when there is no past. A 3-D call, a mask or unequal head dims fall back to the
    unfused math kernel, several times slower. One query (a decode step) takes two matmuls.
    """
    n, e, ev = q.shape[1], q.shape[-1], v.shape[-1]
    if n == 1:
        return _attend_all(q, k, v, scale)
    if ev < e:
        v = F.pad(v, (0, e - ev))
    elif ev > e:
        q, k = F.pad(q, (0, ev - e)), F.pad(k, (0, ev - e))
    mask = _causal_mask(n, past_len, q.device) if past_len else None
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=not past_len, scale=scale, enable_gqa=gqa)[0]
    return out[..., :ev] if ev < out.shape[-1] else out


def _attend_all(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Every query sees every key (a decode step's one query per head): two batched matmuls
    per KV head, its query heads as the rows. Faster than the fused kernel for one query
    (no tiling, no threads to wake) and as exact; softmax in float32 as transformers does."""
    heads, n, kv_heads = q.shape[0], q.shape[1], k.shape[0]
    g = heads // kv_heads
    rows = q.reshape(kv_heads, g * n, q.shape[-1])  # query heads of one KV head, then their queries
    scores = torch.bmm(rows, k.transpose(1, 2)) * scale  # [Hk, g n, T]
    probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs, v).reshape(heads, n, v.shape[-1])


# Where a layer's KV comes from, per sequence: ``past`` (cached parts, the new ones are
# appended by a copy) or ``caches`` (the caller's head-major ``[heads, capacity, head_width]``
# buffer, ``KvSpec.rows``, with ``P`` tokens in it: the new parts are written in place after
# them, nothing is copied).
Caches = Sequence[tuple[torch.Tensor, int]] | None


def _kv_all(spec: KvSpec, i: int, k_new: torch.Tensor, v_new: torch.Tensor, past: Sequence[PastKV], caches: Caches):
    """Sequence ``i``'s parts for every position, the new ``k_new``/``v_new`` last."""
    if caches is not None:
        buf, plen = caches[i]
        n = k_new.shape[0]
        spec.pack_rows_into(buf[:, plen : plen + n], k_new, v_new)
        return spec.unpack_rows(buf[:, : plen + n])
    cached = past[i]
    if cached is None:
        return k_new, v_new
    return torch.cat((cached[0], k_new)), torch.cat((cached[1], v_new))


def _each_sequence(segments: Sequence[tuple[int, int]], attend) -> torch.Tensor:
    """``attend(i, start, end)`` for every sequence with new tokens, in row order, as one
    ``[N, ...]`` tensor (a lone sequence's output as it is, without a copy)."""
    order = sorted((start, i, length) for i, (start, length) in enumerate(segments) if length)
    parts = [attend(i, start, start + length) for start, i, length in order]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class _GqaAttention:
    def __init__(self, cfg: ModelConfig, t: dict[str, torch.Tensor], p: str, rope: RotaryEmbedding) -> None:
        names = ("q_proj", "k_proj", "v_proj")
        self.qkv = _transposed(torch.cat([t[f"{p}{n}.weight"] for n in names]))  # [H, (heads + 2 kvh) * hd]
        self.qkv_bias = torch.cat([t[f"{p}{n}.bias"] for n in names]) if cfg.attention_bias else None
        self.o = _transposed(t[p + "o_proj.weight"])  # [heads * hd, H]
        self.o_bias = t.get(p + "o_proj.bias")
        self.heads, self.kv_heads, self.hd, self.eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        # Qwen3's per-head q and k norms as one weight over the q heads then the k heads: [heads + kvh, hd]
        self.qk_norm = (
            torch.cat((t[p + "q_norm.weight"].expand(self.heads, -1), t[p + "k_norm.weight"].expand(self.kv_heads, -1)))
            if cfg.qk_norm
            else None
        )
        self.rope, self.spec = rope, cfg.kv_spec

    def __call__(self, x, cos, sin, segments, past, caches: Caches = None):
        n, hd, heads, kvh = x.shape[0], self.hd, self.heads, self.kv_heads
        qkv = _linear(x, self.qkv, self.qkv_bias)  # [N, (heads + 2 kvh) * hd]
        qk = qkv[:, : (heads + kvh) * hd].view(n, heads + kvh, hd)
        if self.qk_norm is not None:
            qk = _rms_norm(qk, self.qk_norm, self.eps)
        # q and k rotated together and written head by head, [heads + kvh, N, hd]: the fused
        # attention kernel reads each head's rows back to back
        out = torch.empty((heads + kvh, n, hd), dtype=qkv.dtype, device=qkv.device)
        qk = self.rope.rotate(qk.transpose(0, 1), cos.transpose(0, 1), sin.transpose(0, 1), out=out).transpose(0, 1)
        q, k = qk[:, :heads], qk[:, heads:]  # [N, heads, hd], [N, kvh, hd]
        v = qkv[:, (heads + kvh) * hd :].view(n, kvh, hd)
        if caches is not None and all(length == 1 for _, length in segments):
            attn, k, v = self._decode(q, k, v, segments, caches)
        else:
            v = v.transpose(0, 1).contiguous().transpose(0, 1)  # head by head as well
            attn = _each_sequence(segments, lambda i, s, e: self._attend(q[s:e], *_kv_all(self.spec, i, k[s:e], v[s:e], past, caches)))
        return _linear(attn.reshape(n, -1), self.o, self.o_bias), k, v  # attn [N, heads, hd]

    def _decode(self, q, k, v, segments, caches: Sequence[tuple[torch.Tensor, int]]):
        """A decode step: sequence ``i``'s one new token (row ``segments[i][0]``) is written
        into its head-major buffer ``caches[i]`` (one copy of the token's K and V) and attends
        over every token there with the fused kernel, each KV head's query heads as its rows of
        queries (no mask: one position sees all). A head's keys and values are contiguous runs
        of the buffer, read in place. Returns ``(attn [N, heads, hd], k, v)``, ``k``/``v`` views
        of the new tokens' parts."""
        n, kvh, hd = k.shape
        kw, g = self.spec.k_width, self.heads // kvh
        new = torch.empty((n, self.spec.width), dtype=k.dtype, device=k.device)  # as a cache holds a token
        new[:, :kw].view(n, kvh, hd).copy_(k)
        new[:, kw:].view(n, kvh, hd).copy_(v)
        q = q.reshape(n, 1, kvh, g, hd)  # query heads grouped by KV head, as rows of queries
        rows = new.view(n, 2 * kvh, hd)
        outs = []
        for (row, _), (buf, plen) in zip(segments, caches):  # buf [2 kvh, capacity, hd]: K's heads then V's
            t = plen + 1
            buf[:, plen].copy_(rows[row])
            outs.append(F.scaled_dot_product_attention(q[row], buf[None, :kvh, :t], buf[None, kvh:, :t], scale=hd**-0.5))
        return torch.cat(outs).view(n, self.heads, hd), new[:, :kw].view(n, kvh, hd), new[:, kw:].view(n, kvh, hd)

    def _attend(self, q, k, v):
        """Causal GQA attention of ``q [n, heads, hd]`` (the last ``n`` positions) over ``k, v [T, kvh, hd]``."""
        past_len = k.shape[0] - q.shape[0]
        out = _sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), past_len, self.hd**-0.5, gqa=self.heads != self.kv_heads)
        return out.transpose(0, 1)  # [n, heads, hd]


class _MlaAttention:
    def __init__(self, cfg: ModelConfig, t: dict[str, torch.Tensor], p: str, rope: RotaryEmbedding) -> None:
        m = cfg.mla
        assert m is not None
        self.m, self.heads, self.eps, self.rope = m, cfg.num_attention_heads, cfg.rms_norm_eps, rope
        bias = cfg.attention_bias
        kv_a = t[p + "kv_a_proj_with_mqa.weight"]
        kv_a_bias = t[p + "kv_a_proj_with_mqa.bias"] if bias else None
        self.q_lora: tuple[torch.Tensor, torch.Tensor] | None = None  # (q_a_layernorm, q_b_proj)
        if m.q_lora_rank is None:
            # q and the latent from one matmul: [H, heads * qk_head + r + d]
            self.down = _transposed(torch.cat((t[p + "q_proj.weight"], kv_a)))
            self.down_bias = (
                None
                if kv_a_bias is None
                else torch.cat((torch.zeros(self.heads * m.qk_head_dim, dtype=kv_a.dtype, device=kv_a.device), kv_a_bias))
            )
            self.q_split = self.heads * m.qk_head_dim
        else:
            self.down = _transposed(torch.cat((t[p + "q_a_proj.weight"], kv_a)))  # [H, q_lora + r + d]
            self.down_bias = None if kv_a_bias is None else torch.cat((t[p + "q_a_proj.bias"], kv_a_bias))
            self.q_split = m.q_lora_rank
            self.q_lora = (t[p + "q_a_layernorm.weight"], _transposed(t[p + "q_b_proj.weight"]))
        self.kv_a_norm = t[p + "kv_a_layernorm.weight"]
        kv_b = t[p + "kv_b_proj.weight"]  # [heads * (nope + v), r]
        self.kv_b = kv_b
        w = kv_b.view(self.heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        self.w_uk = w[:, : m.qk_nope_head_dim].contiguous()  # [heads, nope, r]: q_nope -> latent space
        self.w_uv_t = w[:, m.qk_nope_head_dim :].transpose(1, 2).contiguous()  # [heads, r, v]: latent -> v
        self.o, self.o_bias = _transposed(t[p + "o_proj.weight"]), t.get(p + "o_proj.bias") if bias else None
        self.scale = mla_softmax_scale(m.qk_head_dim, cfg.rope_scaling)
        self.spec = cfg.kv_spec

    def __call__(self, x, cos, sin, segments, past, caches: Caches = None):
        m, n, heads = self.m, x.shape[0], self.heads
        down = _linear(x, self.down, self.down_bias)
        q_in, latent = down.split([self.q_split, m.kv_lora_rank + m.qk_rope_head_dim], dim=-1)
        q = q_in if self.q_lora is None else _linear(_rms_norm(q_in, self.q_lora[0], self.eps), self.q_lora[1])
        q = q.reshape(n, heads, m.qk_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = latent.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        c = _rms_norm(c_kv, self.kv_a_norm, self.eps).reshape(n, 1, m.kv_lora_rank)  # what a token keeps
        q_pe = self.rope.rotate(q_pe, cos, sin)  # [N, heads, d]
        k_pe = self.rope.rotate(k_pe.reshape(n, 1, m.qk_rope_head_dim), cos, sin)  # [N, 1, d]
        attn = _each_sequence(
            segments, lambda i, s, e: self._attend(q_nope[s:e], q_pe[s:e], *_kv_all(self.spec, i, c[s:e], k_pe[s:e], past, caches))
        )  # [N, heads, v_head_dim]
        return _linear(attn.reshape(n, -1), self.o, self.o_bias), c, k_pe

    def _attend(self, q_nope, q_pe, c, k_pe):
        """Causal MLA of the last ``n`` positions' queries over ``c [T, 1, r]``, ``k_pe [T, 1, d]``:
        ``[n, heads, v_head_dim]``."""
        m, n, t = self.m, q_nope.shape[0], c.shape[0]
        r, nope, vd = m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim
        expanded_flops = t * r * (nope + vd) + n * t * (nope + m.qk_rope_head_dim + vd)
        absorbed_flops = n * r * (nope + vd) + n * t * (2 * r + m.qk_rope_head_dim)
        attend = self.attend_expanded if expanded_flops <= absorbed_flops else self.attend_absorbed
        return attend(q_nope, q_pe, c, k_pe)

    def attend_expanded(self, q_nope, q_pe, c, k_pe):
        """Keys and values per head from the latents (``kv_b_proj``), then plain attention.
        ``c [T, 1, r]``, ``k_pe [T, 1, d]`` hold every position; the queries are the last ``n``."""
        m, n, t = self.m, q_nope.shape[0], c.shape[0]
        nope, vd = m.qk_nope_head_dim, m.v_head_dim
        kv = F.linear(c[:, 0], self.kv_b).view(t, self.heads, nope + vd)  # [T, heads, nope + v]
        k_nope, v = kv.split([nope, vd], dim=-1)
        k = torch.cat((k_nope, k_pe.expand(t, self.heads, -1)), dim=-1)  # [T, heads, qk_head]
        q = torch.cat((q_nope, q_pe), dim=-1)  # [n, heads, qk_head]
        return _sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), t - n, self.scale).transpose(0, 1)

    def attend_absorbed(self, q_nope, q_pe, c, k_pe):
        """``kv_b_proj`` folded into the queries (``W_uk``) and the output (``W_uv``): attention
        runs in the latent space, one shared key per token, nothing expanded per position."""
        n, t = q_nope.shape[0], c.shape[0]
        q_abs = torch.bmm(q_nope.transpose(0, 1), self.w_uk)  # [heads, n, r]
        q = torch.cat((q_abs, q_pe.transpose(0, 1)), dim=-1)  # [heads, n, r + d]
        k = torch.cat((c, k_pe), dim=-1).transpose(0, 1)  # [1, T, r + d]
        out = _sdpa(q, k, c.transpose(0, 1), t - n, self.scale, gqa=True)  # [heads, n, r]; one shared key per token
        return torch.bmm(out, self.w_uv_t).transpose(0, 1)  # [n, heads, v]


class _Mlp:
    def __init__(self, t: dict[str, torch.Tensor], p: str) -> None:
        self.gate_up = _transposed(torch.cat((t[p + "gate_proj.weight"], t[p + "up_proj.weight"])))  # [H, 2 I]
        self.down = _transposed(t[p + "down_proj.weight"])  # [I, H]

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x [N, H]`` -> ``[N, H]``, into ``out`` (contiguous) when given."""
        n, (inner, hidden) = x.shape[0], self.down.shape
        # On CPU, row blocks whose [rows, 2 I] intermediate stays within 16 MiB: glibc hands
        # out blocks that size again from its heap, but maps every one over 32 MiB afresh,
        # and faulting it in costs about as much as the GEMM that fills it.
        rows = n if x.device.type != "cpu" else max(256, (16 << 20) // (2 * inner * x.element_size()))
        if n <= rows:
            return self._rows(x, out=out)
        if out is None:
            out = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
        for start in range(0, n, rows):
            self._rows(x[start : start + rows], out=out[start : start + rows])
        return out

    def _rows(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = _linear(x, self.gate_up).chunk(2, dim=-1)
        return torch.mm(F.silu(gate, inplace=True).mul_(up), self.down, out=out)


class _Moe:
    def __init__(self, moe: MoeConfig, t: dict[str, torch.Tensor], p: str) -> None:
        self.cfg = moe
        gate = t[p + "gate.weight"]  # [E, H]
        self.router = gate.float() if moe.router_fp32 else gate
        self.bias = t[p + "gate.e_score_correction_bias"].float() if moe.correction_bias else None
        self.experts = [_Mlp(t, f"{p}experts.{e}.") for e in range(moe.num_experts)]
        self.shared = _Mlp(t, p + "shared_experts.") if moe.shared_intermediate_size else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [N, H]`` -> ``(weights [N, k], experts [N, k])``, as the config's router computes them."""
        m = self.cfg
        logits = F.linear(x.float() if m.router_fp32 else x, self.router)  # [N, E]
        scores = logits.softmax(-1, dtype=torch.float32) if m.scoring == "softmax" else logits.float().sigmoid()
        choice = scores if self.bias is None else scores + self.bias
        if m.topk_method != "greedy" and m.n_group > 1:
            grouped = choice.view(-1, m.n_group, m.num_experts // m.n_group)
            if m.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1)[0].sum(-1)  # [N, groups]
            else:
                group_scores = grouped.max(-1).values
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(m.topk_group, dim=-1, sorted=False)[1], 1.0)
            keep = keep.bool()[:, :, None].expand_as(grouped).reshape(-1, m.num_experts)
            choice = choice.masked_fill(~keep, float("-inf") if m.topk_method == "noaux_tc" else 0.0)
        experts = choice.topk(m.experts_per_token, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if m.norm_topk_prob and m.experts_per_token > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if m.router_fp32 else 0.0))
        return weights * m.routed_scaling_factor, experts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        k = self.cfg.experts_per_token
        weights, experts = self.route(x)
        flat = experts.reshape(-1)  # [N k]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.cfg.num_experts).tolist()
        tokens = order // k  # the token of each (token, expert) pair, grouped by expert
        xs = x.index_select(0, tokens)  # [N k, H]
        w = weights.reshape(-1).index_select(0, order).to(x.dtype)[:, None]
        ys = torch.empty_like(xs)
        start = 0
        for e, count in enumerate(counts):  # one matmul per active expert, written in place
            if count:
                self.experts[e](xs[start : start + count], out=ys[start : start + count])
                start += count
        out = torch.zeros_like(x).index_add_(0, tokens, ys.mul_(w))
        if self.shared is not None:
            out = out + self.shared(x)
        return out


@dataclass(frozen=True, slots=True)
class _Layer:
    attention: _GqaAttention | _MlaAttention
    mlp: _Mlp | _Moe
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]


class Decoder:
    """A decoder of any supported family (see ``dualpath.model.config``).

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
        self.kv_spec: KvSpec = config.kv_spec
        self.kv_heads, self.head_dim = self.kv_spec.k_shape  # GQA: K's (kv_heads, head_dim)
        self._embed = tensors["model.embed_tokens.weight"]  # [V, H]
        # [H, V] for _linear; a tied head is the embedding itself (no transposed second copy)
        self._lm_head = None if config.tie_word_embeddings else _transposed(tensors["lm_head.weight"])
        self._norm = tensors["model.norm.weight"]  # [H]
        self._rope = RotaryEmbedding(config, device)
        self._layers = [self._layer(tensors, i) for i in range(self.num_layers)]

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

    def _layer(self, t: dict[str, torch.Tensor], i: int) -> _Layer:
        p, cfg = f"model.layers.{i}.", self.config
        attention_cls = _MlaAttention if cfg.mla is not None else _GqaAttention
        mlp = _Moe(cfg.moe, t, p + "mlp.") if cfg.moe is not None and cfg.is_moe_layer(i) else _Mlp(t, p + "mlp.")
        return _Layer(
            attention=attention_cls(cfg, t, p + "self_attn.", self._rope),
            mlp=mlp,
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
        past: Sequence[PastKV] | None,
        *,
        caches: Caches = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run layer ``layer`` for the new tokens of several sequences.

        ``hidden [N, H]`` is the new tokens of all sequences concatenated, ``positions [N]``
        their absolute positions, ``segments[i] = (start, length)`` sequence ``i``'s rows,
        ``past[i]`` its cached ``(k, v)`` for positions ``0..P_i-1``, shaped
        ``[P_i, *kv_spec.k_shape]`` and ``[P_i, *kv_spec.v_shape]`` (as returned here; views
        such as ``KvSpec.unpack``'s are fine) or ``None``. Sequence ``i``'s queries attend
        causally to ``past_i ++ new_i``. Instead of ``past``, ``caches[i] = (buf, P_i)`` names a
        head-major ``[heads, capacity, head_width]`` buffer (``kv_spec.rows``) holding sequence
        ``i``'s first ``P_i`` tokens of this layer: the new tokens' parts are written into it in
        place and attention reads it there (the decode engine's memory; no copy of the past per
        step).

        Returns ``(hidden_out [N, H], k_new [N, *k_shape], v_new [N, *v_shape])``: GQA's K
        (RoPE applied) and V, or MLA's latent and rotary key (RoPE applied).

        Raises:
            ModelInputError: shapes, dtypes or segments that do not fit (see ``_check``).
        """
        if caches is not None:
            self._check_caches(hidden, segments, caches)
        past = [None] * len(segments) if past is None else past
        self._check(layer, hidden, positions, segments, past)
        cos, sin = self._rope.cos_sin(positions, self.dtype)
        return self._run_layer(self._layers[layer], hidden, cos, sin, segments, past, caches)

    def _run_layer(
        self,
        w: _Layer,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segments: Sequence[tuple[int, int]],
        past: Sequence[PastKV],
        caches: Caches,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward_layer`` on checked arguments, with the rotation tables of ``positions``."""
        eps = self.config.rms_norm_eps
        attn, k, v = w.attention(_rms_norm(hidden, w.input_norm, eps), cos, sin, segments, past, caches)
        out = attn.add_(hidden)  # the residual (attn is this layer's own tensor)
        return w.mlp(_rms_norm(out, w.post_norm, eps)).add_(out), k, v

    @torch.no_grad()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's last RMSNorm: ``[M, H]`` -> ``[M, H]``, the input of the LM head."""
        return _rms_norm(hidden, self._norm, self.config.rms_norm_eps)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: ``[M, H]`` -> ``[M, V]`` float32."""
        x = self.final_norm(hidden)
        return (F.linear(x, self._embed) if self._lm_head is None else _linear(x, self._lm_head)).float()

    async def forward_layer_async(
        self,
        layer: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        segments: Sequence[tuple[int, int]],
        past: Sequence[PastKV] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward_layer`` in a worker thread, so the awaiting event loop keeps serving the bus."""
        return await asyncio.to_thread(self.forward_layer, layer, hidden, positions, segments, past)

    @torch.no_grad()
    def decode_step(self, kvs: Sequence[torch.Tensor], kv_lens: Sequence[int], inputs: Sequence[int]) -> torch.Tensor:
        """One token per sequence: ``inputs[i]`` at position ``kv_lens[i]`` of sequence ``i``.

        ``kvs[i] [layers, heads, capacity, head_width]`` (head-major, ``kv_spec.rows``, as
        ``engine.decode.KvMemory`` allocates it) holds sequence ``i``'s first ``kv_lens[i]``
        tokens' KV and has room for one more: the new token's KV is written there in place
        and attention reads it there (``forward_layer``'s ``caches``). Returns logits
        ``[len(inputs), V]`` float32.

        Raises:
            ModelInputError: a buffer that does not fit (see ``forward_layer``).
        """
        token_t = torch.tensor(list(inputs), dtype=torch.long, device=self.device)
        pos_t = torch.tensor(list(kv_lens), dtype=torch.long, device=self.device)
        segments = [(i, 1) for i in range(len(kv_lens))]
        hidden = self.embed(token_t)
        past: list[PastKV] = [None] * len(segments)
        for kv in kvs:
            if kv.dim() != 4 or kv.shape[0] != self.num_layers:
                raise ModelInputError(f"a sequence's KV must be [{self.num_layers}, heads, capacity, head_width], got {tuple(kv.shape)}")
        # Every layer's buffers and inputs have the same shapes: checked once, and the
        # rotation tables computed once, for the whole step.
        self._check_caches(hidden, segments, [(kv[0], n) for kv, n in zip(kvs, kv_lens)])
        self._check(0, hidden, pos_t, segments, past)
        cos, sin = self._rope.cos_sin(pos_t, self.dtype)
        for layer, w in enumerate(self._layers):
            caches = [(kv[layer], n) for kv, n in zip(kvs, kv_lens)]
            hidden, _, _ = self._run_layer(w, hidden, cos, sin, segments, past, caches)
        return self.logits(hidden)

    async def decode_step_async(self, kvs: Sequence[torch.Tensor], kv_lens: Sequence[int], inputs: Sequence[int]) -> torch.Tensor:
        """``decode_step`` in a worker thread, so the awaiting event loop keeps serving the bus."""
        return await asyncio.to_thread(self.decode_step, kvs, kv_lens, inputs)

    @property
    def compute_charged_s(self) -> float | None:
        """None: this decoder computes for real; no cost model charges its time."""
        return None

    def prefill_time_model(self) -> Callable[[Sequence[tuple[int, int]]], float] | None:
        """None: a prefill batch's time is measured on the device (``engine.profile``)."""
        return None

    def stats(self) -> dict[str, float]:
        """No figures of its own for the engine's report (its time is the engine's busy time)."""
        return {}

    @torch.no_grad()
    def forward_full(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Reference full recompute of one sequence from position 0.

        Returns ``(logits [T, V] float32, k [layers, T, *k_shape], v [layers, T, *v_shape])``.

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

    def _check_caches(self, hidden: torch.Tensor, segments: Sequence[tuple[int, int]], caches: Sequence[tuple[torch.Tensor, int]]) -> None:
        if len(caches) != len(segments):
            raise ModelInputError(f"{len(segments)} segments but {len(caches)} caches")
        heads, head_width = self.kv_spec.rows
        for (_, length), (buf, plen) in zip(segments, caches):
            if (
                buf.dim() != 3
                or (buf.shape[0], buf.shape[2]) != (heads, head_width)
                or buf.dtype != self.dtype
                or buf.device != hidden.device
            ):
                raise ModelInputError(f"a cache must be [{heads}, capacity, {head_width}] {self.dtype}, got {tuple(buf.shape)} {buf.dtype}")
            if plen < 0 or plen + length > buf.shape[1]:
                raise ModelInputError(f"a cache of {buf.shape[1]} tokens cannot hold {plen} + {length}")

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
        spec = self.kv_spec
        for cached in past:
            if cached is None:
                continue
            k, v = cached
            if (
                k.dim() != 3
                or k.shape[1:] != spec.k_shape
                or v.shape[1:] != spec.v_shape
                or v.shape[0] != k.shape[0]
                or k.dtype != self.dtype
                or v.dtype != self.dtype
                or k.device != hidden.device
                or v.device != hidden.device
            ):
                raise ModelInputError(
                    f"past KV must be [P, {spec.k_shape[0]}, {spec.k_shape[1]}] / [P, {spec.v_shape[0]}, {spec.v_shape[1]}] {self.dtype}, "
                    f"got {tuple(k.shape)} {k.dtype} / {tuple(v.shape)} {v.dtype}"
                )
