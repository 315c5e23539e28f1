"""Split reads are exact: a request whose hit blocks are read partly by the PE's and partly by
the DE's storage NIC gives bitwise the tokens and logprobs of the PE and the DE read paths.

The same conversation runs on three stacks with fresh storage each (so all three read the same
stored bytes): forced PE read path, forced DE read path, and ``--read-policy split``, whose
later turns must really be split (``read_split`` in the response's ``dualpath`` record has
blocks on both sides).
"""

from __future__ import annotations

import pytest
from conftest import converse, start_stack

from dualpath.model import make_tiny_model

pytestmark = pytest.mark.slow

TURNS = [
    "Read the failing test and tell me what it checks, in detail please. " * 6,
    "Tool result: AssertionError in test_read_side, expected DE got PE. Why?",
    "Tool result: after the fix 12 passed. Write the commit message.",
]
MAX_TOKENS = 16


def test_split_reads_give_the_tokens_and_logprobs_of_either_read_path(tmp_path):
    model_dir = make_tiny_model(tmp_path / "model", layers=3, hidden=96, heads=6, kv_heads=2, vocab=400, seed=3)
    name = model_dir.resolve().name
    runs = {}
    for label, stack_path, request_path in (("pe", "auto", "pe"), ("de", "auto", "de"), ("split", "split", "auto")):
        s = start_stack(model_dir, tmp_path / label / "storage", tmp_path / label / "run", read_path=stack_path)
        try:
            runs[label] = converse(s.url, name, TURNS, max_tokens=MAX_TOKENS, read_path=request_path)
        finally:
            s.stop()
    pe, de, split = runs["pe"], runs["de"], runs["split"]
    assert all(t["cached"] >= 2 * 64 for t in split[1:]), [t["cached"] for t in split]
    assert all(t["split"][0] > 0 and t["split"][1] > 0 for t in split[1:]), [t["split"] for t in split]
    assert all(sum(t["split"]) * 64 == t["cached"] for t in split[1:])
    assert [t["split"][1] for t in pe[1:]] == [0, 0] and [t["split"][0] for t in de[1:]] == [0, 0]
    for a, b, c in zip(pe, de, split):
        assert a["text"] == b["text"] == c["text"]
        assert a["logprobs"] == b["logprobs"] == c["logprobs"]  # same stored bytes, same computation: bitwise
