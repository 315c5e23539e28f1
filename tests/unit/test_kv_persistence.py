"""kv-persistence with a capacity: evicted blocks' files are deleted, and a commit never
indexes a block whose file is missing (evicted while it was being rewritten)."""

from __future__ import annotations

import asyncio

from dualpath.kv import BlockIndex, BlockStore
from dualpath.protocol import messages as m
from services.kv_persistence.service import KvPersistence

D = 5


def _write(store: BlockStore, *hashes: int) -> None:
    for h in hashes:
        store.write(model_digest=D, block_hash=h, layers=1, tokens=2, bytes_per_token_layer=2, dtype="uint8", payload=bytes(4))


def test_eviction_deletes_files_and_a_commit_skips_blocks_without_a_file(tmp_path):
    store = BlockStore(tmp_path)
    svc = KvPersistence(BlockIndex(None, capacity_blocks=3), store)
    _write(store, 1, 2, 3)
    asyncio.run(svc.commit(m.CommitRequest(model_digest=D, hashes=[1, 2, 3])))
    _write(store, 10, 11)
    asyncio.run(svc.commit(m.CommitRequest(model_digest=D, hashes=[10, 11])))  # 2 over capacity: 2 evicted
    files = {h for h in (1, 2, 3, 10, 11) if store.exists(D, h)}
    assert len(svc.index) == 3 and len(files) == 3 and svc.deleted == 2
    assert {10, 11} <= files  # the newest chain stays

    _write(store, 20)  # 21's file is missing (evicted while being rewritten): 20 is indexed, 21 and 22 are not
    _write(store, 22)
    asyncio.run(svc.commit(m.CommitRequest(model_digest=D, hashes=[20, 21, 22])))
    assert svc.index.longest_prefix(D, [20, 21, 22]) == 1
    assert not store.exists(D, 22)  # unreachable after the missing block: its file went too
