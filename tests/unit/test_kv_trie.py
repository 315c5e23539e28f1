"""BlockIndex: the durable, capacity-bounded trie of persisted Full Blocks."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dualpath.kv import BlockIndex, IndexCorruptError, IndexLockedError

MD = 0x5EED
A = [101, 102, 103]
B = [201, 202]


def test_longest_prefix_counts_committed_blocks() -> None:
    index = BlockIndex(None)
    chain = [1, 2, 3, 4, 5]
    assert index.longest_prefix(MD, chain) == 0
    assert index.commit(MD, chain[:3]) == []
    assert index.longest_prefix(MD, chain) == 3
    assert index.commit(MD, chain, start=3) == []
    assert index.longest_prefix(MD, chain) == 5
    assert index.longest_prefix(MD, chain[:2]) == 2
    assert len(index) == 5


def test_branching_conversations_share_their_prefix() -> None:
    index = BlockIndex(None)
    prefix = [1, 2]
    index.commit(MD, prefix + [10, 11])
    index.commit(MD, prefix + [20], start=2)
    assert len(index) == 5  # the shared prefix is stored once
    assert index.longest_prefix(MD, prefix + [10, 11]) == 4
    assert index.longest_prefix(MD, prefix + [20, 21]) == 3
    assert index.longest_prefix(MD, prefix + [20, 11]) == 3  # 11 is indexed but not under 20


def test_a_block_reached_by_another_path_is_not_a_hit() -> None:
    index = BlockIndex(None)
    index.commit(MD, [1, 2, 3])
    assert index.longest_prefix(MD, [1, 3]) == 1
    assert index.longest_prefix(MD, [9, 2, 3]) == 0


def test_models_have_separate_tries() -> None:
    index = BlockIndex(None)
    index.commit(MD, A)
    assert index.longest_prefix(MD + 1, A) == 0
    index.commit(MD + 1, A[:1])
    assert index.longest_prefix(MD + 1, A) == 1
    assert index.longest_prefix(MD, A) == 3


def test_commit_under_a_parent_that_is_gone_returns_the_orphans() -> None:
    index = BlockIndex(None)
    index.commit(MD, A)
    assert index.commit(MD, [999, 7, 8], start=1) == [7, 8]
    assert index.longest_prefix(MD, [7]) == 0
    assert len(index) == 3


def test_remove_drops_the_block_and_its_unreachable_descendants() -> None:
    index = BlockIndex(None)
    index.commit(MD, [1, 2, 3])
    index.commit(MD, [1, 2, 4], start=2)
    index.commit(MD, [9])
    assert sorted(index.remove(MD, [2, 12345])) == [2, 3, 4]
    assert index.longest_prefix(MD, [1, 2, 3]) == 1
    assert index.longest_prefix(MD, [9]) == 1
    assert len(index) == 2


def test_invalid_hashes_and_start_are_refused() -> None:
    index = BlockIndex(None)
    with pytest.raises(ValueError):
        index.commit(MD, [1, 0, 2])
    with pytest.raises(ValueError):
        index.commit(MD, [1, 2], start=3)
    with pytest.raises(ValueError):
        index.commit(MD, [2**64])
    assert len(index) == 0


def test_eviction_takes_the_least_recently_used_leaf() -> None:
    index = BlockIndex(None, capacity_blocks=3)
    index.commit(MD, [1])
    index.commit(MD, [2])
    index.commit(MD, [3])
    assert index.longest_prefix(MD, [1]) == 1  # 1 is now more recent than 2
    assert index.commit(MD, [4]) == [2]
    assert index.longest_prefix(MD, [2]) == 0
    assert len(index) == 3


def test_eviction_never_takes_an_inner_block() -> None:
    """The root block is the oldest commit, but evicting it would orphan its children."""
    index = BlockIndex(None, capacity_blocks=4)
    index.commit(MD, [1, 2, 3])
    index.commit(MD, [7])
    assert index.commit(MD, [8]) == [3]
    assert index.commit(MD, [9]) == [2]
    assert index.longest_prefix(MD, [1, 2, 3]) == 1
    assert len(index) == 4


def test_a_chain_longer_than_capacity_keeps_its_head() -> None:
    index = BlockIndex(None, capacity_blocks=3)
    assert index.commit(MD, [1, 2, 3, 4, 5]) == [5, 4]
    assert index.longest_prefix(MD, [1, 2, 3, 4, 5]) == 3


def test_commits_survive_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "index" / "log"
    with BlockIndex(path) as index:
        index.commit(MD, A)
        index.commit(MD, A[:1] + B, start=1)
        index.commit(MD + 1, [5])
        index.remove(MD, [A[2]])
    with BlockIndex(path) as index:
        assert len(index) == 5
        assert index.longest_prefix(MD, A) == 2
        assert index.longest_prefix(MD, A[:1] + B) == 3
        assert index.longest_prefix(MD + 1, [5]) == 1


def test_the_index_log_and_its_lock_are_the_owners_alone_after_commits_and_compaction(tmp_path: Path) -> None:
    """The log names every persisted block: 0600 files in a 0700 directory made for it."""
    path = tmp_path / "index" / "log"
    with BlockIndex(path) as index:
        index.commit(MD, A)
        index.compact()  # a rewrite: a new file replaces the log
        index.commit(MD, A[:1] + B, start=1)
    assert path.parent.stat().st_mode & 0o777 == 0o700
    for name in ("log", "log.lock"):
        assert (path.parent / name).stat().st_mode & 0o777 == 0o600, name


def test_evictions_survive_reopen_and_recency_follows_commits(tmp_path: Path) -> None:
    path = tmp_path / "log"
    with BlockIndex(path, capacity_blocks=2) as index:
        index.commit(MD, [1])
        index.commit(MD, [2])
        assert index.commit(MD, [3]) == [1]
    with BlockIndex(path, capacity_blocks=2) as index:
        assert index.longest_prefix(MD, [1]) == 0
        assert index.commit(MD, [4]) == [2]  # 2 was committed before 3


def test_lower_capacity_on_reopen_is_enforced_at_the_next_commit(tmp_path: Path) -> None:
    with BlockIndex(tmp_path / "log") as index:
        for h in range(1, 6):
            index.commit(MD, [h])
    with BlockIndex(tmp_path / "log", capacity_blocks=2) as index:
        assert index.commit(MD, [6]) == [1, 2, 3, 4]
        assert len(index) == 2


def _two_commits(path: Path) -> int:
    with BlockIndex(path) as index:
        index.commit(MD, A)
        size_after_first = path.stat().st_size
        index.commit(MD, A[:1] + B, start=1)
    return size_after_first


@pytest.mark.parametrize("tear", ["truncate", "zero-fill"])
def test_torn_last_record_is_ignored(tmp_path: Path, tear: str) -> None:
    path = tmp_path / "log"
    good = _two_commits(path)
    if tear == "truncate":
        os.truncate(path, path.stat().st_size - 3)
    else:
        os.truncate(path, good)
        with open(path, "ab") as f:
            f.write(bytes(40))
    with BlockIndex(path) as index:
        assert index.longest_prefix(MD, A) == 3
        assert index.longest_prefix(MD, A[:1] + B) == 1
        index.commit(MD, [77])  # appends after the cut, not after the garbage
    with BlockIndex(path) as index:
        assert index.longest_prefix(MD, [77]) == 1
        assert len(index) == 4


def test_damaged_record_followed_by_more_records_is_corruption(tmp_path: Path) -> None:
    path = tmp_path / "log"
    good = _two_commits(path)
    raw = bytearray(path.read_bytes())
    raw[good - 1] ^= 0xFF  # inside the first record's payload
    path.write_bytes(raw)
    with pytest.raises(IndexCorruptError):
        BlockIndex(path)


def test_foreign_file_is_corruption(tmp_path: Path) -> None:
    path = tmp_path / "log"
    path.write_bytes(b"not an index log at all")
    with pytest.raises(IndexCorruptError, match="magic"):
        BlockIndex(path)


def test_compaction_keeps_contents_and_shrinks_the_log(tmp_path: Path) -> None:
    path = tmp_path / "log"
    with BlockIndex(path, capacity_blocks=50, compact_min_bytes=1 << 30) as index:
        for turn in range(200):
            index.commit(MD, [1, 2, 1000 + turn], start=0 if turn == 0 else 2)
        before = path.stat().st_size
        index.compact()
        assert path.stat().st_size < before / 3
        assert index.longest_prefix(MD, [1, 2, 1199]) == 3
        index.commit(MD, [1, 2, 5000], start=2)
    with BlockIndex(path, capacity_blocks=50) as index:
        assert len(index) == 50
        assert index.longest_prefix(MD, [1, 2, 5000]) == 3
        assert index.longest_prefix(MD, [1, 2, 1199]) == 3
        assert index.longest_prefix(MD, [1, 2, 1100]) == 2
        # Recency survived the snapshot: the oldest remaining leaf goes first.
        assert index.commit(MD, [9]) == [1153]


def test_log_compacts_itself_as_it_grows(tmp_path: Path) -> None:
    path = tmp_path / "log"
    with BlockIndex(path, capacity_blocks=8, compact_min_bytes=1024) as index:
        for turn in range(300):
            index.commit(MD, [turn + 1])
        assert path.stat().st_size < 2048  # 300 uncompacted commits would take ~9 KiB
    with BlockIndex(path) as index:
        assert len(index) == 8
        assert index.longest_prefix(MD, [300]) == 1
        assert index.longest_prefix(MD, [292]) == 0


def test_hashes_from_numpy_are_indexed_and_logged_as_ints(tmp_path: Path) -> None:
    chain = np.array([2**64 - 1, 5, 6], dtype=np.uint64)
    with BlockIndex(tmp_path / "log") as index:
        index.commit(MD, chain)  # type: ignore[arg-type]
    with BlockIndex(tmp_path / "log") as index:
        assert index.longest_prefix(MD, [2**64 - 1, 5, 6]) == 3


def test_second_owner_of_a_log_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "log"
    first = BlockIndex(path)
    with pytest.raises(IndexLockedError):
        BlockIndex(path)
    first.close()
    BlockIndex(path).close()


def test_closed_index_refuses_calls() -> None:
    index = BlockIndex(None)
    index.close()
    with pytest.raises(ValueError, match="closed"):
        index.longest_prefix(MD, [1])


class IndexAgainstModel(RuleBasedStateMachine):
    """Drives a durable BlockIndex and a dict of hash -> parent side by side.

    Recency is modelled exactly until the first reopen (lookups are not logged, so after a
    reopen only the weaker rule is checked: whatever is evicted is a leaf).
    """

    CAPACITY = 10

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp()
        self.path = Path(self.dir) / "log"
        self.index = BlockIndex(self.path, capacity_blocks=self.CAPACITY, compact_min_bytes=600)
        self.parent: dict[int, int] = {}
        self.stamp: dict[int, int] = {}
        self.clock = 0
        self.exact_recency = True
        self.gone: list[int] = []
        self.next_hash = 1

    def fresh(self) -> int:
        self.next_hash += 1
        return self.next_hash * 0x9E3779B97F4A7C15 % 2**64 or 1

    def path_to(self, h: int) -> list[int]:
        path = []
        while h:
            path.append(h)
            h = self.parent[h]
        return path[::-1]

    def touch(self, h: int) -> None:
        self.clock += 1
        for node in self.path_to(h):
            self.stamp[node] = self.clock

    def check_evictions(self, evicted: list[int]) -> None:
        for h in evicted:
            assert h in self.parent
            assert h not in self.parent.values(), "evicted an inner block"
            if self.exact_recency:
                leaves = [n for n in self.parent if n not in self.parent.values()]
                assert h == min(leaves, key=self.stamp.__getitem__), "not the LRU leaf"
            del self.parent[h]
            self.gone.append(h)

    @rule(data=st.data(), new=st.integers(1, 4))
    def commit_a_branch(self, data: st.DataObject, new: int) -> None:
        base = data.draw(st.sampled_from([0, *sorted(self.parent)]))
        path = self.path_to(base)
        start = data.draw(st.integers(0, len(path)))
        fresh = [self.fresh() for _ in range(new)]
        evicted = self.index.commit(MD, path + fresh, start=start)
        for h, p in zip(fresh, [base, *fresh]):
            self.parent[h] = p
        self.touch(fresh[-1])
        self.check_evictions(evicted)

    @precondition(lambda self: self.gone)
    @rule(data=st.data())
    def commit_under_a_gone_parent(self, data: st.DataObject) -> None:
        orphans = [self.fresh(), self.fresh()]
        gone = data.draw(st.sampled_from(self.gone))
        assert self.index.commit(MD, [gone, *orphans], start=1) == orphans

    @precondition(lambda self: self.parent)
    @rule(data=st.data(), extend=st.booleans())
    def look_up_a_known_path(self, data: st.DataObject, extend: bool) -> None:
        h = data.draw(st.sampled_from(sorted(self.parent)))
        path = self.path_to(h)
        assert self.index.longest_prefix(MD, path + ([self.fresh()] if extend else [])) == len(path)
        self.touch(h)

    @precondition(lambda self: self.parent)
    @rule(data=st.data())
    def look_up_a_slice_of_a_path_then_new_blocks(self, data: st.DataObject) -> None:
        """The bisecting lookup agrees with a block-by-block walk on what callers send: part of a
        path (from any block, as a hash chain need not start at the root) followed by blocks
        never committed."""
        path = self.path_to(data.draw(st.sampled_from(sorted(self.parent))))
        lo = data.draw(st.integers(0, len(path) - 1))
        hi = data.draw(st.integers(lo, len(path)))
        chain = path[lo:hi] + [self.fresh() for _ in range(data.draw(st.integers(0, 2)))]
        walk = 1 if chain and chain[0] in self.parent else 0
        while walk and walk < len(chain) and self.parent.get(chain[walk]) == chain[walk - 1]:
            walk += 1
        assert walk == hi - lo
        assert self.index.longest_prefix(MD, chain) == walk
        if walk:
            self.touch(chain[walk - 1])

    @precondition(lambda self: self.parent)
    @rule(data=st.data())
    def remove_a_block(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(sorted(self.parent)))
        subtree = {h}
        for node in sorted(self.parent):
            if set(self.path_to(node)) & {h}:
                subtree.add(node)
        assert set(self.index.remove(MD, [h])) == subtree
        for node in subtree:
            del self.parent[node]
        self.gone += subtree

    @rule()
    def reopen(self) -> None:
        self.index.close()
        self.index = BlockIndex(self.path, capacity_blocks=self.CAPACITY, compact_min_bytes=600)
        self.exact_recency = False

    @rule()
    def compact(self) -> None:
        self.index.compact()

    @invariant()
    def same_blocks_as_the_model(self) -> None:
        assert len(self.index) == len(self.parent) <= self.CAPACITY

    @invariant()
    def closed_under_prefixes(self) -> None:
        """Every indexed block's parent is indexed: what lets lookups bisect."""
        for flat in self.index.snapshot().values():
            indexed = set(flat[::2])
            assert all(p == 0 or p in indexed for p in flat[1::2])

    def teardown(self) -> None:
        self.index.close()
        shutil.rmtree(self.dir)


