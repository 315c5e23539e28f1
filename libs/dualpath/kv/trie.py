"""The trie index of persisted Full Blocks.

Each node is one block, keyed by its chain hash; its parent is the previous block's hash (0
for the first block of a conversation). Because a block's hash folds in its parent's, the
trie needs no token storage: a request's chain is a path, and the hit is the longest prefix
of the chain that is indexed and linked.

LRU eviction must never take an inner node (its children would become unreachable). We keep
one invariant that makes this O(1): *a node is always more recently used than each of its
descendants*. Every touch walks from the deepest block up to the root, moving each node to
the most-recent end, so ancestors land after descendants; hence the least recently used node
is always a leaf and eviction just pops the oldest entry.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any, cast

from dualpath.kv.errors import IndexCorruptError
from dualpath.kv.hashing import U64_MAX, check_u64
from dualpath.kv.indexlog import IndexLog

__all__ = ["BlockIndex", "check_chain"]

_log = logging.getLogger(__name__)
_SNAPSHOT_CHUNK = 32_768  # nodes per snapshot record, to keep records bounded


def check_chain(chain: Sequence[int]) -> list[int]:
    """``chain`` as a list of plain ints in ``(0, 2**64)``; C-speed when it is already one.

    Raises:
        TypeError: an element is not an int. ValueError: one is 0 or not a u64.
    """
    out = list(chain)
    if out and set(map(type, out)) == {int} and min(out) > 0 and max(out) <= U64_MAX:
        return out
    out = [check_u64("block hash", h) for h in out]  # the slow path names the bad element
    if 0 in out:
        raise ValueError("block hash 0 is reserved for the root")
    return out


class _Trie:
    """The blocks of one model: ``nodes`` maps hash -> parent (least recently used first when
    ``ordered``); ``children`` maps a parent to its one child, or to the set of them when it
    has several (most blocks have one: a set each would cost ~200 bytes and an allocation)."""

    __slots__ = ("children", "nodes")

    def __init__(self, *, ordered: bool = True) -> None:
        self.nodes: dict[int, int] = OrderedDict() if ordered else {}  # plain dicts keep insertion order too
        self.children: dict[int, int | set[int]] = {}

    def add(self, h: int, parent: int) -> None:
        self.nodes[h] = parent
        if parent:
            kids = self.children.get(parent)
            if kids is None:
                self.children[parent] = h
            elif isinstance(kids, int):
                if kids != h:
                    self.children[parent] = {kids, h}
            else:
                kids.add(h)

    def touch(self, h: int) -> None:
        """Mark ``h`` and all its ancestors used, deepest first (keeps the LRU invariant)."""
        nodes = cast("OrderedDict[int, int]", self.nodes)
        while h:
            nodes.move_to_end(h)
            h = nodes[h]

    def pop_lru_leaf(self) -> int:
        h, parent = cast("OrderedDict[int, int]", self.nodes).popitem(last=False)  # a leaf, by the LRU invariant
        self._unlink(h, parent)
        return h

    def remove_subtree(self, root: int) -> list[int]:
        """Remove ``root`` and every descendant; return them, ``root`` first."""
        removed: list[int] = []
        stack = [root]
        while stack:
            h = stack.pop()
            removed.append(h)
            kids = self.children.pop(h, None)
            if isinstance(kids, int):
                stack.append(kids)
            elif kids is not None:
                stack.extend(kids)
        self._unlink(root, self.nodes[root])
        for h in removed:
            del self.nodes[h]
        return removed

    def _unlink(self, h: int, parent: int) -> None:
        kids = self.children.get(parent)
        if isinstance(kids, int):
            if kids == h:
                del self.children[parent]
        elif kids is not None:
            kids.discard(h)
            if len(kids) == 1:
                self.children[parent] = next(iter(kids))
            elif not kids:
                del self.children[parent]


class BlockIndex:
    """The trie of persisted Full Blocks, keyed by hash chain, one trie per model digest.

    Durable when ``path`` is given: every change is appended to a log file (msgpack records,
    each with a CRC) and fdatasync'ed before the call returns; on start the log is replayed
    (a torn last record is ignored), and when it grows past ``compact_min_bytes`` and twice
    the last snapshot it is rewritten atomically as a snapshot. LRU recency is restored from
    commits and snapshots only (lookups are not logged, so reads never write).

    ``capacity_blocks`` bounds the blocks of *each* model; committing past it evicts least
    recently used leaf blocks and returns their hashes so the caller can delete the files.
    Thread-safe; one process may hold a given log at a time.
    """

    def __init__(
        self,
        path: str | Path | None,
        *,
        capacity_blocks: int | None = None,
        compact_min_bytes: int = 4 << 20,
        track_recency: bool = True,
    ) -> None:
        """Open the index, replaying the log at ``path`` (``None``: in-memory only).

        Raises:
            ValueError: ``capacity_blocks`` < 1.
            IndexLockedError: another process holds the log.
            IndexCorruptError: the log cannot be replayed.
            OSError: the log cannot be created or read.
        """
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self._capacity = capacity_blocks
        # LRU order serves eviction and the log's snapshots; without either, touching is wasted work.
        self._touch = track_recency or capacity_blocks is not None or path is not None
        self._compact_min_bytes = compact_min_bytes
        self._tries: dict[int, _Trie] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._log: IndexLog | None = None
        self._snapshot_bytes = 0
        if path is not None:
            log = IndexLog(Path(path))
            try:
                self._replay(log)
            except BaseException:
                log.close()
                raise
            self._log = log
            self._snapshot_bytes = log.size

    def commit(self, model_digest: int, chain: Sequence[int], *, start: int = 0) -> list[int]:
        """Index ``chain[start:]`` as children of ``chain[start-1]`` (of the root if 0).

        The block files must already be written. Blocks already indexed are only touched.
        Returns the hashes whose files the caller should now delete: blocks evicted to stay
        within capacity, and, when ``chain[start-1]`` is not indexed (it was evicted or
        removed since the caller looked), ``chain[start:]`` itself, which could never be
        reached. The change is durable when this returns.

        Raises:
            ValueError: ``start`` is out of range or a hash is 0 or not a u64 (TypeError if
                not an int).
            OSError: the log append failed; the in-memory index may then be ahead of the
                log, which is safe (indexed files exist) and a restart returns to the log.
        """
        check_u64("model_digest", model_digest)
        if not 0 <= start <= len(chain):
            raise ValueError(f"start {start} out of range for a chain of {len(chain)}")
        chain = check_chain(chain)  # plain ints: they go to msgpack
        with self._lock:
            self._check_open()
            trie = self._tries.get(model_digest)
            parent = chain[start - 1] if start else 0
            if parent and (trie is None or parent not in trie.nodes):
                return [h for h in chain[start:] if trie is None or h not in trie.nodes]
            if trie is None:
                trie = self._tries[model_digest] = _Trie(ordered=self._touch)
            added: list[int] = []  # flat [hash, parent, hash, parent, ...]
            for h in chain[start:]:
                known = trie.nodes.get(h)
                if known is None:
                    trie.add(h, parent)
                    added += (h, parent)
                elif known != parent:
                    break  # a 64-bit hash collision: keep the indexed block, link no further
                parent = h
            if parent and self._touch:
                trie.touch(parent)
            evicted = self._evict(trie)
            if self._log is not None and (added or evicted):
                self._log.append({"op": "c", "m": model_digest, "a": added, "e": evicted})
                self._maybe_compact()
            return evicted

    def extend(self, model_digest: int, parent: int, new: list[int]) -> None:
        """Index ``new`` as a chain under ``parent`` (0: the root) like ``commit``, for replicas
        applying changes already checked and decided elsewhere: ``new`` must be plain ints in
        ``(0, 2**64)`` (``check_chain``), nothing is evicted (a replicated record names its
        evictions) and nothing is returned. When ``parent`` is not indexed nothing changes.

        Raises:
            ValueError: the index has a log (its changes go through ``commit``), or is closed.
        """
        if self._log is not None:
            raise ValueError("extend is for in-memory indexes; a logged index commits")
        with self._lock:
            self._check_open()
            trie = self._tries.get(model_digest)
            if trie is None:
                if parent:
                    return
                trie = self._tries[model_digest] = _Trie(ordered=self._touch)
            nodes = trie.nodes
            if parent and parent not in nodes:
                return
            for h in new:
                known = nodes.get(h)
                if known is None:
                    trie.add(h, parent)
                elif known != parent:
                    break  # a 64-bit hash collision: keep the indexed block, link no further
                parent = h
            if parent and self._touch:
                trie.touch(parent)

    def longest_prefix(self, model_digest: int, chain: Sequence[int]) -> int:
        """Number of leading ``chain`` hashes that are indexed and linked; touches them.

        Linked means each one's parent is the previous hash of ``chain`` (the first block may
        hang anywhere), so a chain that reaches an indexed block by a different path does not
        count. Never raises for unknown digests or hashes (they are misses).

        O(log n) dict probes, not n: the index is closed under prefixes (a block is indexed
        only under an indexed parent, and eviction and removal take whole subtrees), so along
        a hash chain "block i is indexed under block i-1" holds for every i below the hit and
        for none from it on, and the hit is found by bisection. Each probe checks the link,
        so a block reached by another path stops the hit where it is probed; a block whose
        64-bit hash collides with one elsewhere in the index is caught only where probed (the
        chain itself already equates equal hashes with equal prefixes, see ``hashing``).
        """
        with self._lock:
            self._check_open()
            trie = self._tries.get(model_digest)
            n = len(chain)
            if trie is None or not n:
                return 0
            get = trie.nodes.get
            if get(chain[0]) is None:
                return 0
            if n > 1 and get(chain[n - 1]) != chain[n - 2]:  # not a full hit: bisect for the first unlinked block
                lo, hi = 0, n - 1  # chain[lo] is linked, chain[hi] is not
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if get(chain[mid]) == chain[mid - 1]:
                        lo = mid
                    else:
                        hi = mid
                n = hi
            if self._touch:
                trie.touch(chain[n - 1])
            return n

    def remove(self, model_digest: int, hashes: Sequence[int]) -> list[int]:
        """Unindex ``hashes`` and all their descendants (e.g. a block file found corrupt).

        Descendants go too because they can no longer be reached. Returns every hash that
        was removed, so the caller can delete those files; unknown hashes are ignored.

        Raises:
            OSError: the log append failed (see ``commit``).
        """
        with self._lock:
            self._check_open()
            trie = self._tries.get(model_digest)
            if trie is None:
                return []
            removed: list[int] = []
            for h in hashes:
                if h in trie.nodes:
                    removed += trie.remove_subtree(h)
            if not trie.nodes:
                del self._tries[model_digest]
            if self._log is not None and removed:
                self._log.append({"op": "r", "m": model_digest, "r": removed})
                self._maybe_compact()
            return removed

    def unindexed(self, model_digest: int, hashes: Sequence[int]) -> list[int]:
        """The subset of ``hashes`` not indexed now (files safe to delete: a block evicted and
        then committed again is indexed, and its file must stay)."""
        with self._lock:
            trie = self._tries.get(model_digest)
            return list(hashes) if trie is None else [h for h in hashes if h not in trie.nodes]

    def lineage(self, model_digest: int, h: int) -> list[int]:
        """``h`` and its indexed ancestors up to the root, deepest first ([] when not indexed)."""
        with self._lock:
            trie = self._tries.get(model_digest)
            out: list[int] = []
            if trie is not None:
                nodes = trie.nodes
                while h and h in nodes:
                    out.append(h)
                    h = nodes[h]
            return out

    def lru_victims(self, model_digest: int, n: int, *, keep: AbstractSet[int] = frozenset()) -> list[int]:
        """The ``n`` least recently used blocks of a model that are not in ``keep`` (no touch).

        Because every block is more recently used than its descendants, these blocks are
        closed under descent as long as ``keep`` is a chain from the root: removing them
        removes nothing else. Used to choose evictions before they are replicated.
        """
        with self._lock:
            trie = self._tries.get(model_digest)
            if trie is None or n <= 0:
                return []
            out: list[int] = []
            for h in trie.nodes:  # least recently used first
                if h not in keep:
                    out.append(h)
                    if len(out) >= n:
                        break
            return out

    def snapshot(self) -> dict[int, list[int]]:
        """Every model's blocks as a flat ``[hash, parent, hash, parent, ...]`` list, least
        recently used first (what ``restore`` takes)."""
        with self._lock:
            return {digest: [x for pair in trie.nodes.items() for x in pair] for digest, trie in self._tries.items()}

    def restore(self, snapshot: dict[int, list[int]]) -> None:
        """Replace the in-memory contents with ``snapshot`` (from ``snapshot()``); not logged.

        Raises:
            ValueError: a block's parent is not in the snapshot, or a list is malformed.
        """
        tries: dict[int, _Trie] = {}
        for digest, flat in snapshot.items():
            if len(flat) % 2:
                raise ValueError(f"model {digest:x}: odd-length snapshot list")
            trie = tries[digest] = _Trie(ordered=self._touch)
            for i in range(0, len(flat), 2):
                trie.add(flat[i], flat[i + 1])
            for h, parent in trie.nodes.items():
                if parent and parent not in trie.nodes:
                    raise ValueError(f"model {digest:x}: block {h:x} has no parent")
        with self._lock:
            self._check_open()
            self._tries = {d: t for d, t in tries.items() if t.nodes}

    def count(self, model_digest: int) -> int:
        """Blocks indexed for one model."""
        trie = self._tries.get(model_digest)
        return 0 if trie is None else len(trie.nodes)

    def compact(self) -> None:
        """Rewrite the log as a snapshot of the current index (no-op when in-memory).

        Raises:
            OSError: the snapshot could not be written; the old log stays in use.
        """
        with self._lock:
            self._check_open()
            self._compact_locked()

    def __len__(self) -> int:
        """Total number of indexed blocks over all models."""
        return sum(len(trie.nodes) for trie in self._tries.values())

    def close(self) -> None:
        """Close the log and release its lock; later calls raise ValueError. Idempotent."""
        with self._lock:
            self._closed = True
            if self._log is not None:
                self._log.close()
                self._log = None

    def __enter__(self) -> BlockIndex:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("BlockIndex is closed")

    def _evict(self, trie: _Trie) -> list[int]:
        evicted: list[int] = []
        if self._capacity is not None:
            while len(trie.nodes) > self._capacity:
                evicted.append(trie.pop_lru_leaf())
        return evicted

    def _maybe_compact(self) -> None:
        if self._log is not None and self._log.size > max(self._compact_min_bytes, 2 * self._snapshot_bytes):
            try:
                self._compact_locked()
            except OSError as exc:
                # The change is already durable in the log; compaction is only housekeeping,
                # so report it and try again once the log has doubled again.
                self._snapshot_bytes = self._log.size
                _log.warning("index log compaction failed: %s", exc)

    def _compact_locked(self) -> None:
        if self._log is None:
            return
        records = []
        for digest, trie in self._tries.items():
            flat = [x for pair in trie.nodes.items() for x in pair]  # LRU order, oldest first
            for i in range(0, len(flat), 2 * _SNAPSHOT_CHUNK):
                records.append({"op": "s", "m": digest, "n": flat[i : i + 2 * _SNAPSHOT_CHUNK]})
        self._log.rewrite(records)
        self._snapshot_bytes = self._log.size

    def _replay(self, log: IndexLog) -> None:
        """Rebuild the tries from the log's records. Raises IndexCorruptError."""
        for offset, record in log.take_records():
            try:
                self._apply(record)
            except (KeyError, TypeError, ValueError) as exc:
                reason = f"bad {record.get('op')!r} record: {exc!r}"
                raise IndexCorruptError(log.path, offset, reason) from exc
        for digest, trie in self._tries.items():
            for h, parent in trie.nodes.items():
                if parent and parent not in trie.nodes:
                    reason = f"model {digest:x}: block {h:x} has no parent"
                    raise IndexCorruptError(log.path, 0, reason)

    def _apply(self, record: dict[str, Any]) -> None:
        """Apply one log record. Raises KeyError/TypeError/ValueError if it is malformed."""
        op, digest = record["op"], record["m"]
        trie = self._tries.get(digest) or self._tries.setdefault(digest, _Trie(ordered=self._touch))
        if op == "s":  # snapshot: oldest first, descendants before ancestors; checked at the end
            flat = record["n"]
            for i in range(0, len(flat), 2):
                trie.add(flat[i], flat[i + 1])
        elif op == "c":
            added = record["a"]
            for i in range(0, len(added), 2):
                h, parent = added[i], added[i + 1]
                if parent and parent not in trie.nodes:
                    raise ValueError(f"block {h:x} committed under unknown parent {parent:x}")
                trie.add(h, parent)
            if added:
                trie.touch(added[-2])
            for h in record["e"]:
                trie.remove_subtree(h)
        elif op == "r":
            for h in record["r"]:
                if h in trie.nodes:
                    trie.remove_subtree(h)
        else:
            raise ValueError(f"unknown op {op!r}")
        if not trie.nodes:
            del self._tries[digest]
