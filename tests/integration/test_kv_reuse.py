"""KV-cache across turns on a real stack: hits, exactness against a full recompute, restart
persistence, and corrupt block files treated as misses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import openai_client, start_stack

from dualpath.kv import BlockStore, block_hashes, model_digest
from dualpath.model import Decoder, Tokenizer

pytestmark = pytest.mark.slow
BT = 64
USER_TURNS = [
    "Here is the repository layout and the failing test output, please look at it carefully. " * 2,
    "The tool returned: stack trace line 42 in scheduler.py, KeyError 'engine'. What next?",
    "Running the fix produced new output: 3 passed, 1 failed in test_policy. Continue please.",
    "Observation: the file now has 250 lines and the linter reports two unused imports.",
    "Final check: all tests pass. Summarise what changed in one paragraph for the commit.",
]


def run_conversation(url: str, model: str, read_path: str | None = None, turns=USER_TURNS, max_tokens: int = 40):
    """A 5-turn chat where each prompt extends the previous prompt and answer."""
    client = openai_client(url)
    messages = [{"role": "system", "content": "You are a coding agent."}]
    out = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        extra = {"dualpath_read_path": read_path} if read_path else {}
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, logprobs=True, top_logprobs=2, extra_body=extra
        )
        answer = r.choices[0].message.content
        out.append(
            {
                "answer": answer,
                "prompt_tokens": r.usage.prompt_tokens,
                "completion_tokens": r.usage.completion_tokens,
                "cached": r.usage.prompt_tokens_details.cached_tokens,
                "logprobs": [c.logprob for c in r.choices[0].logprobs.content],
                "info": r.model_extra["dualpath"],
            }
        )
        messages.append({"role": "assistant", "content": answer})
    return out


@pytest.fixture(scope="module")
def model_name(tiny_model) -> str:
    return Path(tiny_model).resolve().name


def test_every_full_block_of_the_previous_context_is_a_hit_and_tokens_match_a_full_recompute(tiny_model, tmp_path, model_name):
    storage = tmp_path / "storage"
    cached = start_stack(tiny_model, storage, tmp_path / "run")
    try:
        turns = run_conversation(cached.url, model_name)
    finally:
        cached.stop()
    assert turns[0]["cached"] == 0
    for prev, cur in zip(turns, turns[1:]):
        context = prev["prompt_tokens"] + prev["completion_tokens"]  # KV of all of it exists after the turn
        assert cur["cached"] == (context // BT) * BT, (prev, cur)
        assert cur["cached"] > 0
    # The same conversation on a fresh stack with empty storage and KV reuse off: a full recompute every turn.
    fresh = start_stack(tiny_model, tmp_path / "fresh-storage", tmp_path / "fresh-run", prefix_cache=False)
    try:
        recompute = run_conversation(fresh.url, model_name)
    finally:
        fresh.stop()
    for a, b in zip(turns, recompute):
        assert b["cached"] == 0
        assert a["answer"] == b["answer"]
        assert len(a["logprobs"]) == len(b["logprobs"]) > 0
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) < 1e-3
    # Restart on the same storage: everything committed is still a hit.
    again = start_stack(tiny_model, storage, tmp_path / "run2")
    try:
        replay = run_conversation(again.url, model_name)
    finally:
        again.stop()
    last = turns[-1]
    assert replay[0]["cached"] == (turns[0]["prompt_tokens"] - 1) // BT * BT  # turn 1's prompt was persisted before
    assert replay[-1]["cached"] >= last["cached"]
    assert [t["answer"] for t in replay] == [t["answer"] for t in turns]


def test_kv_in_storage_equals_recomputed_kv(tiny_model, tmp_path, model_name):
    """Every block file written during a conversation holds the KV a full recompute produces (float32, atol 1e-4)."""
    s = start_stack(tiny_model, tmp_path / "storage", tmp_path / "run")
    try:
        turns = run_conversation(s.url, model_name, turns=USER_TURNS[:2], max_tokens=70)
    finally:
        s.stop()
    decoder = Decoder.load(tiny_model)
    tok = Tokenizer.from_dir(tiny_model)
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": USER_TURNS[0]},
        {"role": "assistant", "content": turns[0]["answer"]},
        {"role": "user", "content": USER_TURNS[1]},
    ]
    ids = tok.encode(tok.render_chat(messages))
    _, k, v = decoder.forward_full(ids)  # [layers, T, kvh, hd]
    store = BlockStore(tmp_path / "storage")
    hashes = block_hashes(model_name, ids)
    layers, bpt = decoder.num_layers, decoder.config.kv_bytes_per_token_layer(decoder.dtype)
    checked = 0
    for b, h in enumerate(hashes):
        if not store.exists(model_digest(model_name), h):
            continue
        buf = bytearray(layers * BT * bpt)
        store.read_into(
            model_digest=model_digest(model_name),
            block_hash=h,
            layers=layers,
            tokens=BT,
            bytes_per_token_layer=bpt,
            dtype="float32",
            dest=memoryview(buf),
        )
        kv = torch.frombuffer(buf, dtype=torch.float32).view(layers, BT, 2, decoder.kv_heads, decoder.head_dim)
        torch.testing.assert_close(kv[:, :, 0], k[:, b * BT : (b + 1) * BT], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kv[:, :, 1], v[:, b * BT : (b + 1) * BT], atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked == len(hashes) >= 2
