"""The block index replicated through JetStream: every replica sees every commit, a new replica
replays the stream, evictions are the same everywhere, concurrent commits share records, queued
changes are bounded, a commit JetStream did not store is refused; the service's inline bus paths
answer lookups, commits and garbage."""

from __future__ import annotations

import asyncio

import msgpack
import nats
import pytest

from dualpath.bus import Bus
from dualpath.bus.embedded import EmbeddedNats
from dualpath.ha.replicated_index import IndexBusyError, ReplicatedIndex, ReplicationError
from dualpath.kv import pack_hashes
from dualpath.protocol import decode, encode
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from services.kv_persistence.service import KvPersistence

pytestmark = pytest.mark.anyio

SUBJECT = "t.kvp.log"


@pytest.fixture()
def js_server(tmp_path):
    server = EmbeddedNats(jetstream_dir=str(tmp_path / "js")).start()
    try:
        yield server
    finally:
        server.stop()


async def _replica(url: str, **kw) -> tuple[nats.NATS, ReplicatedIndex]:
    nc = await nats.connect(url)
    index = ReplicatedIndex(nc.jetstream(), "t", SUBJECT, **kw)
    await index.start(replicas=1, timeout=20)
    return nc, index


async def test_a_commit_on_one_replica_is_a_hit_on_the_other_and_on_a_replica_started_later(js_server):
    nc_a, a = await _replica(js_server.url)
    nc_b, b = await _replica(js_server.url)
    try:
        await a.commit(7, [11, 12, 13])
        await b.commit(7, [11, 12, 13, 14], start=3)
        await a.wait_applied(b.applied)
        assert a.longest_prefix(7, [11, 12, 13, 14, 15]) == 4
        await b.wait_applied(a.applied)
        assert b.longest_prefix(7, [11, 12, 13, 14]) == 4
        await a.remove(7, [13])
        await b.wait_applied(a.applied)
        assert b.longest_prefix(7, [11, 12, 13, 14]) == 2
        nc_c, c = await _replica(js_server.url)  # replays the whole stream before it serves
        try:
            assert c.longest_prefix(7, [11, 12, 13, 14]) == 2
            assert len(c) == len(a) == len(b) == 2
        finally:
            await c.close()
            await nc_c.close()
    finally:
        for idx, nc in ((a, nc_a), (b, nc_b)):
            await idx.close()
            await nc.close()


async def test_evictions_chosen_by_the_committing_replica_apply_on_every_replica(js_server):
    nc_a, a = await _replica(js_server.url, capacity_blocks=3)
    nc_b, b = await _replica(js_server.url, capacity_blocks=3)
    try:
        await a.commit(1, [1, 2])
        assert await a.commit(1, [5, 6]) == [2]  # a leaf, the least recently used block
        assert await a.commit(1, [8]) == [1]
        await b.wait_applied(a.applied)
        assert sorted(b.index.unindexed(1, [1, 2, 5, 6, 8])) == [1, 2]
        assert len(a) == len(b) == 3
    finally:
        for idx, nc in ((a, nc_a), (b, nc_b)):
            await idx.close()
            await nc.close()


async def test_concurrent_commits_share_stream_records(js_server):
    nc, a = await _replica(js_server.url)
    try:
        await asyncio.gather(*(a.commit(3, [100 + i]) for i in range(200)))
        assert len(a) == 200
        assert a.records < 200  # group commit: fewer stream messages than commits
    finally:
        await a.close()
        await nc.close()


async def test_compaction_snapshots_and_purges_and_replicas_start_from_the_snapshot(js_server):
    nc_a, a = await _replica(js_server.url, compact_after=5)
    nc_b, b = await _replica(js_server.url, compact_after=5)
    try:
        for i in range(8):
            await a.commit(4, [1000 + i])
        await b.wait_applied(a.applied)
        assert await b.maybe_compact("b")
        info = await nc_a.jetstream().stream_info(a.stream)
        assert info.state.messages == 0 and info.state.first_seq == a.applied + 1  # every record is in the snapshot
        await a.commit(4, [2000])
        nc_c, c = await _replica(js_server.url)  # snapshot, then the record after it
        try:
            assert len(c) == 9 and c.longest_prefix(4, [2000]) == 1 and c.longest_prefix(4, [1003]) == 1
        finally:
            await c.close()
            await nc_c.close()
    finally:
        for idx, nc in ((a, nc_a), (b, nc_b)):
            await idx.close()
            await nc.close()


async def test_a_replica_that_missed_purged_records_reloads_the_snapshot(js_server):
    nc_a, a = await _replica(js_server.url, compact_after=1)
    nc_b, b = await _replica(js_server.url, compact_after=1)
    try:
        await a.commit(5, [1])
        await b.wait_applied(a.applied)
        await b.close()  # b stops following (as if paused) ...
        for i in range(3):
            await a.commit(5, [10 + i])
        assert await a.maybe_compact("a")  # ... and the records it missed are purged
        await a.commit(5, [20])
        # b resumes following from its last record on; the next one it sees is past a gap
        b._sub = await nc_b.jetstream().subscribe(SUBJECT, stream=b.stream, ordered_consumer=True, cb=b._on_record)  # noqa: SLF001
        await asyncio.wait_for(b.wait_applied(a.applied), 10)
        assert b.resyncs == 1
        assert len(b) == len(a) == 5
    finally:
        for idx, nc in ((a, nc_a), (b, nc_b)):
            await idx.close()
            await nc.close()


