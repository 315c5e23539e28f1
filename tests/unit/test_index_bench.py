"""``dualpath bench index``: the driver sends the message mix its load model states, in an order
a real index accepts, and headroom and per-core capacity follow from what was measured (the
benchmark itself is run by hand)."""

from __future__ import annotations

import asyncio

import nats
import pytest

from dualpath.bench.index import LOAD, _drive, _grouping, _report
from dualpath.kv import unpack_hashes
from dualpath.protocol import decode, encode
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects

CHAIN = 16  # blocks per lookup (the bench's default is the paper's 511; fewer keep the test short)


class _ChainIndex:
    """A stand-in kv-persistence on the bus: a commit must name a known parent (``start=1``),
    a lookup answers how many leading hashes were committed. Records what each lookup carried."""

    def __init__(self) -> None:
        self.known: set[int] = set()
        self.lookup_sizes: list[int] = []
        self.orphans = 0  # commits whose parent was never committed

    async def on_commit(self, msg) -> None:
        req = decode(msg.data, m.CommitRequest)
        if req.start == 1 and req.hashes[0] not in self.known:
            self.orphans += 1
            await msg.respond(encode(m.ErrorReply(code=409, message="unknown parent")))
            return
        self.known.update(req.hashes[req.start :])
        await msg.respond(encode(m.Ok()))

    async def on_lookup(self, msg) -> None:
        req = decode(msg.data, m.LookupRequest)
        hashes = unpack_hashes(req.hashes) if isinstance(req.hashes, bytes) else req.hashes
        self.lookup_sizes.append(len(hashes))
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.known:
            hit += 1
        await msg.respond(encode(m.LookupReply(hit_blocks=hit)))


def test_the_driver_sends_the_load_models_mix_each_commit_after_its_parent_and_every_lookup_hits(nats_server) -> None:
    """Per turn: one lookup of the whole chain, one prompt commit and one commit per generated
    block (fractions carried across turns), so the measured rates are the ones ``LOAD`` claims."""
    clients = 4

    async def main() -> tuple[dict, _ChainIndex]:
        index, subj = _ChainIndex(), Subjects("bi-test")
        nc = await nats.connect(nats_server.url)
        try:
            await nc.subscribe(subj.kv_commit, cb=index.on_commit)
            await nc.subscribe(subj.kv_lookup, cb=index.on_lookup)
            await nc.flush()
            counts = await _drive(nats_server.url, "bi-test", clients=clients, seconds=1.0, chain_blocks=CHAIN, seed=3, cpu=dict)
        finally:
            await nc.close()
        return counts, index

    counts, index = asyncio.run(main())
    turns = counts["lookups"]
    assert turns >= 20 * clients, counts  # enough turns for the carried fractions to even out
    assert counts["errors"] == counts["unanswered"] == index.orphans == 0
    assert index.lookup_sizes == [CHAIN] * turns
    assert counts["hit_blocks"] == CHAIN * turns  # every block a lookup names was committed before it
    per_turn = LOAD["per_turn"]
    # Each agent carries less than one block of each kind between turns, so the totals are the
    # model's per-turn figures times the turns, to within one message (two blocks) per agent.
    assert abs(counts["commit_requests"] - turns * LOAD["commit_requests_per_s"] / LOAD["lookups_per_s"]) <= clients
    blocks = per_turn["prompt_blocks"] + per_turn["generated_commit_messages"] * per_turn["blocks_per_generated_commit"]
    assert abs(counts["block_commits"] - turns * blocks) <= 2 * clients
    assert LOAD["block_commits_per_s"] == pytest.approx(LOAD["lookups_per_s"] * blocks)


def test_headroom_is_the_smallest_ratio_and_the_projection_scales_one_replica_core() -> None:
    t = 10.0  # seconds measured; lookups at 2x the load, commits at 1.5x
    measured = {
        "elapsed_s": t,
        "lookups": 2 * LOAD["lookups_per_s"] * t,
        "commit_requests": 1.5 * LOAD["commit_requests_per_s"] * t,
        "block_commits": 1.5 * LOAD["block_commits_per_s"] * t,
    }
    r = _report(measured, {"kv-persistence-0": 3.0, "kv-persistence-1": 3.0, "nats-0": 1.5}, 2.0, 2, 1, 64)
    assert r["headroom"] == pytest.approx(1.5) and not r["headroom_ok"]
    assert r["replica_cores_for_load"] == pytest.approx(6.0 / 15.0)  # 6 CPU seconds for 15 seconds of the full load
    assert r["per_replica_core"]["headroom"] == pytest.approx(2.5)
    assert r["projected_headroom"] == pytest.approx(5.0)
    assert r["cores_used"]["driver"] == pytest.approx(0.2)


def test_stream_grouping_is_summed_from_each_replica_s_last_index_closed_line(tmp_path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    lines = [
        '{"event": "index_closed", "records": 1, "ops": 1}',  # an earlier run of the replica
        '{"event": "index_loaded"}',
        '{"event": "index_closed", "records": 10, "ops": 300}',
    ]
    (logs / "kv-persistence-0.log").write_text("\n".join(lines) + "\n")
    (logs / "kv-persistence-1.log").write_text('{"event": "index_closed", "records": 5, "ops": 100}\n')
    assert _grouping(logs, 3) == {"records": 15, "ops": 400, "ops_per_record": pytest.approx(400 / 15)}  # replica 2 left no log
    assert _grouping(tmp_path / "none", 1) == {"records": 0, "ops": 0, "ops_per_record": None}