IndexAgainstModel.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
test_index_behaves_like_a_dict_of_parents = IndexAgainstModel.TestCase


def test_unindexed_names_the_evicted_blocks_that_were_not_committed_again():
    index = BlockIndex(None, capacity_blocks=3)
    index.commit(7, [1, 2, 3])
    evicted = index.commit(7, [10, 11])  # two over capacity: the oldest leaves go
    assert len(evicted) == 2 and len(index) == 3
    assert index.unindexed(7, evicted) == evicted
    index.commit(7, [evicted[0]])  # committed again (a new turn re-persisted it): keep its file
    assert evicted[0] not in index.unindexed(7, evicted)
    assert index.unindexed(99, [5]) == [5]  # unknown model: nothing indexed


def test_extend_links_under_an_indexed_parent_only_and_refuses_a_logged_index(tmp_path: Path) -> None:
    index = BlockIndex(None)
    index.extend(MD, 0, [1, 2])
    index.extend(MD, 2, [3])
    index.extend(MD, 99, [4, 5])  # the parent is gone: nothing is indexed
    index.extend(MD, 1, [3, 6])  # 3 is indexed under 2: linked no further
    assert index.longest_prefix(MD, [1, 2, 3]) == 3
    assert len(index) == 3
    with BlockIndex(tmp_path / "log") as logged, pytest.raises(ValueError):
        logged.extend(MD, 0, [1])
