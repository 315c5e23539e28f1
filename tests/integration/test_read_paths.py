"""The DE read path against the PE read path and a full recompute, for several model shapes.

For each shape, the same multi-turn conversation runs on a stack forced to the PE read path
and on one forced to the DE read path (each with fresh storage, so both read exactly the
same stored bytes): tokens and logprobs must be bitwise equal. Both must give the tokens of a
full recompute by the reference forward (no cache), logprobs within 1e-3.
"""

from __future__ import annotations

import pytest
import torch
from conftest import converse, start_stack

from dualpath.model import Decoder, Tokenizer, make_tiny_model

pytestmark = pytest.mark.slow

TURNS = [
    "Read the failing test and tell me what it checks, in detail please. " * 2,
    "Tool result: AssertionError in test_read_side, expected DE got PE. Why?",
    "Tool result: after the fix 12 passed. Write the commit message.",
]
MAX_TOKENS = 24


def reference(model_dir, turns: list[dict]) -> list[tuple[str, list[float]]]:
    """Greedy decoding by full recompute (no KV reuse at all), turn by turn."""
    dec, tok = Decoder.load(model_dir), Tokenizer.from_dir(model_dir)
    messages, out = [{"role": "system", "content": "You are an agent."}], []
    for text, served in zip(TURNS, turns):
        messages.append({"role": "user", "content": text})
        ids = tok.encode(tok.render_chat(messages))
        gen, lps = [], []
        for _ in range(MAX_TOKENS):
            logits, _, _ = dec.forward_full(ids + gen)
            logp = torch.log_softmax(logits[-1].float(), -1)
            nxt = int(torch.argmax(logits[-1]))
            gen.append(nxt)
            lps.append(float(logp[nxt]))
            if nxt in tok.eos_token_ids:
                break
        out.append((tok.decode(gen), lps))
        messages.append({"role": "assistant", "content": served["text"]})
    return out


@pytest.mark.parametrize(
    "layers,hidden,heads,kv_heads", [(1, 32, 2, 1), (3, 96, 6, 2), (8, 64, 4, 4)], ids=["1layer-gqa2", "3layers-gqa3", "8layers-mha"]
)
def test_pe_and_de_read_paths_are_bitwise_equal_and_match_a_full_recompute(tmp_path, layers, hidden, heads, kv_heads):
    model_dir = make_tiny_model(tmp_path / "model", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=400, seed=layers)
    name = model_dir.resolve().name
    runs = {}
    for path in ("pe", "de"):
        s = start_stack(model_dir, tmp_path / path / "storage", tmp_path / path / "run")
        try:
            runs[path] = converse(s.url, name, TURNS, max_tokens=MAX_TOKENS, read_path=path)
        finally:
            s.stop()
    pe, de = runs["pe"], runs["de"]
    assert [t["path"] for t in pe[1:]] == ["pe"] * 2 and [t["path"] for t in de[1:]] == ["de"] * 2
    assert all(t["cached"] > 0 for t in pe[1:]) and [t["cached"] for t in pe] == [t["cached"] for t in de]
    for a, b in zip(pe, de):
        assert a["text"] == b["text"]
        assert a["logprobs"] == b["logprobs"]  # same stored bytes, same computation: bitwise
    for served, (text, lps) in zip(pe, reference(model_dir, pe)):
        assert served["text"] == text
        assert max(abs(x - y) for x, y in zip(served["logprobs"], lps)) < 1e-3