async def test_queued_changes_are_bounded_and_close_fails_the_waiting_ones_and_ends_every_task(js_server):
    nc, a = await _replica(js_server.url, max_pending_ops=2)
    try:
        answers: list[BaseException | None] = []

        async def done(error: BaseException | None) -> None:
            answers.append(error)

        a.submit_commit(6, [1], done)
        a.submit_commit(6, [2], done)
        with pytest.raises(IndexBusyError):
            a.submit_commit(6, [3], done)  # two already wait: refused at once, ``done`` never runs
        await a.close()
        assert len(answers) == 2 and not a._tasks  # noqa: SLF001 - every background task has ended
        assert all(e is None or isinstance(e, ReplicationError) for e in answers)
    finally:
        await nc.close()


async def test_a_commit_whose_record_cannot_be_stored_is_refused_not_acknowledged(js_server):
    nc, a = await _replica(js_server.url, ack_timeout=2.0)
    try:
        await nc.jetstream().delete_stream(a.stream)  # JetStream no longer stores the records
        with pytest.raises(ReplicationError):
            await a.commit(8, [1, 2])
    finally:
        await a.close()
        await nc.close()


async def test_the_service_answers_inline_lookups_and_commits_and_garbage_with_an_error_reply(js_server):
    nc, index = await _replica(js_server.url)
    svc = KvPersistence(index)
    subj = Subjects("t")
    try:
        async with Bus.open(js_server.url, "kvp") as bus:
            await svc.serve(bus, subj)

            async def ask(subject: str, data: bytes) -> object:
                try:
                    raw = await nc.request(subject, data, timeout=10)
                except nats.errors.NoRespondersError:  # a subscription just made on another connection (see Bus.request)
                    await nc.flush()
                    raw = await nc.request(subject, data, timeout=10)
                return decode(raw.data, m.Ok, m.LookupReply, m.ErrorReply)

            assert svc.commits_inline
            assert await ask(subj.kv_commit, encode(m.CommitRequest(model_digest=9, hashes=[1, 2, 3]))) == m.Ok()
            assert len(index) == 3  # answered only once applied here
            assert await ask(subj.kv_commit, encode(m.CommitRequest(model_digest=9, hashes=[3, 4], start=1))) == m.Ok()  # parent + new
            lookup = encode(m.LookupRequest(model_digest=9, hashes=[1, 2, 3, 4, 5]))
            assert await ask(subj.kv_lookup, lookup) == m.LookupReply(hit_blocks=4)
            for subject in (subj.kv_lookup, subj.kv_commit):
                for junk in (b"\x00garbage", msgpack.packb({"v": 1, "t": 10, "model_digest": "x", "hashes": []})):
                    answer = await ask(subject, junk)
                    assert isinstance(answer, m.ErrorReply) and answer.code == 400
            bad = await ask(subj.kv_commit, encode(m.CommitRequest(model_digest=9, hashes=[0, 7])))  # hash 0 is the root's
            assert isinstance(bad, m.ErrorReply) and bad.code == 400
            unhashable = msgpack.packb({"v": 1, "t": m.LookupRequest.TYPE_CODE, "model_digest": 9, "hashes": [[1], [2]]})
            bad = await ask(subj.kv_lookup, unhashable)
            assert isinstance(bad, m.ErrorReply) and bad.code == 400
            assert await ask(subj.kv_lookup, encode(m.LookupRequest(model_digest=9, hashes=[1, 2]))) == m.LookupReply(hit_blocks=2)
            packed = encode(m.LookupRequest(model_digest=9, hashes=pack_hashes([1, 2, 3, 9])))  # what the gateway sends
            assert await ask(subj.kv_lookup, packed) == m.LookupReply(hit_blocks=3)
            cut = msgpack.packb({"v": 1, "t": m.LookupRequest.TYPE_CODE, "model_digest": 9, "hashes": pack_hashes([1, 2])[:-1]})
            bad = await ask(subj.kv_lookup, cut)
            assert isinstance(bad, m.ErrorReply) and bad.code == 400
            assert svc.looked_up == 11 and svc.hits == 9
            await bus.stop_serving()  # not answered any more (told "no responders", or routed to the gone subscription for a moment)
            with pytest.raises((nats.errors.NoRespondersError, nats.errors.TimeoutError)):
                await nc.request(subj.kv_lookup, lookup, timeout=1)
    finally:
        await index.close()
        await nc.close()


async def test_a_stream_not_found_for_a_moment_after_it_was_created_is_followed_once_it_is(js_server):
    """On a cluster, a stream just created (two replicas starting at once) answered "stream not
    found" to the next request of the replica that found it missing; that replica must wait for
    it, not die. Here the server is real and the two 404s are injected."""
    from nats.js.errors import NotFoundError

    nc = await nats.connect(js_server.url)
    js = nc.jetstream()
    real, calls = js.stream_info, []

    async def flaky(name, *args, **kwargs):
        calls.append(name)
        if len(calls) in (2, 3):  # the first is the real "not found" that makes it create the stream
            raise NotFoundError(code=404, err_code=10059, description="stream not found")
        return await real(name, *args, **kwargs)

    js.stream_info = flaky
    index = ReplicatedIndex(js, "t", SUBJECT)
    try:
        await index.start(replicas=1, timeout=20)
        assert len(calls) >= 4
        await index.commit(7, [11, 12])
        assert index.longest_prefix(7, [11, 12, 13]) == 2
    finally:
        await index.close()
        await nc.close()
