"""Every supported family served exactly: checkpoints written by transformers' own classes.

For each family a tiny random model is built by transformers (``AutoModelForCausalLM``),
saved with ``save_pretrained`` in several safetensors shards and served by a real stack.
Two two-turn conversations run on it, one forced to the PE read path and one to the DE
read path; each second turn's prefix comes from storage (``cached_tokens > 0``). Every
turn's greedy tokens must equal transformers' greedy tokens on the same prompt, and the
logprobs agree within 2e-3 (float32 on CPU).
"""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch
from conftest import start_stack

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

STEPS = 8
MLA = {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
MOE = {"moe_intermediate_size": 32, "num_experts_per_tok": 2}


def _config(family: str):
    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        initializer_range=0.2,
        bos_token_id=256,
        eos_token_id=258,
    )
    if family == "qwen2":
        return transformers.Qwen2Config(**common, num_key_value_heads=2)
    if family == "llama":  # Llama 3's RoPE scaling
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128, "rope_theta": 500000.0}  # fmt: skip
        return transformers.LlamaConfig(**common, num_key_value_heads=1, rope_parameters=rope)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, num_key_value_heads=2, head_dim=24)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, num_key_value_heads=2, head_dim=16, num_experts=8, norm_topk_prob=True, mlp_only_layers=[0], **MOE
        )
    if family == "deepseek_v2":  # V2-Lite's shape: no q_lora_rank, softmax routing
        return transformers.DeepseekV2Config(
            **common, q_lora_rank=None, n_routed_experts=8, n_shared_experts=2, first_k_dense_replace=1,
            topk_method="group_limited_greedy", n_group=4, topk_group=2, **MLA, **MOE,
        )  # fmt: skip
    # V3's shape: q_lora_rank, sigmoid routing with a correction bias, YaRN RoPE with mscale
    rope = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "rope_theta": 10000.0,
    }
    return transformers.DeepseekV3Config(
        **common, q_lora_rank=32, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, rope_parameters=rope, **MLA, **MOE,
    )  # fmt: skip


def _greedy(model, prompt: list[int], eos_ids) -> list[tuple[int, float]]:
    """transformers' greedy tokens and raw logprobs; EOS cannot be chosen (``ignore_eos``)."""
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(STEPS):
            lp = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
            token = int(lp.index_fill(0, torch.tensor(sorted(eos_ids)), float("-inf")).argmax())
            out.append((token, float(lp[token])))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2", "qwen3", "qwen3_moe", "qwen2", "llama"])
def test_family_written_by_transformers_is_served_exactly_on_both_read_paths(tiny_model, tmp_path, family):
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(_config(family)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peaked outputs: greedy choices far from ties
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.normal_(0.0, 0.1)  # the bias changes which experts are chosen
    ckpt = tmp_path / f"hf-{family}"
    model.save_pretrained(ckpt, max_shard_size="200KB")
    assert len(list(ckpt.glob("model-*.safetensors"))) > 1
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, ckpt / name)

    from dualpath.model import Tokenizer

    tok = Tokenizer.from_dir(ckpt)
    s = start_stack(ckpt, tmp_path / "storage", tmp_path / "run")
    rows = []
    try:
        described = httpx.get(s.url + "/v1/models", timeout=30).json()["data"][0]["dualpath"]
        for path, text in (
            ("pe", b"Agents call tools, then read the results. " * 4),
            ("de", b"A second agent edits files and runs tests. " * 4),
        ):
            prompt = list(text)
            for turn in (1, 2):
                r = httpx.post(
                    s.url + "/v1/completions",
                    timeout=120,
                    json={"model": ckpt.name, "prompt": prompt, "max_tokens": STEPS, "temperature": 0, "logprobs": 1,
                          "ignore_eos": True, "dualpath_read_path": path},
                )  # fmt: skip
                assert r.status_code == 200, r.text
                body = r.json()
                got = body["choices"][0]["logprobs"]
                expected = _greedy(model, prompt, tok.eos_token_ids)
                rows.append(
                    (path, turn, body["usage"]["prompt_tokens_details"]["cached_tokens"], body["dualpath"]["read_path"], got, expected)
                )
                prompt = prompt + [t for t, _ in expected] + list(b" Tool result: ok, next step please.")
    finally:
        s.stop()
    # What storage holds per token: MLA's latent + rotary key, or per-head K and V; the header says which.
    from dualpath.kv.block import HEADER_BYTES, KV_LAYOUTS, MAGIC, decode_header
    from dualpath.model import ModelConfig

    cfg = ModelConfig.from_dir(ckpt)
    files = [f for f in (tmp_path / "storage").rglob("*") if f.is_file() and f.read_bytes()[:4] == MAGIC]
    assert files
    header = decode_header(files[0].read_bytes()[:HEADER_BYTES])
    width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim if cfg.mla else 2 * cfg.num_key_value_heads * cfg.head_dim
    assert (header.bytes_per_token_layer, header.kv_layout) == (4 * width, KV_LAYOUTS[cfg.kv_spec.kind])
    assert described["kv_bytes_per_token"] == header.bytes_per_token_layer * header.layers  # what /v1/models reports
    assert (described["model_type"], described["kv_layout"], described["dtype"]) == (family, cfg.kv_spec.kind, "float32")
    print(f"{family:12s} storage holds {header.bytes_per_token_layer * header.layers} bytes per token ({cfg.kv_spec.kind})")
    for path, turn, cached, read_path, got, expected in rows:
        same = got["tokens"] == [tok.decode([t]) for t, _ in expected]
        worst = max(abs(a - b) for a, (_, b) in zip(got["token_logprobs"], expected))
        print(f"{family:12s} {path} turn {turn}: cached {cached:4d} tokens equal {same} max |dlogprob| {worst:.2e}")
        assert same, (path, turn)
        assert worst < 2e-3, (path, turn)
        if turn == 2:
            assert cached >= 128 and read_path == path, (path, cached, read_path)
