"""Index capacity: blocks evicted from the kv-persistence index have their files deleted, so
storage stays bounded by ``--capacity-blocks``; conversations keep working meanwhile."""

from __future__ import annotations

import pytest
from conftest import openai_client, start_stack

pytestmark = pytest.mark.slow

CAPACITY = 6


def test_evicted_blocks_files_are_deleted_and_storage_stays_within_capacity(tiny_model, tmp_path):
    storage = tmp_path / "storage"
    s = start_stack(tiny_model, storage, tmp_path / "run", extra_env={"DUALPATH_CAPACITY_BLOCKS": str(CAPACITY)})
    try:
        client = openai_client(s.url)
        name = tiny_model.resolve().name
        messages, cached = [], []
        for turn in range(5):  # ~5 x 300 tokens: well over CAPACITY blocks of 64 tokens
            messages.append({"role": "user", "content": f"Turn {turn}: " + "here is a long tool output line. " * 8})
            r = client.chat.completions.create(model=name, messages=messages, max_tokens=24, temperature=0)
            assert r.choices[0].finish_reason == "length"
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
    finally:
        s.stop()
    files = list(storage.rglob("*.kvb"))
    assert 0 < len(files) <= CAPACITY, len(files)
    assert sum(cached) > 0  # the index still served hits while evicting
