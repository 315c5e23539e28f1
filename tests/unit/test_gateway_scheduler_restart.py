"""The gateway's detection of a restarted scheduler without a lease: a scheduler instance it
never heard of, after another, makes it resubmit the requests no run has started (the bus and
the resubmission itself are faked here; the fault suite runs them for real)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from dualpath.config import BusConfig, GatewayConfig, ModelConfigSpec
from dualpath.protocol import encode
from dualpath.protocol import messages as m
from services.gateway.core import Gateway


@dataclass
class Raw:
    data: bytes
    subject: str = ""


class Tasks:
    """Records what the gateway starts instead of running it."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.orphan_checks = 0

    def start_soon(self, fn, *args) -> None:
        if fn.__name__ == "_resubmit_orphans":  # the later look for started requests whose engine is gone
            self.orphan_checks += 1
            return
        assert fn.__name__ == "_resubmit"
        self.started.append(args[0])


def _gateway(tiny_model, rids: list[str]) -> tuple[Gateway, Tasks]:
    gw = Gateway(GatewayConfig(), BusConfig(), ModelConfigSpec(model=str(tiny_model)))
    tasks = Tasks()
    gw._tasks = tasks  # type: ignore[assignment]
    for rid in rids:
        gw.streams.open(rid)
        gw._submitted[rid] = m.SubmitRequest(
            request_id=rid, model="m", model_digest=1, prompt_tokens=[1, 2], block_hashes=[], hit_blocks=0, sampling={}, reply_subject="x"
        )
    return gw, tasks


def _beat(gw: Gateway, instance: str) -> None:
    asyncio.run(gw._on_scheduler_alive(Raw(encode(m.SubmitReply(queue_position=0, instance=instance)))))


def test_a_new_scheduler_instance_after_another_resubmits_only_the_requests_no_run_started(tiny_model):
    gw, tasks = _gateway(tiny_model, ["cmpl-a", "cmpl-b", "cmpl-c"])
    started = m.TokenEvent(request_id="cmpl-b", index=0, token_ids=[5])
    asyncio.run(gw.streams.on_message(Raw(encode(started), subject="dualpath.out.gw.cmpl-b")))
    _beat(gw, "first")
    gw._scheduler_seen("first")  # its submit answers name it too
    assert tasks.started == []  # the first instance heard of is no restart
    _beat(gw, "second")
    assert sorted(tasks.started) == ["cmpl-a", "cmpl-c"]  # cmpl-b is running on an engine: left alone
    _beat(gw, "second")
    _beat(gw, "first")  # a late beat of the dead instance
    assert sorted(tasks.started) == ["cmpl-a", "cmpl-c"]


def test_heartbeats_without_an_instance_or_undecodable_change_nothing(tiny_model):
    gw, tasks = _gateway(tiny_model, ["cmpl-a"])
    _beat(gw, "first")
    _beat(gw, "")  # a scheduler of an older version names none
    asyncio.run(gw._on_scheduler_alive(Raw(b"\xc1 not msgpack")))
    asyncio.run(gw._on_scheduler_alive(Raw(encode(m.Ok(detail="second")))))
    assert tasks.started == []


class DyingSchedulerBus:
    """The first submit reaches a scheduler that dies before answering (no reply, not "no
    responders"); the next one is answered by the new scheduler."""

    def __init__(self) -> None:
        self.sent: list[m.SubmitRequest] = []

    async def request(self, subject, req, reply_type, timeout):
        from dualpath.bus.errors import BusTimeoutError

        self.sent.append(req)
        if len(self.sent) == 1:
            raise BusTimeoutError(subject, timeout)
        return m.SubmitReply(queue_position=0, instance="new")


def test_a_submit_its_scheduler_never_answered_is_sent_again_not_failed(tiny_model):
    gw, _ = _gateway(tiny_model, ["cmpl-a"])
    bus = DyingSchedulerBus()
    gw._connected = lambda: bus  # type: ignore[method-assign]
    asyncio.run(gw._submit(gw._submitted["cmpl-a"]))
    assert [r.request_id for r in bus.sent] == ["cmpl-a", "cmpl-a"]  # sent again (a 409 would mean: already held)


class DyingSchedulerMeanwhileResubmittedBus(DyingSchedulerBus):
    """While the first submit waits for its dead scheduler, the new leader's heartbeat makes the
    gateway submit the request anew (``streams.next_submission``)."""

    def __init__(self, gw: Gateway, rid: str) -> None:
        super().__init__()
        self.gw, self.rid = gw, rid

    async def request(self, subject, req, reply_type, timeout):
        if not self.sent:
            assert self.gw.streams.next_submission(self.rid) == 1
        return await super().request(subject, req, reply_type, timeout)


