"""The torch decoder, KV layout, sampling and the tiny checkpoint (``dualpath.model``)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from dualpath.model import (
    GENERATED_ALPHABET,
    Decoder,
    ModelConfig,
    ModelInputError,
    ModelLoadError,
    SamplingParams,
    Tokenizer,
    greedy_generate,
    make_tiny_model,
    pack_kv,
    sample,
    unpack_kv,
)

TEXT = (
    "The storage NICs of prefill engines saturate while those of decode engines sit idle; "
    "DualPath loads KV-cache through both, then moves it over RDMA. Agents take many turns."
)
PROMPTS = [
    "Hello there, how are you today?",
    "def main():\n    return 42\n",
    "The quick brown fox jumps over the lazy dog",
    "<|im_start|>user\nList three colours.<|im_end|>\n<|im_start|>assistant\n",
    "1 2 3 4 5 6 7 8 9 10 and then",
]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny matmuls gain nothing from threads; on a busy machine OpenMP spinning makes them ~50x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def dec(tiny):
    return Decoder.load(tiny)


@pytest.fixture(scope="module")
def tok(tiny):
    return Tokenizer.from_dir(tiny)


# --- the tiny checkpoint -------------------------------------------------------------------


def test_same_seed_writes_identical_bytes_and_another_seed_differs(tmp_path):
    a = make_tiny_model(tmp_path / "a", layers=1, hidden=32, heads=2, kv_heads=1, vocab=300, seed=7)
    b = make_tiny_model(tmp_path / "b", layers=1, hidden=32, heads=2, kv_heads=1, vocab=300, seed=7)
    c = make_tiny_model(tmp_path / "c", layers=1, hidden=32, heads=2, kv_heads=1, vocab=300, seed=8)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_config_json_carries_qwen2_fields(tiny):
    raw = json.loads((tiny / "config.json").read_text())
    assert raw["architectures"] == ["Qwen2ForCausalLM"] and raw["model_type"] == "qwen2"
    cfg = ModelConfig.from_dir(tiny)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 64, 4, 2)
    assert (cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings, cfg.attention_bias) == (16, 512, False, True)
    assert cfg.eos_token_id == 258 and cfg.torch_dtype == "float32"
    assert cfg.kv_bytes_per_token_layer(torch.bfloat16) == 2 * 2 * 16 * 2


def test_checkpoint_holds_hf_tensor_names(tiny):
    names = set(load_file(str(tiny / "model.safetensors")))
    assert {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.1.self_attn.q_proj.bias",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.0.post_attention_layernorm.weight",
    } <= names


SHAPES = [(1, 32, 2, 1, 300), (2, 64, 4, 2, 512), (4, 128, 8, 2, 1024), (3, 96, 6, 6, 2048), (8, 64, 4, 1, 512)]


@pytest.mark.parametrize(("layers", "hidden", "heads", "kv_heads", "vocab"), SHAPES)
def test_tiny_model_is_peaked_prompt_dependent_and_printable(tmp_path, layers, hidden, heads, kv_heads, vocab):
    path = make_tiny_model(tmp_path, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab)
    dec, tok = Decoder.load(path), Tokenizer.from_dir(path)
    result = greedy_generate(dec, [tok.encode(p) for p in PROMPTS], 48)
    margins = [m for per_prompt in result.margins for m in per_prompt]
    assert sum(m >= 1.0 for m in margins) >= 0.99 * len(margins)
    assert len({tuple(t) for t in result.tokens}) >= 4
    for ids in result.tokens:
        assert len(set(ids)) >= 8, tok.decode(ids)
        text = tok.decode(ids)
        assert all(c in GENERATED_ALPHABET for c in text) and len(text) == len(ids)
        assert tok.encode(text) == ids


def test_generated_answer_is_reproduced_when_the_next_turn_is_tokenized(dec, tok):
    turn1 = [{"role": "user", "content": "Name a prime."}]
    prompt = tok.encode(tok.render_chat(turn1))
    answer = greedy_generate(dec, [prompt], 32).tokens[0]
    turn2 = [*turn1, {"role": "assistant", "content": tok.decode(answer)}, {"role": "user", "content": "Another."}]
    ids = tok.encode(tok.render_chat(turn2))
    assert ids[: len(prompt) + len(answer) + 1] == [*prompt, *answer, tok.token_to_id("<|im_end|>")]


def test_tied_embedding_variant_loads_and_runs(tmp_path):
    path = make_tiny_model(tmp_path, tie_embeddings=True)
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    logits, k, v = Decoder.load(path).forward_full([1, 2, 3])
    assert logits.shape == (3, 512) and torch.isfinite(logits).all()


def test_bfloat16_checkpoint_loads_as_float32_on_cpu_or_as_requested(tmp_path):
    path = make_tiny_model(tmp_path, torch_dtype="bfloat16")
    assert load_file(str(path / "model.safetensors"))["model.norm.weight"].dtype == torch.bfloat16
    assert Decoder.load(path).dtype == torch.float32
    half = Decoder.load(path, dtype=torch.bfloat16)
    _, k, _ = half.forward_full([5, 6])
    assert half.dtype == k.dtype == torch.bfloat16


# --- layer-wise forward over external KV ------------------------------------------------------


def _forward_with_past(dec, ids, past_len, full_k, full_v):
    """Compute tokens ``ids[past_len:]`` layer by layer with the prefix KV supplied from outside.

    The prefix KV goes through the storage layout: a [layers, P, 2, kvh, hd] block, then
    non-contiguous ``unpack_kv`` views per layer.
    """
    block = torch.stack([pack_kv(full_k[i, :past_len], full_v[i, :past_len]) for i in range(dec.num_layers)])
    hidden = dec.embed(torch.tensor(ids[past_len:]))
    positions = torch.arange(past_len, len(ids))
    ks, vs = [], []
    for layer in range(dec.num_layers):
        past = unpack_kv(block[layer]) if past_len else None
        hidden, k, v = dec.forward_layer(layer, hidden, positions, [(0, len(ids) - past_len)], [past])
        ks.append(k)
        vs.append(v)
    return dec.logits(hidden), torch.stack(ks), torch.stack(vs)


@pytest.mark.parametrize("past_len", [0, 1, 37, 64, 128, 150])
def test_forward_with_external_prefix_kv_equals_full_recompute(dec, tok, past_len):
    ids = tok.encode(TEXT)[:170]
    logits, k, v = dec.forward_full(ids)
    part_logits, part_k, part_v = _forward_with_past(dec, ids, past_len, k, v)
    torch.testing.assert_close(part_k, k[:, past_len:], rtol=0, atol=1e-4)
    torch.testing.assert_close(part_v, v[:, past_len:], rtol=0, atol=1e-4)
    # Logits are ~1e4 in size by design (peaked model): compare relative to that scale.
    scale = logits.abs().max().item()
    torch.testing.assert_close(part_logits, logits[past_len:], rtol=0, atol=1e-6 * scale)
    assert torch.equal(part_logits.argmax(-1), logits[past_len:].argmax(-1))


def test_one_batched_call_with_different_past_lengths_equals_each_sequence_alone(dec, tok):
    seqs = [tok.encode(TEXT)[:90], tok.encode(PROMPTS[0]), tok.encode(PROMPTS[1]) + tok.encode(TEXT)[:80]]
    past_lens = [64, 0, 100]
    full = [dec.forward_full(s) for s in seqs]
    new = [s[p:] for s, p in zip(seqs, past_lens)]
    starts = [sum(len(n) for n in new[:i]) for i in range(len(new))]
    hidden = dec.embed(torch.tensor([t for n in new for t in n]))
    positions = torch.cat([torch.arange(p, len(s)) for s, p in zip(seqs, past_lens)])
    segments = [(st, len(n)) for st, n in zip(starts, new)]
    for layer in range(dec.num_layers):
        past = [(f[1][layer, :p], f[2][layer, :p]) if p else None for f, p in zip(full, past_lens)]
        hidden, k, v = dec.forward_layer(layer, hidden, positions, segments, past)
        for (start, n), f, p in zip(segments, full, past_lens):
            torch.testing.assert_close(k[start : start + n], f[1][layer, p:], rtol=0, atol=1e-4)
            torch.testing.assert_close(v[start : start + n], f[2][layer, p:], rtol=0, atol=1e-4)
    logits = dec.logits(hidden)
    for (start, n), f, p in zip(segments, full, past_lens):
        assert torch.equal(logits[start : start + n].argmax(-1), f[0][p:].argmax(-1))


def test_cached_greedy_decoding_matches_greedy_by_full_recompute(dec, tok):
    prompts = [tok.encode(PROMPTS[0]), tok.encode(TEXT)[:70]]
    cached = greedy_generate(dec, prompts, 24).tokens
    for prompt, got in zip(prompts, cached):
        ids = list(prompt)
        for _ in range(24):
            ids.append(int(dec.forward_full(ids)[0][-1].argmax()))
        assert ids[len(prompt) :] == got


def test_pack_and_unpack_keep_k_then_v_per_token():
    k, v = torch.randn(5, 2, 4), torch.randn(5, 2, 4)
    kv = pack_kv(k, v)
    assert kv.shape == (5, 2, 2, 4) and kv.is_contiguous()
    assert torch.equal(kv[3, 0], k[3]) and torch.equal(kv[3, 1], v[3])
    k2, v2 = unpack_kv(kv)
    assert torch.equal(k2, k) and torch.equal(v2, v) and not k2.is_contiguous()
    with pytest.raises(ModelInputError):
        pack_kv(k, v[:4])


def test_forward_layer_rejects_inputs_that_do_not_fit(dec):
    hidden = dec.embed(torch.tensor([1, 2, 3]))
    pos = torch.arange(3)
    good_past = (torch.zeros(2, dec.kv_heads, dec.head_dim), torch.zeros(2, dec.kv_heads, dec.head_dim))
    bad_calls = [
        (dec.num_layers, hidden, pos, [(0, 3)], [None]),  # layer out of range
        (0, hidden, pos, [(0, 2)], [None]),  # segments do not cover N
        (0, hidden, pos, [(0, 2), (1, 2)], [None, None]),  # overlapping segments
        (0, hidden, pos, [(0, 3)], [None, None]),  # past count differs
        (0, hidden, pos[:2], [(0, 3)], [None]),  # positions length
        (0, hidden, pos, [(0, 3)], [(good_past[0][:, :1], good_past[1][:, :1])]),  # wrong kv heads
        (0, hidden.double(), pos, [(0, 3)], [None]),  # wrong dtype
    ]
    for args in bad_calls:
        with pytest.raises(ModelInputError):
            dec.forward_layer(*args)
    with pytest.raises(ModelInputError):
        dec.embed(torch.tensor([0, dec.config.vocab_size]))
    out, _, _ = dec.forward_layer(0, hidden, pos, [(0, 3)], [good_past])
    assert out.shape == hidden.shape


# --- loading arbitrary HF-layout checkpoints ---------------------------------------------------


def _random_checkpoint(path, *, model_type, tie, bias, shards, head_dim=16, seed=0):
    """A fully random checkpoint (every weight matters) written by hand, HF layout."""
    g = torch.Generator().manual_seed(seed)
    hidden, heads, kv_heads, inter, layers, vocab = 48, 4, 2, 96, 2, 300
    cfg = {
        "architectures": ["LlamaForCausalLM" if model_type == "llama" else "Qwen2ForCausalLM"],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": tie,
        "attention_bias": bias,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": [2, 3],
        "hidden_act": "silu",
    }

    def rnd(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    t = {"model.embed_tokens.weight": rnd(vocab, hidden, std=1.0), "model.norm.weight": 1 + rnd(hidden, std=0.1)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, out_dim in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
            t[f"{p}self_attn.{name}_proj.weight"] = rnd(out_dim, hidden)
            if bias:
                t[f"{p}self_attn.{name}_proj.bias"] = rnd(out_dim)
        t[p + "self_attn.o_proj.weight"] = rnd(hidden, heads * head_dim)
        t[p + "mlp.gate_proj.weight"] = rnd(inter, hidden)
        t[p + "mlp.up_proj.weight"] = rnd(inter, hidden)
        t[p + "mlp.down_proj.weight"] = rnd(hidden, inter)
        t[p + "input_layernorm.weight"] = 1 + rnd(hidden, std=0.1)
        t[p + "post_attention_layernorm.weight"] = 1 + rnd(hidden, std=0.1)
    if not tie:
        t["lm_head.weight"] = rnd(vocab, hidden)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    names = sorted(t)
    if shards == 1:
        save_file(t, str(path / "model.safetensors"))
    else:
        files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        weight_map = {n: files[j % shards] for j, n in enumerate(names)}
        for f in files:
            save_file({n: t[n] for n in names if weight_map[n] == f}, str(path / f))
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return cfg, t


def _reference_logits(cfg, t, ids):
    """Transformers' Llama/Qwen2 forward written out plainly in float64, one head at a time."""
    w = {k: x.double() for k, x in t.items()}
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def norm(x, weight):
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"])

    def rope(x):  # x [T, heads, hd], pairs (i, i + hd/2)
        out = x.clone()
        for p in range(x.shape[0]):
            for i in range(hd // 2):
                angle = p * cfg["rope_theta"] ** (-2 * i / hd)
                a, b = x[p, :, i], x[p, :, i + hd // 2]
                out[p, :, i], out[p, :, i + hd // 2] = a * math.cos(angle) - b * math.sin(angle), b * math.cos(angle) + a * math.sin(angle)
        return out

    n = len(ids)
    x = w["model.embed_tokens.weight"][ids]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        proj = {}
        for name in "qkv":
            proj[name] = h @ w[f"{p}self_attn.{name}_proj.weight"].T + w.get(f"{p}self_attn.{name}_proj.bias", 0)
        q, k = rope(proj["q"].view(n, nh, hd)), rope(proj["k"].view(n, nkv, hd))
        v = proj["v"].view(n, nkv, hd)
        heads = []
        for head in range(nh):
            g = head // (nh // nkv)
            scores = (q[:, head] @ k[:, g].T / math.sqrt(hd)).masked_fill(~causal, float("-inf"))
            heads.append(torch.softmax(scores, -1) @ v[:, g])
        x = x + torch.cat(heads, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        act = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
        x = x + act @ w[p + "mlp.down_proj.weight"].T
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return norm(x, w["model.norm.weight"]) @ head.T


@pytest.mark.parametrize(
    ("model_type", "tie", "bias", "shards"),
    [("llama", True, False, 1), ("llama", False, False, 3), ("qwen2", False, True, 2)],
)
def test_hand_written_checkpoint_loads_and_matches_a_plain_reference(tmp_path, model_type, tie, bias, shards):
    cfg, tensors = _random_checkpoint(tmp_path, model_type=model_type, tie=tie, bias=bias, shards=shards)
    dec = Decoder.load(tmp_path)
    assert dec.config.attention_bias is bias and dec.config.eos_token_id == [2, 3]
    assert dec.dtype == torch.float32  # CPU default, whatever config.json says
    ids = [5, 17, 250, 3, 99, 42, 42, 7, 128, 64, 1, 0, 299]
    logits, k, _ = dec.forward_full(ids)
    assert k.shape == (2, len(ids), 2, 16)
    torch.testing.assert_close(logits.double(), _reference_logits(cfg, tensors, ids), rtol=0, atol=1e-4)


def test_llama_config_without_bias_field_defaults_to_no_bias_and_qwen2_to_bias(tmp_path):
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    assert ModelConfig.from_dict({**base, "model_type": "llama"}).attention_bias is False
    qwen = ModelConfig.from_dict({**base, "model_type": "qwen2"})
    assert qwen.attention_bias is True and qwen.num_key_value_heads == 2 and qwen.head_dim == 4


def test_missing_weight_file_raises_load_error_naming_it(tmp_path):
    path = make_tiny_model(tmp_path, layers=1, hidden=32, heads=2, kv_heads=1, vocab=300)
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        Decoder.load(path)


def test_shard_missing_from_index_raises_load_error_naming_the_shard(tmp_path):
    _random_checkpoint(tmp_path, model_type="llama", tie=False, bias=False, shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002"):
        Decoder.load(tmp_path)


def test_missing_or_misshapen_tensor_raises_load_error_naming_it(tmp_path):
    path = make_tiny_model(tmp_path, layers=1, hidden=32, heads=2, kv_heads=1, vocab=300)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.0.mlp.up_proj.weight"):
        Decoder.load(path)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="shape"):
        Decoder.load(path)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size", "model_type"])
def test_missing_config_field_raises_load_error_naming_the_field(tmp_path, field):
    path = make_tiny_model(tmp_path, layers=1, hidden=32, heads=2, kv_heads=1, vocab=300)
    raw = json.loads((path / "config.json").read_text())
    del raw[field]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=field):
        Decoder.load(path)


def test_missing_or_unsupported_config_raises_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="model_type"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="JSON object"):
        ModelConfig.from_dir(tmp_path)


# --- sampling ----------------------------------------------------------------------------------


def test_greedy_takes_argmax_with_ties_to_the_lowest_id_and_reports_raw_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, -1.0, 2.0, 0.0]])
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)] * 2, [None, None])
    assert [o.token_id for o in out] == [1, 0]
    expected = torch.log_softmax(logits, -1)
    assert out[0].logprob == pytest.approx(expected[0, 1].item())
    assert [i for i, _ in out[0].top_logprobs] == [1, 3, 2]
    values = [lp for _, lp in out[1].top_logprobs]
    assert values == sorted(values, reverse=True) and values[0] == pytest.approx(expected[1, 0].item())


