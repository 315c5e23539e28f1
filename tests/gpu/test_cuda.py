"""The torch engine on a CUDA device: the decoder against the CPU, layer-wise forward with
KV from outside, and a whole stack (``--device cuda``) on both read paths.

Skipped where no CUDA device is visible (CI, laptops); run on a GPU host with
``pytest tests/gpu``.
"""

from __future__ import annotations

import time

import pytest
import torch

from dualpath.model import Decoder, Tokenizer, greedy_generate, make_tiny_model, pack_kv, unpack_kv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")]

TEXT = (
    "The storage NICs of prefill engines saturate while those of decode engines sit idle; "
    "DualPath loads KV-cache through both, then moves it over RDMA. Agents take many turns. "
) * 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gpu") / "tiny", layers=4, hidden=128, heads=8, kv_heads=2, vocab=512, seed=3)


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_dir(model_dir)


def test_cuda_decoder_matches_the_cpu_decoder(model_dir, tok):
    ids = tok.encode(TEXT)[:300]
    cpu, gpu = Decoder.load(model_dir), Decoder.load(model_dir, device="cuda")
    assert gpu.device.type == "cuda" and gpu.dtype == torch.float32  # the checkpoint's dtype
    lc, kc, vc = cpu.forward_full(ids)
    lg, kg, vg = gpu.forward_full(ids)
    assert lg.device.type == "cuda"
    scale = lc.abs().max().item()
    torch.testing.assert_close(lg.cpu(), lc, rtol=0, atol=1e-4 * scale)
    torch.testing.assert_close(kg.cpu(), kc, rtol=0, atol=1e-3)
    torch.testing.assert_close(vg.cpu(), vc, rtol=0, atol=1e-3)
    assert torch.equal(lg.argmax(-1).cpu(), lc.argmax(-1))
    prompts = [tok.encode(TEXT)[:50], tok.encode("def main():\n    return 42\n")]
    assert greedy_generate(gpu, prompts, 32).tokens == greedy_generate(cpu, prompts, 32).tokens


@pytest.mark.parametrize("past_len", [1, 64, 200])
def test_cuda_layerwise_forward_with_past_kv_from_host_memory_equals_full_recompute(model_dir, tok, past_len):
    """The engine's path: past KV lands in host memory (a transfer window), is moved to the
    device per layer, and only the new tokens are computed."""
    ids = tok.encode(TEXT)[:260]
    dec = Decoder.load(model_dir, device="cuda")
    logits, k, v = dec.forward_full(ids)
    host_k, host_v = k.cpu().pin_memory(), v.cpu().pin_memory()
    hidden = dec.embed(torch.tensor(ids[past_len:], device="cuda"))
    positions = torch.arange(past_len, len(ids), device="cuda")
    for layer in range(dec.num_layers):
        past = (host_k[layer, :past_len].to("cuda", non_blocking=True), host_v[layer, :past_len].to("cuda", non_blocking=True))
        hidden, nk, nv = dec.forward_layer(layer, hidden, positions, [(0, len(ids) - past_len)], [past])
        torch.testing.assert_close(nk, k[layer, past_len:], rtol=0, atol=1e-3)
        torch.testing.assert_close(nv, v[layer, past_len:], rtol=0, atol=1e-3)
    part = dec.logits(hidden)
    assert torch.equal(part.argmax(-1), logits[past_len:].argmax(-1))


def test_packed_kv_round_trips_on_cuda(model_dir, tok):
    dec = Decoder.load(model_dir, device="cuda")
    _, k, v = dec.forward_full(tok.encode(TEXT)[:64])
    packed = pack_kv(k[0], v[0])  # [T, 2, kvh, hd]: a Layer Block's layout
    assert packed.device.type == "cuda" and packed.is_contiguous()
    uk, uv = unpack_kv(packed)
    assert torch.equal(uk, k[0]) and torch.equal(uv, v[0])


