"""``kv.hits``: the one place that says how many hit blocks a prefill reads and how many tokens it computes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dualpath.kv.hits import miss_tokens, planned_hit_blocks, readable_hit_blocks

BT = 64


def test_the_block_holding_the_last_prompt_token_is_never_read():
    assert readable_hit_blocks(300, 2, BT) == 2
    assert readable_hit_blocks(129, 2, BT) == 2  # the last token starts a third block
    assert readable_hit_blocks(128, 2, BT) == 1  # the second block ends on the last token: computed
    assert readable_hit_blocks(64, 1, BT) == 0
    assert readable_hit_blocks(1, 5, BT) == 0
    assert readable_hit_blocks(300, -1, BT) == 0


def test_miss_tokens_are_the_prompt_less_its_readable_hits():
    assert miss_tokens(300, 2, BT) == 300 - 128
    assert miss_tokens(128, 2, BT) == 64  # the block of the last token is computed whole
    assert miss_tokens(300, 0, BT) == 300


def test_a_placement_without_a_read_side_plans_no_hit_blocks():
    assert planned_hit_blocks(300, 2, BT, reads=True) == 2
    assert planned_hit_blocks(128, 2, BT, reads=True) == 1
    assert planned_hit_blocks(300, 2, BT, reads=False) == 0


@given(prompt=st.integers(1, 5000), hits=st.integers(0, 100), bt=st.integers(1, 256))
def test_readable_hits_are_the_most_whole_blocks_that_leave_the_last_token_to_compute(prompt, hits, bt):
    got = readable_hit_blocks(prompt, hits, bt)
    assert 0 <= got <= hits
    assert got * bt <= prompt - 1  # the last token is computed
    assert got == hits or (got + 1) * bt > prompt - 1  # no block that could be read is left out
    assert miss_tokens(prompt, hits, bt) == prompt - got * bt >= 1
