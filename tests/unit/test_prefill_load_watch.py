"""A KV load awaited from a traffic manager fails in seconds when that traffic manager dies or
restarts (``services.prefill_engine.tm_watch``), not after ``TIMEOUTS.tm_load``; a live one that
is still reading is waited for. A fake bus stands for NATS: the load never answers (its process
died holding it) and the probes get what the test gives them."""

from __future__ import annotations

import asyncio
import time

import pytest

from dualpath.bus import BusTimeoutError
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from services.prefill_engine.tm_watch import TrafficManagerLost, await_load

PERIOD = 0.05  # the probe period in these tests (1 s in service)
REQ = m.LoadRequest(
    request_id="r", model_digest=1, hashes=[1, 2], layers=2, bytes_per_token_layer=8, dtype="bf16", block_tokens=4, attempt=3
)


class ProbeBus:
    """Answers probes with ``answers`` in turn (the last one repeats): a ``LoadProbeReply``, or an
    exception to raise."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.probes: list[tuple[str, m.LoadProbe]] = []

    async def request(self, subject: str, msg, reply_type, timeout: float = 0.0):
        assert isinstance(msg, m.LoadProbe)
        self.probes.append((subject, msg))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


async def _never() -> m.LoadReply:
    await asyncio.sleep(3600)  # the traffic manager died holding the load: no answer ever comes
    raise AssertionError("unreachable")


def _watch(bus: ProbeBus, call=_never) -> tuple[object, float]:
    async def main():
        t0 = time.monotonic()
        try:
            out: object = await await_load(bus, Subjects("t"), "p0", REQ, call, period=PERIOD)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out = exc
        return out, time.monotonic() - t0

    return asyncio.run(main())


def test_a_load_whose_traffic_manager_died_fails_at_the_first_probe_naming_the_node():
    bus = ProbeBus(BusTimeoutError("t.tm.p0.probe", 2.0, no_responders=True))
    out, took = _watch(bus)
    assert isinstance(out, TrafficManagerLost) and out.node == "p0" and "died" in str(out)
    assert took < 20 * PERIOD
    assert bus.probes == [("t.tm.p0.probe", m.LoadProbe(request_id="r", attempt=3))]


def test_a_load_whose_traffic_manager_restarted_fails_once_the_new_process_twice_says_it_does_not_run_it():
    bus = ProbeBus(
        m.LoadProbeReply(running=True), m.LoadProbeReply(running=False), m.LoadProbeReply(running=True), m.LoadProbeReply(running=False)
    )
    out, took = _watch(bus)
    assert isinstance(out, TrafficManagerLost) and "restarted" in str(out)
    assert len(bus.probes) == 5  # one "not running" alone (an answer on its way) is not enough
    assert took < 40 * PERIOD


def test_a_hung_traffic_manager_is_given_up_after_three_unanswered_probes():
    bus = ProbeBus(BusTimeoutError("t.tm.p0.probe", 2.0))
    out, _ = _watch(bus)
    assert isinstance(out, TrafficManagerLost) and "3 probes" in str(out)
    assert len(bus.probes) == 3


def test_a_slow_load_on_a_live_traffic_manager_is_waited_for_and_its_answer_returned():
    reply = m.LoadReply(loaded=2, region={}, offset=0, bytes_read=64)

    async def slow() -> m.LoadReply:
        await asyncio.sleep(10 * PERIOD)
        return reply

    bus = ProbeBus(m.LoadProbeReply(running=True))
    out, _ = _watch(bus, slow)
    assert out == reply and len(bus.probes) >= 5


def test_a_load_nobody_serves_fails_as_a_lost_traffic_manager_and_other_errors_pass_through_unchanged():
    async def nobody() -> m.LoadReply:
        raise BusTimeoutError("t.tm.p0.load", 120.0, no_responders=True)

    async def refused() -> m.LoadReply:
        raise ValueError("bad")

    out, _ = _watch(ProbeBus(m.LoadProbeReply(running=True)), nobody)
    assert isinstance(out, TrafficManagerLost) and out.node == "p0"
    out, _ = _watch(ProbeBus(m.LoadProbeReply(running=True)), refused)
    assert isinstance(out, ValueError)


@pytest.mark.parametrize("attempt", [0, 7])
def test_the_traffic_manager_answers_a_probe_only_for_a_load_it_is_running(attempt):
    from services.traffic_manager.service import TrafficManager

    tm = TrafficManager.__new__(TrafficManager)
    tm._loads = {}
    started, release = asyncio.Event(), asyncio.Event()

    async def held(req):
        started.set()
        await release.wait()
        return "done"

    tm._load = held  # type: ignore[method-assign]

    async def main():
        req = m.LoadRequest(
            request_id="q", model_digest=1, hashes=[], layers=1, bytes_per_token_layer=1, dtype="bf16", block_tokens=1, attempt=attempt
        )
        probe = m.LoadProbe(request_id="q", attempt=attempt)
        assert (await tm.probe(probe)).running is False
        task = asyncio.ensure_future(tm.load(req))
        await started.wait()
        during = (await tm.probe(probe)).running, (await tm.probe(m.LoadProbe(request_id="q", attempt=attempt + 1))).running
        release.set()
        assert await task == "done"
        return during, (await tm.probe(probe)).running

    assert asyncio.run(main()) == ((True, False), False)


class DeadTmBus:
    """The read node's traffic manager took the load and died: the load never answers, the
    probes find nobody serving it. Publications are recorded."""

    def __init__(self) -> None:
        self.published: list[object] = []

    async def publish(self, subject: str, msg) -> None:
        self.published.append(msg)

    async def request(self, subject: str, msg, reply_type, timeout: float = 0.0):
        if isinstance(msg, m.LoadRequest):
            await asyncio.sleep(timeout)  # the whole TIMEOUTS.tm_load: the watch must end the load before it
            raise BusTimeoutError(subject, timeout)
        raise BusTimeoutError(subject, timeout, no_responders=True)


@pytest.mark.parametrize("cancelled", [False, True], ids=["live", "cancelled-by-its-client"])
@pytest.mark.parametrize("path", [m.ReadPath.PE, m.ReadPath.DE])
def test_a_prefill_task_whose_kv_load_died_with_its_traffic_manager_fails_within_seconds_naming_the_node(path, cancelled):
    """... and one its client cancelled while it loaded is abandoned (not retried), the node's
    loss told all the same."""
    from types import SimpleNamespace

    from dualpath.core.attempts import AttemptTable
    from services.prefill_engine.engine import Job, PrefillEngine, PrefillPhase

    bus = DeadTmBus()
    engine = PrefillEngine.__new__(PrefillEngine)  # no model: only the load runs
    engine.bus, engine.subjects, engine.node_id = bus, Subjects("t"), "P"
    engine.cfg = SimpleNamespace(engine_id="pe0")
    layout = SimpleNamespace(block_tokens=4, layers=2, bytes_per_token_layer=8, kv_layout=0)
    engine.setup = SimpleNamespace(oracle=False, layout=layout, dtype="bf16")
    engine.requests, engine.finished, engine.buffer_waits = AttemptTable(PrefillPhase.LOADING), [], 0
    task = m.PrefillTask(
        request_id="r",
        model="m",
        model_digest=1,
        prompt_tokens=[1] * 20,
        block_hashes=[11, 12, 13, 14, 15],
        hit_blocks=4,
        sampling={},
        reply_subject="out.r",
        read_path=int(path),
        prefill_engine="pe0",
        prefill_node="P",
        decode_engine="de0",
        decode_node="D",
        de_region={},
        de_offset=0,
        attempt=1,
    )
    [start] = engine.requests.arrive("r", task.attempt, task)
    job = start.run.state = Job(held=start.run, dest=SimpleNamespace(region_id="de-slot"))
    if cancelled:  # while it loads: it leaves when the load ends
        engine.requests.client_cancel("r")

    async def main() -> float:
        t0 = time.monotonic()
        await asyncio.wait_for(engine._load(job), 10)  # far below TIMEOUTS.tm_load (120 s)
        return time.monotonic() - t0

    took = asyncio.run(main())
    failed = [x for x in bus.published if isinstance(x, m.TaskFailed)]
    node = "P" if path == m.ReadPath.PE else "D"
    assert [(f.request_id, f.node_unreachable, f.abandoned) for f in failed] == [("r", node, cancelled)]
    assert f"node {node}" in failed[0].reason and took < 8.0  # seconds, not the load timeout (the wait_for stops it at 10)


def test_a_batch_that_finds_a_nodes_buffer_gone_fails_its_tasks_naming_that_node():
    """The DE node's traffic manager died mid-batch (its shared-memory buffer with it): every task
    of the batch fails, and each ``TaskFailed`` names the node so the scheduler leaves it out."""
    from collections import deque
    from types import SimpleNamespace

    from dualpath.core.attempts import AttemptTable
    from dualpath.core.prefill_batcher import PrefillBatcher
    from dualpath.transfer import RegionDescriptor, UnknownRegionError
    from services.prefill_engine.engine import Job, PrefillEngine, PrefillPhase

    bus = DeadTmBus()
    engine = PrefillEngine.__new__(PrefillEngine)
    engine.bus, engine.subjects, engine.node_id = bus, Subjects("t"), "P"
    engine.cfg = SimpleNamespace(engine_id="pe0")
    engine.batcher = PrefillBatcher(lambda _items: 0.001, block_tokens=4)
    engine.requests, engine.finished, engine.loaded = AttemptTable(PrefillPhase.LOADING), [], deque()
    engine.busy_s = 0.0
    slot = RegionDescriptor(region_id="t-D-buf", node_id="D", size=1 << 20, transport="tcp")
    for rid in ("a", "b"):
        task = m.PrefillTask(
            request_id=rid,
            model="m",
            model_digest=1,
            prompt_tokens=[1] * 10,
            block_hashes=[],
            hit_blocks=0,
            sampling={},
            reply_subject=f"out.{rid}",
            read_path=int(m.ReadPath.NONE),
            prefill_engine="pe0",
            prefill_node="P",
            decode_engine="de0",
            decode_node="D",
            de_region=slot.to_wire(),
            de_offset=0,
        )
        [start] = engine.requests.arrive(rid, task.attempt, task)
        start.run.state = Job(held=start.run, dest=slot)
        engine.requests.move(start.run, PrefillPhase.QUEUED)
        engine.batcher.add(rid, cached=0, total=10)
    stop = asyncio.Event()

    async def gone(_batch, _jobs):
        stop.set()
        raise UnknownRegionError("t-D-buf", "no shared memory")

    engine._run_batch = gone  # type: ignore[method-assign]
    asyncio.run(engine.run(stop))
    failed = [(x.request_id, x.node_unreachable) for x in bus.published if isinstance(x, m.TaskFailed)]
    assert sorted(failed) == [("a", "D"), ("b", "D")]
