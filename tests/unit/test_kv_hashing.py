"""Block identity: the hash chain over full blocks of token ids."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from dualpath.kv import BLOCK_TOKENS, block_hashes, chain_root, hash_hex, model_digest, pack_hashes, unpack_hashes

MODEL = "Qwen/Qwen2.5-0.5B"
token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=40)


def test_block_hashes_are_deterministic_across_calls_and_input_types() -> None:
    tokens = list(range(1000, 1000 + 5 * BLOCK_TOKENS))
    first = block_hashes(MODEL, tokens)
    assert len(first) == 5
    assert block_hashes(MODEL, list(tokens)) == first
    assert block_hashes(MODEL, tuple(tokens)) == first
    assert block_hashes(MODEL, np.array(tokens, dtype=np.int64)) == first
    assert block_hashes(MODEL, np.array(tokens, dtype=np.uint32)) == first
    assert len(set(first)) == 5


def test_hash_matches_the_documented_formula() -> None:
    """Pins the on-disk identity: changing it would orphan every persisted block."""
    tokens = [7, 2**32 - 1, 0, 123456]
    digest = xxhash.xxh3_64_intdigest(MODEL.encode())
    h0 = xxhash.xxh3_64_intdigest((0).to_bytes(8, "little") + digest.to_bytes(8, "little") + struct.pack("<2I", *tokens[:2]))
    h1 = xxhash.xxh3_64_intdigest(h0.to_bytes(8, "little") + digest.to_bytes(8, "little") + struct.pack("<2I", *tokens[2:]))
    assert model_digest(MODEL) == digest
    assert block_hashes(MODEL, tokens, block_tokens=2) == [h0, h1]


def test_hash_depends_on_the_model_id() -> None:
    tokens = list(range(BLOCK_TOKENS))
    assert block_hashes(MODEL, tokens) != block_hashes(MODEL + "-instruct", tokens)


def test_changing_any_single_token_changes_the_block_hash() -> None:
    tokens = list(range(BLOCK_TOKENS))
    (base,) = block_hashes(MODEL, tokens)
    for i in range(BLOCK_TOKENS):
        changed = list(tokens)
        changed[i] += 1
        assert block_hashes(MODEL, changed) != [base], f"token {i} does not affect the hash"


def test_swapping_two_tokens_changes_the_block_hash() -> None:
    tokens = list(range(BLOCK_TOKENS))
    swapped = [1, 0, *tokens[2:]]
    assert block_hashes(MODEL, tokens) != block_hashes(MODEL, swapped)


def test_same_block_after_a_different_prefix_hashes_differently() -> None:
    shared = list(range(500, 500 + BLOCK_TOKENS))
    a = block_hashes(MODEL, [1] * BLOCK_TOKENS + shared)
    b = block_hashes(MODEL, [2] * BLOCK_TOKENS + shared)
    assert a[1] != b[1]


def test_partial_tail_has_no_hash_and_does_not_affect_full_blocks() -> None:
    full = list(range(2 * BLOCK_TOKENS))
    assert block_hashes(MODEL, full[: BLOCK_TOKENS - 1]) == []
    assert block_hashes(MODEL, full + [9] * (BLOCK_TOKENS - 1)) == block_hashes(MODEL, full)


@given(tokens=token_lists, cut=st.integers(0, 40), bt=st.integers(1, 6))
def test_hashes_of_a_prefix_are_a_prefix_of_the_hashes(tokens: list[int], cut: int, bt: int) -> None:
    whole = block_hashes(MODEL, tokens, block_tokens=bt)
    part = block_hashes(MODEL, tokens[:cut], block_tokens=bt)
    assert part == whole[: len(part)]
    assert len(part) == min(cut, len(tokens)) // bt


@given(tokens=token_lists, k=st.integers(1, 10), bt=st.integers(1, 6))
def test_parent_argument_continues_the_chain(tokens: list[int], k: int, bt: int) -> None:
    whole = block_hashes(MODEL, tokens, block_tokens=bt)
    k = min(k, len(whole))
    parent = whole[k - 1] if k else 0
    assert block_hashes(MODEL, tokens[k * bt :], block_tokens=bt, parent=parent) == whole[k:]


@given(a=token_lists, b=token_lists)
def test_different_full_block_contents_give_different_chains(a: list[int], b: list[int]) -> None:
    ha, hb = block_hashes(MODEL, a, block_tokens=4), block_hashes(MODEL, b, block_tokens=4)
    n = min(len(ha), len(hb))
    if a[: 4 * n] != b[: 4 * n]:
        assert ha[:n] != hb[:n]


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["7"]])
def test_tokens_outside_uint32_are_rejected(bad: list[object]) -> None:
    with pytest.raises(ValueError):
        block_hashes(MODEL, bad * 4, block_tokens=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        block_hashes(MODEL, np.array(bad * 4), block_tokens=4)


def test_bad_block_size_parent_and_model_id_are_rejected() -> None:
    with pytest.raises(ValueError):
        block_hashes(MODEL, [1, 2], block_tokens=0)
    with pytest.raises(ValueError):
        block_hashes(MODEL, [1, 2], block_tokens=1, parent=-1)
    with pytest.raises(ValueError):
        model_digest("")


# ---- tenant / cache_salt roots ------------------------------------------------------------------
def test_an_empty_tenant_and_salt_give_root_zero_and_todays_chain() -> None:
    """No API keys, no cache_salt: the chain (and every persisted block) is the unsalted one."""
    tokens = list(range(3 * BLOCK_TOKENS))
    assert chain_root() == chain_root("", "") == 0
    assert block_hashes(MODEL, tokens, parent=chain_root("", "")) == block_hashes(MODEL, tokens)


def test_every_block_of_a_chain_differs_per_tenant_and_per_salt() -> None:
    tokens = list(range(4 * BLOCK_TOKENS))
    roots = [chain_root(t, s) for t in ("", "alice", "bob") for s in ("", "s1", "s2")]
    assert len(set(roots)) == len(roots) and roots[0] == 0 and all(roots[1:])
    chains = [block_hashes(MODEL, tokens, parent=r) for r in roots]
    for i, block in enumerate(zip(*chains)):
        assert len(set(block)) == len(roots), f"block {i} is shared by two roots"


def test_tenant_and_salt_are_length_prefixed_so_their_split_matters() -> None:
    assert chain_root("ab", "c") != chain_root("a", "bc")
    assert chain_root("a", "") != chain_root("", "a")


def test_a_root_is_stable_and_continues_like_any_parent() -> None:
    """The same tenant and salt give the same root in every process (a replay hits)."""
    tokens = list(range(3 * BLOCK_TOKENS))
    root = chain_root("alice", "salt")
    pinned = hashlib.blake2b(b"\x05" + bytes(7) + b"alice" + b"\x04" + bytes(7) + b"salt", digest_size=8, person=b"dualpath.root.1")
    assert root == int.from_bytes(pinned.digest(), "little")  # the salted blocks' identity on disk
    whole = block_hashes(MODEL, tokens, parent=root)
    assert block_hashes(MODEL, tokens[BLOCK_TOKENS:], parent=whole[0]) == whole[1:]
    with pytest.raises(TypeError):
        chain_root(None, "")  # type: ignore[arg-type]


def test_hash_hex_is_sixteen_lowercase_hex_digits() -> None:
    assert hash_hex(0) == "0" * 16
    assert hash_hex(0xABCDEF) == "0000000000abcdef"
    assert hash_hex(2**64 - 1) == "f" * 16
    with pytest.raises(ValueError):
        hash_hex(2**64)


@given(st.lists(st.integers(0, 2**64 - 1), max_size=600))
def test_packed_hashes_are_little_endian_u64s_and_unpack_to_the_same_chain(hashes: list[int]) -> None:
    packed = pack_hashes(hashes)
    assert packed == struct.pack(f"<{len(hashes)}Q", *hashes)
    assert list(unpack_hashes(packed)) == hashes


def test_packing_refuses_what_is_not_a_u64_and_unpacking_a_cut_buffer() -> None:
    for bad in ([-1], [2**64]):
        with pytest.raises(ValueError):
            pack_hashes(bad)
    with pytest.raises(TypeError):
        pack_hashes(["1"])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        unpack_hashes(pack_hashes([1, 2])[:-1])
