"""Agent-aware prefetch is exact and is used: with ``--prefetch`` the session's next turn takes
leading blocks from its prefill node's prefetch cache, and the tokens and logprobs equal those
of the same conversation without prefetch (PE and DE read paths alike read the cache)."""

from __future__ import annotations

import pytest
from conftest import converse, prefetch_counters, start_stack

from dualpath.model import make_tiny_model

pytestmark = pytest.mark.slow

TURNS = [
    "Read the failing test and tell me what it checks, in detail please. " * 6,
    "Tool result: AssertionError in test_read_side, expected DE got PE. Why?",
    "Tool result: after the fix 12 passed. Write the commit message.",
]
MAX_TOKENS = 16
TOOL_GAP_S = 1.5  # the agent "runs a tool": the prefetch has time to stage the blocks


@pytest.mark.parametrize("read_path", ["pe", "de"])
def test_prefetch_keeps_tokens_and_logprobs_and_serves_the_next_turn(tmp_path, read_path):
    model_dir = make_tiny_model(tmp_path / "model", layers=3, hidden=96, heads=6, kv_heads=2, vocab=400, seed=3)
    name = model_dir.resolve().name
    runs, counters = {}, {}
    for label, mb in (("off", 0), ("on", 16)):
        s = start_stack(model_dir, tmp_path / label / "storage", tmp_path / label / "run", prefetch_mb=mb)
        try:
            runs[label] = converse(
                s.url, name, TURNS, max_tokens=MAX_TOKENS, read_path=read_path, gap_s=TOOL_GAP_S, headers={"X-Session-ID": "agent-7"}
            )
            counters[label] = prefetch_counters(s)
        finally:
            s.stop()
    off, on = runs["off"], runs["on"]
    assert all(t["cached"] > 0 for t in on[1:]) and [t["cached"] for t in on] == [t["cached"] for t in off]
    for a, b in zip(off, on):
        assert a["text"] == b["text"]
        assert a["logprobs"] == b["logprobs"]  # same stored bytes (checksummed either way): bitwise
    assert all(not c for c in counters["off"].values())
    staged = sum(c.get("prefetch_staged_bytes", 0) for c in counters["on"].values())
    retained = sum(c.get("prefetch_retained_bytes", 0) for c in counters["on"].values())
    used = sum(c.get("prefetch_used_bytes", 0) for c in counters["on"].values())
    # the node that read a turn keeps its blocks (retained) and the next turn's load takes them there
    assert staged + retained > 0 and retained > 0 and used > 0
