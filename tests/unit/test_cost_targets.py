"""Targets of the cost model are ``config.json`` files: the named ones ship in the repository,
any supported checkpoint's own config works too, and both give what a hand computation gives."""

from __future__ import annotations

import json

import pytest

from dualpath.cost import (
    NAMED_TARGETS,
    TARGETS,
    CostModelError,
    TargetConfigError,
    UnknownTargetError,
    cost_model,
    get_target,
    load_target,
    resolve_target,
)
from dualpath.cost.targets import CONFIG_DIR

# DeepSeek-V2-Lite's published config.json (the architecture fields): MLA without
# q_lora_rank, 64 routed + 2 shared experts, top-6, one dense first layer.
V2_LITE = {
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "routed_scaling_factor": 1.0,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}

# Qwen3-30B-A3B's published config.json (the architecture fields): GQA 32/4 x 128, 128 experts, top-8.
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}


def _write(tmp_path, cfg: dict, name: str = "config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


def test_every_named_target_is_a_config_file_in_the_repository():
    assert set(TARGETS) == set(NAMED_TARGETS) == {"qwen32b", "ds660b", "ds27b", "dsv3"}
    for name, named in NAMED_TARGETS.items():
        assert (CONFIG_DIR / named.file).is_file()
        assert get_target(name).config is not None


def test_the_660b_is_deepseek_v3s_published_config_plus_the_v32_indexer():
    v3 = json.loads((CONFIG_DIR / "dsv3.json").read_text())
    v32 = json.loads((CONFIG_DIR / "ds660b.json").read_text())
    added = {"index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048}
    renamed = {"model_type", "architectures", "auto_map", "transformers_version"}
    assert {k: v for k, v in v32.items() if k not in added and k not in renamed} == {k: v for k, v in v3.items() if k not in renamed}
    assert {k: v32[k] for k in added} == added and v32["model_type"] == "deepseek_v32"
    t = get_target("ds660b")
    assert (t.layers, t.hidden, t.heads, t.q_lora_rank, t.kv_lora_rank) == (61, 7168, 128, 1536, 512)
    assert (t.routed_experts, t.experts_per_token, t.shared_intermediate, t.expert_intermediate) == (256, 8, 2048, 2048)
    assert t.moe_layer_ids == frozenset(range(3, 61)) and t.dense_layers == 3
    assert (t.sparse_topk, t.index_heads, t.index_head_dim, t.index_bytes_per_token_layer) == (2048, 64, 128, 132)
    assert (t.weight_bytes, t.kv_bytes_per_token_layer, t.default_ep) == (1, 512 + 4 * 4 + 64 * 2, 16)


def test_qwen32b_is_served_in_bf16_from_its_published_config():
    t = get_target("qwen32b")
    assert (t.layers, t.hidden, t.heads, t.kv_heads, t.head_dim, t.intermediate, t.vocab) == (64, 5120, 40, 8, 128, 27648, 152064)
    assert (t.attention, t.weight_bytes, t.kv_bytes_per_token_layer, t.routed_experts) == ("gqa", 2, 2 * 8 * 128 * 2, 0)


def test_deepseek_v2_lite_weights_flops_and_kv_match_a_hand_computation(tmp_path):
    t = get_target(str(_write(tmp_path, V2_LITE)))
    h, heads = 2048, 16
    q = h * heads * (128 + 64)  # no q_lora_rank: one q_proj
    kv_a, kv_b, o = h * (512 + 64), 512 * heads * (128 + 128), heads * 128 * h
    assert t.attn_proj_params() == q + kv_a + kv_b + o == 13_762_560
    dense, expert, shared, router = 3 * h * 10944, 3 * h * 1408, 3 * h * 2 * 1408, h * 64
    moe_layer_all = 64 * expert + shared + router
    embeddings = 2 * 102400 * h
    assert t.total_params() == 27 * 13_762_560 + dense + 26 * moe_layer_all + embeddings == 15_706_357_760
    assert t.active_params() == 27 * 13_762_560 + dense + 26 * (6 * expert + shared + router) + embeddings == 2_661_023_744
    assert t.weight_bytes_total() == 2 * 15_706_357_760  # bf16, every expert
    assert t.active_weight_bytes() == 2 * 2_661_023_744
    assert t.layer_gemm_flops_per_token(0) == 2 * (13_762_560 + dense) == 162_004_992
    assert t.layer_gemm_flops_per_token(1) == 2 * (13_762_560 + 6 * expert + shared + router) == 166_199_296
    assert t.attention_pair_flops() == 2 * heads * ((512 + 64) + 512) == 34_816  # absorbed MLA
    assert t.attention_flops_per_token(1000) == 34_816 * 1000
    assert t.lm_head_flops_per_token() == 2 * h * 102400
    assert t.kv_bytes_per_token() == 27 * (512 + 64) * 2 == 31_104  # bf16 latent + rotary key
    # a prefill of 100 new tokens on 1,000 cached: each new token i attends to 1000 + i keys
    pairs = sum(1000 + i for i in range(1, 101))
    expected = 100 * (162_004_992 + 26 * 166_199_296) + 27 * 34_816 * pairs + 2 * h * 102400
    assert cost_model(str(tmp_path / "config.json")).prefill_flops(1000, 100) == expected


def test_qwen3_moe_weights_and_kv_match_its_published_size(tmp_path):
    """Qwen3-30B-A3B: 30.5B total, 3.3B active (its model card), 2 x 4 x 128 bf16 KV per layer."""
    t = get_target(str(_write(tmp_path, QWEN3_30B_A3B)))
    attn = 2 * 2048 * 32 * 128 + 2 * 2048 * 4 * 128
    expert = 3 * 2048 * 768
    assert t.total_params() == 48 * (attn + 128 * expert + 2048 * 128) + 2 * 151936 * 2048 == 30_531_911_680
    assert t.active_params() == 48 * (attn + 8 * expert + 2048 * 128) + 2 * 151936 * 2048 == 3_352_821_760
    assert t.kv_bytes_per_token_layer == 2 * 4 * 128 * 2
    assert t.attention_pair_flops() == 2 * 32 * (2 * 128)


def test_moe_layers_come_from_the_config_not_from_a_dense_prefix(tmp_path):
    cfg = {**QWEN3_30B_A3B, "num_hidden_layers": 8, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    t = get_target(str(_write(tmp_path, cfg)))
    assert t.moe_layer_ids == frozenset({1, 5, 7})  # (i + 1) % 2 == 0, minus the dense layer 3
    model = cost_model(str(tmp_path / "config.json"))
    batch = [(0, 4)]  # a small batch reads its experts: MoE layers take longer
    times = [model.prefill_layer_time(batch, layer=i) for i in range(8)]
    assert {i for i, s in enumerate(times) if s > times[0]} == {1, 5, 7}
    assert sum(times) + model.prefill_head_time(batch) == pytest.approx(model.prefill_time(batch))


def test_tied_embeddings_count_once_for_memory_and_fully_for_the_lm_head(tmp_path):
    untied = get_target(str(_write(tmp_path, QWEN3_30B_A3B, "a.json")))
    tied = get_target(str(_write(tmp_path, {**QWEN3_30B_A3B, "tie_word_embeddings": True}, "b.json")))
    assert untied.total_params() - tied.total_params() == 151936 * 2048
    assert untied.lm_head_flops_per_token() == tied.lm_head_flops_per_token()


def test_fp8_weights_follow_the_quantization_config(tmp_path):
    bf16 = get_target(str(_write(tmp_path, V2_LITE, "a.json")))
    fp8 = get_target(str(_write(tmp_path, {**V2_LITE, "quantization_config": {"quant_method": "fp8"}}, "b.json")))
    assert (bf16.weight_bytes, fp8.weight_bytes) == (2, 1)
    assert bf16.kv_bytes_per_token_layer == fp8.kv_bytes_per_token_layer  # KV stays in the checkpoint's dtype


def test_a_path_target_is_a_config_file_or_its_directory(tmp_path):
    _write(tmp_path, V2_LITE)
    by_dir, by_file = get_target(str(tmp_path)), get_target(str(tmp_path / "config.json"))
    assert by_dir == by_file
    assert resolve_target(str(tmp_path)) == str((tmp_path / "config.json").resolve())
    assert resolve_target("ds27b") == "ds27b"
    # a later edit of the file is seen (read once per file version)
    (tmp_path / "config.json").write_text(json.dumps({**V2_LITE, "num_hidden_layers": 5}))
    import os

    os.utime(tmp_path / "config.json", ns=(1, 1))
    assert get_target(str(tmp_path)).layers == 5


def test_bad_targets_raise_errors_that_say_what_is_wrong(tmp_path):
    with pytest.raises(UnknownTargetError, match="config.json"):
        get_target("nope")
    with pytest.raises(TargetConfigError, match="model_type") as info:
        get_target(str(_write(tmp_path, {**V2_LITE, "model_type": "gpt2"}, "gpt2.json")))
    assert isinstance(info.value, CostModelError) and isinstance(info.value, LookupError)
    with pytest.raises(TargetConfigError, match="not found"):
        get_target(str(tmp_path))  # a directory without config.json
    with pytest.raises(TargetConfigError, match="index_topk"):
        load_target(_write(tmp_path, {**V2_LITE, "model_type": "deepseek_v32"}, "v32.json"))


def test_the_sim_cli_accepts_a_config_path_as_target(tmp_path, capsys):
    from dualpath.cli.sim import main

    path = _write(tmp_path, QWEN3_30B_A3B)
    assert (
        main(["offline", "--target", str(path), "--topology", "1P1D", "--agents", "4", "--turns", "2", "--json", "--progress", "never"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["target"] == str(path.resolve())
    assert main(["offline", "--target", str(tmp_path / "missing.json"), "--agents", "4"]) == 2
    assert "--target" in capsys.readouterr().err


def test_the_kv_cache_format_is_deployment_not_architecture():
    """The same published DeepSeek-V3 file: as a path target its KV is bf16 (what the torch
    engine stores, 576 values x 2 B); as the named target FlashMLA's FP8 layout (656 B)."""
    as_path = get_target(str(CONFIG_DIR / "dsv3.json"))
    assert as_path.kv_bytes_per_token_layer == (512 + 64) * 2
    assert get_target("dsv3").kv_bytes_per_token_layer == 512 + 4 * (512 // 128) + 2 * 64
    assert as_path.weight_bytes == get_target("dsv3").weight_bytes == 1  # quantization_config: fp8
    assert as_path.total_params() == get_target("dsv3").total_params()
    qwen_fp8 = load_target(CONFIG_DIR / "qwen32b.json", kv_cache_dtype="fp8")
    assert qwen_fp8.kv_bytes_per_token_layer == 2 * 8 * 128  # one byte per K and V value
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        load_target(CONFIG_DIR / "qwen32b.json", kv_cache_dtype="int4")
