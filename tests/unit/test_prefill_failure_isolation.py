"""A prefill engine fails or replaces one request without disturbing the others: a request
whose first token cannot be made (bad sampling parameters that reached it over the bus) fails
alone while the rest of its batch hands off; a newer attempt of a request it still holds
replaces the old one (which then neither hands off nor reports) instead of being taken for a
duplicate."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import replace
from types import SimpleNamespace

import torch

from dualpath.core.attempts import AttemptTable
from dualpath.core.prefill_batcher import PrefillBatcher
from dualpath.engine.common import FinishedReports
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from services.prefill_engine.engine import Job, PrefillEngine, PrefillPhase

BT = 64
VOCAB = 32


class FakeBus:
    def __init__(self) -> None:
        self.published: list[tuple[str, object]] = []
        self.requested: list[tuple[str, object]] = []

    async def publish(self, subject: str, msg) -> None:
        self.published.append((subject, msg))

    async def request(self, subject: str, msg, _reply, timeout: float = 0.0):
        self.requested.append((subject, msg))
        return m.Ok()


def _task(rid: str, sampling: dict) -> m.PrefillTask:
    return m.PrefillTask(
        request_id=rid,
        model="m",
        model_digest=0,
        prompt_tokens=[1] * 10,
        block_hashes=[],
        hit_blocks=0,
        sampling=sampling,
        reply_subject=f"out.{rid}",
        read_path=int(m.ReadPath.NONE),
        prefill_engine="p0",
        prefill_node="P",
        decode_engine="d0",
        decode_node="D",
        de_region={},
        de_offset=0,
        attempt=1,
    )


def test_one_requests_bad_sampling_fails_that_request_and_the_rest_of_its_batch_is_handed_off():
    bus = FakeBus()
    engine = PrefillEngine.__new__(PrefillEngine)  # no model, no bus connection: only the result processing runs
    engine.bus, engine.subjects, engine.node_id = bus, Subjects("t"), "P"
    engine.cfg = SimpleNamespace(engine_id="p0")
    engine.setup = SimpleNamespace(eos_ids=[0], model_dir="", layout=SimpleNamespace(block_tokens=BT))
    engine.batcher = PrefillBatcher(lambda _items: 0.001, block_tokens=BT)
    engine.finished, engine.loaded = [], deque()
    engine.requests = AttemptTable(PrefillPhase.LOADING)
    tasks = [_task("a", {"temperature": 0.0}), _task("bad", {"temperature": -1.0}), _task("c", {"temperature": 0.0})]
    for t in tasks:
        _hold(engine, t)
    batch = engine.batcher.next_batch()
    assert batch is not None and len(batch.items) == 3
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 5.0  # greedy picks token 7

    asyncio.run(engine._process_result(batch, _ran(engine, batch), SimpleNamespace(logits=logits)))

    handed_off = [msg.request_id for subject, msg in bus.requested if isinstance(msg, m.DecodeTask)]
    first_tokens = {msg.request_id: (msg.token_ids, msg.attempt) for _, msg in bus.published if isinstance(msg, m.TokenEvent)}
    failed = [msg for _, msg in bus.published if isinstance(msg, m.TaskFailed)]
    assert handed_off == ["a", "c"]
    assert first_tokens == {"a": ([7], 1), "c": ([7], 1)}  # tagged with the attempt that made them
    assert [f.request_id for f in failed] == ["bad"] and "temperature" in failed[0].reason
    assert failed[0].attempt == 1  # a late failure of an attempt the scheduler has retried is told apart
    # Only the hand-offs are reported finished: a report names no attempt, so a failure listed
    # there would pass for the prefill of a retry the scheduler placed on this engine again.
    assert engine.finished == [("a", 1), ("c", 1)]
    assert len(engine.requests) == 0


def _hold(engine: PrefillEngine, task: m.PrefillTask) -> Job:
    """``task`` held by ``engine``, loaded and queued in its batcher."""
    [start] = engine.requests.arrive(task.request_id, task.attempt, task)
    held = start.run
    job = held.state = Job(held=held, dest=SimpleNamespace(region_id="de-slot"))
    engine.requests.move(held, PrefillPhase.QUEUED)
    engine.batcher.add(task.request_id, cached=0, total=len(task.prompt_tokens))
    return job


def _engine_with(jobs: list[m.PrefillTask]) -> tuple[PrefillEngine, FakeBus, list[m.PrefillTask]]:
    """A prefill engine holding ``jobs`` (queued in its batcher); ``_start`` only records."""
    bus = FakeBus()
    engine = PrefillEngine.__new__(PrefillEngine)
    engine.bus, engine.subjects, engine.node_id = bus, Subjects("t"), "P"
    engine.cfg = SimpleNamespace(engine_id="p0")
    engine.setup = SimpleNamespace(eos_ids=[0], model_dir="", layout=SimpleNamespace(block_tokens=BT))
    engine.batcher = PrefillBatcher(lambda _items: 0.001, block_tokens=BT)
    engine.finished, engine.loaded = [], deque()
    engine._named = FinishedReports()
    engine.requests = AttemptTable(PrefillPhase.LOADING)
    for t in jobs:
        _hold(engine, t)
    started: list[m.PrefillTask] = []

    def start(held) -> None:  # takes the task, loads nothing
        started.append(held.task)
        held.state = Job(held=held, dest=SimpleNamespace(region_id="de-slot"))

    engine._start = start  # type: ignore[method-assign]
    return engine, bus, started


def _ran(engine: PrefillEngine, batch) -> list[Job]:
    """The jobs ``batch`` runs, as the engine loop captures them when the batch starts."""
    return engine._batch_started(batch)


def _attempt(task: m.PrefillTask, attempt: int) -> m.PrefillTask:
    return replace(task, attempt=attempt)


def test_a_retry_of_a_request_still_queued_here_replaces_it_instead_of_being_taken_for_a_duplicate():
    old = _task("q", {"temperature": 0.0})
    engine, bus, started = _engine_with([old])
    assert asyncio.run(engine.on_task(_attempt(old, 1))).detail == "duplicate"  # the same attempt again
    assert asyncio.run(engine.on_task(_attempt(old, 0))).detail == "superseded"  # an older one, late
    assert asyncio.run(engine.on_task(_attempt(old, 2))).detail == ""
    assert [t.attempt for t in started] == [2]  # the newer attempt runs
    assert "q" not in engine.batcher and engine.finished == []  # the old one is gone, not reported as done
    assert not [msg for _, msg in bus.published if isinstance(msg, m.TaskFailed)]


def test_a_retry_of_a_request_whose_batch_is_running_starts_when_the_batch_ends_and_the_old_one_never_hands_off():
    old = _task("q", {"temperature": 0.0})
    engine, bus, started = _engine_with([old])
    batch = engine.batcher.next_batch()  # the old attempt is being computed
    ran = _ran(engine, batch)
    asyncio.run(engine.on_task(_attempt(old, 2)))
    assert started == []  # not while the old attempt's batch still writes its KV
    asyncio.run(engine._process_result(batch, ran, SimpleNamespace(logits=torch.zeros(1, VOCAB))))
    assert [t.attempt for t in started] == [2]
    assert not [msg for _, msg in bus.requested if isinstance(msg, m.DecodeTask)]  # no hand-off of the superseded attempt
    assert not [msg for _, msg in bus.published if isinstance(msg, (m.TaskFailed, m.TokenEvent))] and engine.finished == []


def test_reports_list_every_held_task_with_its_attempt_and_the_successor_waiting_for_it():
    """The scheduler retries a placed prefill its engine's reports stop listing (its TaskFailed
    was lost): a task held here in any state, and a successor waiting for a running batch, are
    listed; a dropped one is not."""
    a, b = _task("a", {"temperature": 0.0}), _task("b", {"temperature": 0.0})
    engine, _, _ = _engine_with([a, b])
    engine.cfg = SimpleNamespace(engine_id="p0")
    engine.setup.layout.block_bytes = 1024
    engine._stats = dict  # type: ignore[method-assign]
    batch = engine.batcher.next_batch()  # both are being computed
    ran = _ran(engine, batch)
    asyncio.run(engine.on_task(_attempt(a, 3)))  # a retry of "a" waits for that batch
    r = engine.report()
    assert list(zip(r.holding, r.holding_attempts)) == [("a", 1), ("b", 1), ("a", 3)]
    asyncio.run(engine.on_cancel(m.CancelRequest(request_id="b", reason="client disconnected")))
    asyncio.run(engine._process_result(batch, ran, SimpleNamespace(logits=torch.zeros(2, VOCAB))))
    r = engine.report()
    assert "b" not in r.holding and r.holding is not None


def test_a_hand_off_is_named_finished_in_three_reports_in_a_row_so_one_lost_report_loses_none():
    engine, _, _ = _engine_with([])
    engine.cfg = SimpleNamespace(engine_id="p0")
    engine.setup.layout.block_bytes = 1024
    engine._stats = dict  # type: ignore[method-assign]
    engine.finished.append(("a", 1))
    first = engine.report()
    engine.finished.append(("b", 2))
    later = [engine.report() for _ in range(3)]
    assert (first.finished, first.finished_attempts) == (["a"], [1])
    assert [r.finished for r in later] == [["a", "b"], ["a", "b"], ["b"]]
    assert [r.finished_attempts for r in later] == [[1, 2], [1, 2], [2]]
    assert engine.report().finished == []


def test_a_newer_attempt_that_started_while_the_batch_ran_is_not_handed_the_old_batchs_first_token():
    old = _task("q", {"temperature": 0.0})
    engine, bus, _ = _engine_with([old])
    batch = engine.batcher.next_batch()
    ran = _ran(engine, batch)
    # attempt 1 was dropped meanwhile and attempt 2 started loading
    ran[0].held.phase = PrefillPhase.QUEUED
    asyncio.run(engine.on_task(_attempt(old, 2)))
    successor = engine.requests.get("q")
    assert successor is not None and successor.attempt == 2
    asyncio.run(engine._process_result(batch, ran, SimpleNamespace(logits=torch.zeros(1, VOCAB))))
    assert not [msg for _, msg in bus.requested if isinstance(msg, m.DecodeTask)]  # no hand-off with attempt 1's logits
    assert not [msg for _, msg in bus.published if isinstance(msg, m.TokenEvent)]
    assert engine.requests.get("q") is successor and engine.finished == []


def test_the_schedulers_retry_cancel_stops_only_older_attempts_and_silently():
    old = _task("q", {"temperature": 0.0})  # attempt 1
    engine, bus, started = _engine_with([old])
    asyncio.run(engine.on_cancel(m.CancelRequest(request_id="q", reason="retried", before_attempt=1)))
    assert engine.job("q") is not None  # attempt 1 is not older than 1: kept
    asyncio.run(engine.on_cancel(m.CancelRequest(request_id="q", reason="retried", before_attempt=2)))
    assert engine.job("q") is None and "q" not in engine.batcher
    assert engine.finished == [] and started == []  # not reported done: the scheduler's attempt 2 is not this one
    client = _task("c", {"temperature": 0.0})
    engine2, bus2, _ = _engine_with([client])
    asyncio.run(engine2.on_cancel(m.CancelRequest(request_id="c", reason="client disconnected")))
    # a client's cancel is told (abandoned), so the scheduler forgets the request; a finish would
    # only end its prefill part there
    assert engine2.finished == [] and [(f.request_id, f.abandoned) for _, f in bus2.published] == [("c", True)]


class RefusingBus(FakeBus):
    """The decode engine refuses the hand-off of ``refused``: it holds or ran a newer run."""

    def __init__(self, refused: str) -> None:
        super().__init__()
        self.refused = refused

    async def request(self, subject: str, msg, _reply, timeout: float = 0.0):
        await super().request(subject, msg, _reply, timeout)
        if isinstance(msg, m.DecodeTask) and msg.request_id == self.refused:
            return m.Ok(detail="superseded")
        return m.Ok()


def test_a_hand_off_the_decode_engine_refused_as_superseded_is_a_failure_that_says_so_not_a_finish():
    """Reported finished, the refused request would wait at its scheduler for a decode that never
    comes; its TaskFailed says ``superseded`` (the scheduler drops it instead of retrying)."""
    engine, _, _ = _engine_with([_task("a", {"temperature": 0.0}), _task("old", {"temperature": 0.0})])
    bus = engine.bus = RefusingBus("old")
    batch = engine.batcher.next_batch()
    assert batch is not None and len(batch.items) == 2
    logits = torch.zeros(2, VOCAB)
    asyncio.run(engine._process_result(batch, _ran(engine, batch), SimpleNamespace(logits=logits)))
    failed = [msg for _, msg in bus.published if isinstance(msg, m.TaskFailed)]
    assert [(f.request_id, f.abandoned, f.attempt) for f in failed] == [("old", True, 1)]
    assert engine.finished == [("a", 1)] and len(engine.requests) == 0


def test_a_clients_cancel_during_the_prefill_is_told_as_abandoned_not_as_a_finish():
    """Reported finished, a request cancelled before its hand-off would wait at its scheduler for
    a decode that never comes, holding its decode engine's share of tok_e and HBM for good."""
    queued, batched = _task("queued", {"temperature": 0.0}), _task("batched", {"temperature": 0.0})
    engine, bus, _ = _engine_with([batched])
    batch = engine.batcher.next_batch()  # "batched" is being computed
    ran = _ran(engine, batch)
    _hold(engine, queued)
    for rid in ("queued", "batched"):
        asyncio.run(engine.on_cancel(m.CancelRequest(request_id=rid, reason="client went away")))
    assert engine.job("queued") is None and engine.job("batched") is not None  # the batched one leaves when its batch ends
    asyncio.run(engine._process_result(batch, ran, SimpleNamespace(logits=torch.zeros(1, VOCAB))))
    failed = [msg for _, msg in bus.published if isinstance(msg, m.TaskFailed)]
    assert [(f.request_id, f.abandoned, f.attempt) for f in failed] == [("queued", True, 1), ("batched", True, 1)]
    assert not [msg for _, msg in bus.requested if isinstance(msg, m.DecodeTask)]  # neither handed off
    assert engine.finished == [] and len(engine.requests) == 0