def test_prefill_throughput_on_a_larger_random_model_is_reported(tmp_path):
    """Not a timed assertion: prints tokens/s of a 16-layer, hidden-1024 model on this GPU, and
    checks the layer-wise path still equals a full recompute at that size."""
    model_dir = make_tiny_model(tmp_path / "big", layers=16, hidden=1024, heads=16, kv_heads=4, vocab=4096, seed=1)
    dec = Decoder.load(model_dir, device="cuda", dtype=torch.bfloat16)
    ids = [300 + (i * 37) % 3700 for i in range(4096)]
    dec.forward_full(ids[:256])  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits, k, v = dec.forward_full(ids)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print(f"\nprefill 4096 tokens, 16 layers x hidden 1024, bf16: {dt * 1e3:.1f} ms, {len(ids) / dt:,.0f} tokens/s")
    past_len = 4000
    hidden = dec.embed(torch.tensor(ids[past_len:], device="cuda"))
    positions = torch.arange(past_len, len(ids), device="cuda")
    for layer in range(dec.num_layers):
        hidden, _, _ = dec.forward_layer(layer, hidden, positions, [(0, len(ids) - past_len)], [(k[layer, :past_len], v[layer, :past_len])])
    agree = (dec.logits(hidden).float().argmax(-1) == logits[past_len:].float().argmax(-1)).float().mean().item()
    assert agree >= 0.95, agree


@pytest.mark.slow
def test_a_cuda_stack_serves_both_read_paths_bitwise_equal_and_matching_the_cpu_reference(model_dir, tmp_path):
    from conftest import openai_client, start_stack

    turns = [
        "Read the failing test and tell me what it checks, in detail please. " * 3,
        "Tool result: AssertionError in test_read_side, expected DE got PE. Why?",
        "Tool result: after the fix 12 passed. Write the commit message.",
    ]
    name = model_dir.resolve().name
    runs = {}
    for path in ("pe", "de"):
        s = start_stack(model_dir, tmp_path / path / "storage", tmp_path / path / "run", device="cuda")
        try:
            client = openai_client(s.url)
            messages, out = [{"role": "system", "content": "You are an agent."}], []
            for text in turns:
                messages.append({"role": "user", "content": text})
                r = client.chat.completions.create(
                    model=name, messages=messages, max_tokens=32, temperature=0, logprobs=True, extra_body={"dualpath_read_path": path}
                )
                c = r.choices[0]
                out.append(
                    (
                        c.message.content,
                        [t.logprob for t in c.logprobs.content],
                        r.usage.prompt_tokens_details.cached_tokens,
                        r.model_extra["dualpath"]["read_path"],
                    )
                )
                messages.append({"role": "assistant", "content": c.message.content})
            runs[path] = out
        finally:
            s.stop()
    pe, de = runs["pe"], runs["de"]
    assert [t[3] for t in pe[1:]] == ["pe", "pe"] and [t[3] for t in de[1:]] == ["de", "de"]
    assert all(t[2] > 0 for t in pe[1:]) and [t[2] for t in pe] == [t[2] for t in de]
    assert [t[0] for t in pe] == [t[0] for t in de] and [t[1] for t in pe] == [t[1] for t in de]
    # The same conversation by full recompute on the CPU: same answers.
    cpu, tok = Decoder.load(model_dir), Tokenizer.from_dir(model_dir)
    messages = [{"role": "system", "content": "You are an agent."}]
    for text, served in zip(turns, pe):
        messages.append({"role": "user", "content": text})
        ids = tok.encode(tok.render_chat(messages))
        gen = []
        for _ in range(32):
            nxt = int(cpu.forward_full(ids + gen)[0][-1].argmax())
            gen.append(nxt)
            if nxt in tok.eos_token_ids:
                break
        assert tok.decode(gen) == served[0]
        messages.append({"role": "assistant", "content": served[0]})


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2", "qwen3", "qwen3_moe", "llama"])
def test_cuda_decoder_of_every_family_matches_the_cpu_and_decodes_from_its_own_memory(tmp_path, arch):
    """Each family on the GPU: the same logits as on the CPU (float32), and cached decoding
    in the decode engine's memory (MLA: latent + rotary key, absorbed attention) gives the
    tokens of a full recompute."""
    from conftest import decode_from_memory

    path = make_tiny_model(tmp_path / arch, arch=arch, layers=3, hidden=128, heads=8, kv_heads=2, seed=4)
    ids = list(TEXT.encode())[:200]
    cpu, gpu = Decoder.load(path), Decoder.load(path, device="cuda")
    lc, _, _ = cpu.forward_full(ids)
    lg, _, _ = gpu.forward_full(ids)
    torch.testing.assert_close(lg.cpu(), lc, rtol=0, atol=1e-4 * lc.abs().max().item())
    assert decode_from_memory(gpu, ids, 16) == greedy_generate(cpu, [ids], 16).tokens[0]