def test_an_unanswered_submit_is_not_sent_again_once_superseded(tiny_model):
    """A scheduler that already ran the newer submission to its end would take the old one for a
    new request and run it for nobody (a ghost it keeps forever)."""
    gw, _ = _gateway(tiny_model, ["cmpl-a", "cmpl-b"])
    bus = DyingSchedulerMeanwhileResubmittedBus(gw, "cmpl-a")
    gw._connected = lambda: bus  # type: ignore[method-assign]
    asyncio.run(gw._submit(gw._submitted["cmpl-a"]))
    assert [(r.request_id, r.submission) for r in bus.sent] == [("cmpl-a", 0)]  # returns as accepted: submission 1 serves it
    # answered meanwhile (the stream is done): not sent again either
    bus = DyingSchedulerBus()
    gw._connected = lambda: bus  # type: ignore[method-assign]
    gw.streams.close("cmpl-b")
    asyncio.run(gw._submit(gw._submitted["cmpl-b"]))
    assert [r.request_id for r in bus.sent] == ["cmpl-b"]


def _started(gw: Gateway, rid: str, *engines: str) -> None:
    """``rid``'s answer has started: one event per engine named (the first one the prefill engine's)."""
    for i, engine in enumerate(engines):
        ev = m.TokenEvent(request_id=rid, index=i, token_ids=[5], decode_engine=engine)
        asyncio.run(gw.streams.on_message(Raw(encode(ev), subject=f"dualpath.out.gw.{rid}")))


def _lost(gw: Gateway, engine: str, incarnation: str = "") -> None:
    asyncio.run(gw._on_engine_lost(Raw(encode(m.EngineLost(engine_id=engine, incarnation=incarnation)))))


def test_started_requests_whose_decode_engine_is_lost_are_resubmitted_and_no_others(tiny_model):
    """A scheduler that took over never heard of a request whose answer had started: when its
    engine dies, the gateway resubmits it (a scheduler that knows it answers 409)."""
    gw, tasks = _gateway(tiny_model, ["cmpl-a", "cmpl-b", "cmpl-c", "cmpl-d", "cmpl-e"])
    _started(gw, "cmpl-a", "d0", "d0@one")
    _started(gw, "cmpl-b", "d1", "d1@two")
    _started(gw, "cmpl-d", "d0")  # only its first token yet (the prefill engine names the decode engine)
    _started(gw, "cmpl-e", "d0", "d0@one", "d0@one")
    done = m.TokenEvent(request_id="cmpl-e", index=3, token_ids=[], finish_reason="stop")
    asyncio.run(gw.streams.on_message(Raw(encode(done), subject="dualpath.out.gw.cmpl-e")))
    _lost(gw, "d0", "zero")  # an older process of d0: not the one serving cmpl-a
    assert tasks.started == ["cmpl-d"]
    _lost(gw, "d0", "one")
    assert sorted(tasks.started) == ["cmpl-a", "cmpl-d", "cmpl-d"]  # not b (another engine), c (unstarted: the failover's), e (done)
    asyncio.run(gw._on_engine_lost(Raw(b"\xc1")))  # garbage changes nothing
    assert len(tasks.started) == 3


def test_after_a_failover_started_requests_whose_engine_the_new_scheduler_does_not_list_are_resubmitted(tiny_model, monkeypatch):
    """The engine died before the new scheduler took over (it never heard of it), or restarted
    since (another incarnation): nobody will ever expel it for these requests."""
    import services.gateway.core as gateway_core

    monkeypatch.setattr(gateway_core, "_ORPHAN_CHECK_S", 0.2)
    gw, tasks = _gateway(tiny_model, ["cmpl-a", "cmpl-b", "cmpl-c", "cmpl-d", "cmpl-e"])
    _started(gw, "cmpl-a", "d0", "d0@one")  # d0 restarted since: now d0@new
    _started(gw, "cmpl-b", "d1", "d1@two")  # alive
    _started(gw, "cmpl-c", "d2", "d2@three")  # gone
    _started(gw, "cmpl-e", "d3", "d3@four")  # not listed yet, but its tokens keep coming: alive
    for rid in ("cmpl-a", "cmpl-b", "cmpl-c"):
        gw.streams._streams[rid].last_event -= 10.0  # no token since the failover
    live = [{"engine_id": "d0", "incarnation": "new"}, {"engine_id": "d1", "incarnation": "two"}, {"engine_id": "p0", "incarnation": "x"}]

    async def state():
        return m.StateReply(prefill_engines=1, decode_engines=2, nodes=2, queued=0, running=0, policy="dualpath", engines=live)

    gw.cluster_state = state  # type: ignore[method-assign]

    async def check() -> None:
        orphans = asyncio.create_task(gw._resubmit_orphans())
        await asyncio.sleep(0.15)
        ev = m.TokenEvent(request_id="cmpl-e", index=3, token_ids=[5], decode_engine="d3@four")
        await gw.streams.on_message(Raw(encode(ev), subject="dualpath.out.gw.cmpl-e"))
        await orphans

    asyncio.run(check())
    assert sorted(tasks.started) == ["cmpl-a", "cmpl-c"]  # d is unstarted (resubmitted at the failover itself)
