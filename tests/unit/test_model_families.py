"""Qwen3, Qwen3-MoE, DeepSeek-V2/V3 against transformers' own classes, piece by piece.

The integration test serves whole checkpoints; these check the parts it cannot isolate:
each RoPE scaling against transformers' own init functions, MLA's two exact attention
forms against each other, the batched MoE against a per-token loop, the KV a token keeps,
a decode step over sequences of different lengths against each one's full recompute, and
the tiny checkpoints ``make_tiny_model`` writes for every family (loaded by
transformers, same logits; cached decoding equals a full recompute).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import decode_from_memory

from dualpath.engine.decode import DecodeSequence, KvMemory, decode_step
from dualpath.model import Decoder, ModelConfig, ModelLoadError, greedy_generate, make_tiny_model
from dualpath.model.config import KvSpec
from dualpath.model.rope import attention_factor, inverse_frequencies, mla_softmax_scale
from dualpath.model.tiny import ARCHS

transformers = pytest.importorskip("transformers")
PROMPT = list(b"Agents call tools, then read the results of each call.")


def test_an_unsupported_model_type_is_refused_naming_it_and_every_supported_one(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "vocab_size": 10, "hidden_size": 8}))
    with pytest.raises(ModelLoadError) as err:
        ModelConfig.from_dir(tmp_path)
    assert "'gemma3'" in str(err.value) and all(t in str(err.value) for t in ARCHS)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "attention_factor": 1.3, "truncate": False},
    ],
    ids=["linear", "llama3", "yarn", "yarn-mscale", "yarn-attention-factor"],
)
def test_rope_scalings_are_computed_as_transformers_computes_them(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=160000, rope_parameters={**rope, "rope_theta": 50000.0}
    )
    want_inv, want_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, "cpu")
    ours = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "vocab_size": 300,
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "rope_theta": 50000.0,
            "rope_scaling": rope,
        }  # fmt: skip
    )
    got = inverse_frequencies(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    torch.testing.assert_close(got, want_inv.float(), rtol=1e-6, atol=0)
    assert attention_factor(ours.rope_scaling) == pytest.approx(want_factor, rel=1e-12)


def test_mla_softmax_scale_folds_mscale_all_dim_like_transformers(tmp_path):
    from transformers.modeling_rope_utils import yarn_apply_mscale

    rope = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg = ModelConfig.from_dir(_tiny_config(tmp_path, "deepseek_v3", rope))
    assert mla_softmax_scale(192, cfg.rope_scaling) == pytest.approx(yarn_apply_mscale(rope, 192**-0.5), rel=1e-12)
    assert mla_softmax_scale(192, None) == 192**-0.5


def _tiny_config(where: Path, arch: str, rope: dict | None = None, **kw):
    d = make_tiny_model(where / f"cfg-{arch}", arch=arch, layers=2, **kw)
    if rope is not None:
        raw = json.loads((d / "config.json").read_text())
        raw["rope_scaling"] = rope
        (d / "config.json").write_text(json.dumps(raw))
    return d / "config.json"


@pytest.fixture(scope="module", params=[a for a in ARCHS if a != "qwen2"])
def family(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, layers=3)
    return request.param, path, Decoder.load(path)


def test_tiny_checkpoint_of_every_family_loads_in_transformers_with_the_same_logits(family):
    arch, path, dec = family
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert hf.config.model_type == arch
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].float()
    got = dec.forward_full(PROMPT)[0]
    # The tiny head has logits of std ~1e4 nats (peaked on purpose): compare relative to that.
    assert float((got - want).abs().max()) < 1e-5 * float(want.abs().max())
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_cached_decoding_in_kv_memory_equals_greedy_by_full_recompute(family):
    """The decode engine's memory and step (one token per step over the stored parts) give
    the tokens of a full recompute at every step; for MLA this runs the absorbed form."""
    arch, _, dec = family
    reference = []
    ids = list(PROMPT)
    for _ in range(12):
        nxt = int(dec.forward_full(ids)[0][-1].argmax())
        reference.append(nxt)
        ids.append(nxt)
    assert decode_from_memory(dec, PROMPT, 12) == reference, arch


def _random_checkpoint(path, arch: str):
    """A tiny checkpoint with transformers' random init (not peaked like ``make_tiny_model``'s,
    so attention moves the logits) of a GQA family."""
    config = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[arch](
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_kv_memory_holds_a_tokens_bytes_head_major_and_gives_them_back_unchanged(kind):
    """Storage blocks are token-major ``[layers, T, width]``; the decode engine's memory keeps
    each KV head's tokens back to back. Copied in and out through ``KvMemory.tokens``, the
    bytes come back as they were, also after ``grow``."""
    spec = KvSpec(kind="gqa", k_shape=(2, 4), v_shape=(2, 4)) if kind == "gqa" else KvSpec(kind="mla", k_shape=(1, 6), v_shape=(1, 2))
    memory = KvMemory(layers=3, spec=spec, dtype=torch.float32, device=torch.device("cpu"), capacity_tokens=64, block_tokens=4)
    block = torch.randn(3, 5, spec.width)  # token-major, as storage holds it
    seq = DecodeSequence(request_id="r", tokens=[], kv=memory.allocate(5), kv_len=5)
    assert seq.kv.shape == (3, *spec.rows[:1], 8, spec.rows[1])
    memory.tokens(seq.kv)[:, :5].copy_(spec.as_rows(block))
    if kind == "gqa":  # head-major: K's head 1 is one run of tokens
        assert torch.equal(seq.kv[0, 1, :5], block[0, :, 4:8])
    memory.grow(seq, 9)
    back = torch.empty_like(block)
    spec.as_rows(back).copy_(memory.tokens(seq.kv)[:, :5])
    assert seq.capacity == 12 and torch.equal(back, block)
    k, v = spec.unpack_rows(seq.kv[1, :, :5])
    want_k, want_v = spec.unpack(block[1])
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_one_decode_step_over_sequences_of_different_lengths_gives_each_its_full_recompute(arch, tmp_path):
    """The decode engine's step batches sequences of different lengths, each attending over
    its own buffer with its new token written there first: every row is its sequence's."""
    dec = Decoder.load(_random_checkpoint(tmp_path, arch))
    spec = dec.kv_spec
    memory = KvMemory(layers=dec.num_layers, spec=spec, dtype=dec.dtype, device=dec.device, capacity_tokens=1024, block_tokens=16)
    seqs, inputs, want = [], [], []
    for n in (5, len(PROMPT), 17):
        prompt = PROMPT[:n]
        logits, k, v = dec.forward_full(prompt)
        kv = memory.allocate(n + 1)
        for layer in range(dec.num_layers):
            spec.pack_rows_into(kv[layer, :, :n], k[layer], v[layer])
        seqs.append(DecodeSequence(request_id=str(n), tokens=list(prompt), kv=kv, kv_len=n))
        inputs.append(int(logits[-1].argmax()))
        want.append(dec.forward_full(prompt + [inputs[-1]])[0][-1])
    got = decode_step(dec, memory, seqs, inputs)
    torch.testing.assert_close(got, torch.stack(want), rtol=0, atol=1e-4)
    assert [s.kv_len for s in seqs] == [6, len(PROMPT) + 1, 18]