def test_top_logprobs_list_as_many_entries_as_requested():
    logits = torch.randn(2, 10)
    out = sample(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_logprobs=5)], [None] * 2)
    assert out[0].top_logprobs == () and len(out[1].top_logprobs) == 5


def test_seeded_sampling_is_reproducible_and_logprobs_ignore_temperature():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))

    def draws(seed, temperature=1.5):
        g = torch.Generator().manual_seed(seed)
        params = [SamplingParams(temperature=temperature, top_p=0.95, top_k=40)]
        return [sample(logits, params, [g])[0] for _ in range(30)]

    first, again, other = draws(1), draws(1), draws(2)
    assert [t.token_id for t in first] == [t.token_id for t in again]
    assert [t.token_id for t in first] != [t.token_id for t in other]
    assert len({t.token_id for t in first}) > 1
    raw = torch.log_softmax(logits[0], -1)
    assert all(t.logprob == pytest.approx(raw[t.token_id].item()) for t in first)


def test_top_k_one_and_tiny_top_p_reduce_sampling_to_greedy():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(0)
    for params in (SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6)):
        out = sample(logits, [params] * 4, [g] * 4)
        assert [o.token_id for o in out] == logits.argmax(-1).tolist()


def test_suppress_eos_masks_eos_ids_only_for_flagged_rows():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]] * 2)
    params = [SamplingParams(temperature=0.0)] * 2
    out = sample(logits, params, [None, None], suppress_eos=[True, False], eos_ids=frozenset({1}))
    assert [o.token_id for o in out] == [2, 1]


@pytest.mark.parametrize(
    "bad",
    [dict(temperature=-0.1), dict(top_p=0.0), dict(top_k=-1), dict(max_tokens=0), dict(min_tokens=5, max_tokens=4), dict(top_logprobs=21)],
)
def test_sampling_params_reject_out_of_range_values(bad):
    with pytest.raises(ModelInputError):
        SamplingParams(**bad)
