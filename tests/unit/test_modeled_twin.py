"""A served checkpoint and its modeled twin (``--target DIR/config.json``) agree on the KV a
token keeps: the engine sizes its KV memory, blocks and transfers from the same number."""

from __future__ import annotations

import pytest

from dualpath.config import EmulationConfig, ModelConfigSpec
from dualpath.engine.common import _decoder

MLA = {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
MOE = {"moe_intermediate_size": 32, "num_experts_per_tok": 2}


def _transformers_checkpoint(tmp_path, arch: str):
    """A tiny float32 checkpoint of ``arch`` written by transformers' own model class."""
    transformers = pytest.importorskip("transformers")
    import torch

    common = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=256, eos_token_id=258,
    )  # fmt: skip
    config = {
        "qwen3": lambda: transformers.Qwen3Config(**common, num_key_value_heads=2, head_dim=24),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **common, num_key_value_heads=2, head_dim=16, num_experts=8, mlp_only_layers=[0], **MOE
        ),
        "deepseek_v2": lambda: transformers.DeepseekV2Config(
            **common, q_lora_rank=None, n_routed_experts=8, n_shared_experts=2, first_k_dense_replace=1, **MLA, **MOE
        ),
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **common, q_lora_rank=32, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, **MLA, **MOE
        ),
    }[arch]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(tmp_path / arch)
    return tmp_path / arch


def _bytes_per_token(decoder) -> int:
    """What the engine's ``SlotLayout`` holds per token over all layers (``build_engine``)."""
    return decoder.config.kv_bytes_per_token_layer(decoder.dtype) * decoder.num_layers


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3"])
def test_a_served_tiny_checkpoint_and_its_modeled_twin_keep_the_same_kv_bytes_per_token(tmp_path, tiny_model, arch):
    ckpt = tiny_model if arch == "qwen2" else _transformers_checkpoint(tmp_path, arch)
    spec = ModelConfigSpec(model=str(ckpt))
    served = _decoder(spec, EmulationConfig(), "prefill", 512)
    twin = _decoder(spec, EmulationConfig(compute="modeled", target=str(ckpt / "config.json"), scale=1.0), "prefill", 512)
    assert served.dtype.itemsize == 4  # float32 on CPU: the dtype the twin reads from config.json
    assert twin.num_layers == served.num_layers
    assert _bytes_per_token(twin) == _bytes_per_token(served) == twin.cost.kv_bytes(1)
    if arch.startswith("deepseek"):  # MLA keeps one latent and one rotary key per layer
        assert _bytes_per_token(served) == served.num_layers * (32 + 8) * 4