def test_the_kv_a_token_keeps_is_the_latent_and_rotary_key_for_mla_and_k_v_otherwise(family):
    arch, _, dec = family
    cfg, spec = dec.config, dec.kv_spec
    _, k, v = dec.forward_full(PROMPT[:10])
    if cfg.mla is not None:
        assert spec.kind == "mla" and spec.width == cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
        assert k.shape[2:] == (1, cfg.mla.kv_lora_rank) and v.shape[2:] == (1, cfg.mla.qk_rope_head_dim)
        assert cfg.kv_bytes_per_token_layer(torch.bfloat16) == 2 * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
    else:
        assert spec.kind == "gqa" and spec.width == 2 * cfg.num_key_value_heads * cfg.head_dim
        assert k.shape[2:] == v.shape[2:] == (cfg.num_key_value_heads, cfg.head_dim)
    flat = torch.empty(10, spec.width)
    spec.pack_into(flat, k[0], v[0])
    k2, v2 = spec.unpack(flat)
    assert torch.equal(k2, k[0]) and torch.equal(v2, v[0])


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_mla_expanded_and_absorbed_attention_agree(arch, tmp_path):
    dec = Decoder.load(make_tiny_model(tmp_path, arch=arch, layers=1, seed=5))
    att = dec._layers[0].attention
    gen = torch.Generator().manual_seed(0)
    m, h = dec.config.mla, dec.num_heads
    t, n = 37, 5
    q_nope = torch.randn(n, h, m.qk_nope_head_dim, generator=gen)
    q_pe = torch.randn(n, h, m.qk_rope_head_dim, generator=gen)
    c = torch.randn(t, 1, m.kv_lora_rank, generator=gen)
    k_pe = torch.randn(t, 1, m.qk_rope_head_dim, generator=gen)
    a, b = att.attend_expanded(q_nope, q_pe, c, k_pe), att.attend_absorbed(q_nope, q_pe, c, k_pe)
    assert a.shape == (n, h, m.v_head_dim)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2", "deepseek_v3"])
def test_batched_moe_equals_a_per_token_loop_over_the_chosen_experts(arch, tmp_path):
    dec = Decoder.load(make_tiny_model(tmp_path, arch=arch, layers=2, experts=8, experts_per_token=3, seed=2))
    moe = dec._layers[1].mlp
    x = torch.randn(29, dec.config.hidden_size, generator=torch.Generator().manual_seed(1))
    weights, experts = moe.route(x)
    assert experts.shape == (29, 3) and len({tuple(sorted(r)) for r in experts.tolist()}) > 1
    want = torch.stack(
        [
            sum(float(w) * moe.experts[int(e)](x[i : i + 1])[0] for w, e in zip(weights[i], experts[i]))
            + (moe.shared(x[i : i + 1])[0] if moe.shared is not None else 0)
            for i in range(x.shape[0])
        ]
    )
    torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-4)


def test_grouped_routing_chooses_experts_only_inside_the_kept_groups(tmp_path):
    dec = Decoder.load(make_tiny_model(tmp_path, arch="deepseek_v3", layers=2, experts=16, experts_per_token=4))
    moe = dec._layers[1].mlp
    assert (moe.cfg.n_group, moe.cfg.topk_group) == (4, 2)
    _, experts = moe.route(torch.randn(64, dec.config.hidden_size, generator=torch.Generator().manual_seed(3)))
    groups = {tuple(sorted({e // 4 for e in row})) for row in experts.tolist()}
    assert all(len(g) <= 2 for g in groups) and len(groups) > 1


def test_greedy_generation_of_every_family_is_prompt_dependent(family):
    arch, _, dec = family
    result = greedy_generate(dec, [PROMPT, list(b"A different request entirely: 42")], 16)
    assert result.tokens[0] != result.tokens[1], arch
