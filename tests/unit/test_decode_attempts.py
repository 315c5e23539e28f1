"""A decode engine holds one run per request, the newest attempt's: a retry's hand-off replaces
the run it still holds (the old one stops silently: no more token events, no final event, not
reported finished), and an older attempt's late hand-off, or one the scheduler's retry cancel
already retired, is refused and its buffer slot given back. The engine's loop runs for real
over a fake decoder (one step = a few ms, always token 7) and a fake bus."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import anyio
import torch

from dualpath.model.config import KvSpec
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from services.decode_engine.engine import DecodeEngine, DecodePhase

VOCAB = 32
TOKEN = 7


class FakeDecoder:
    num_layers, kv_heads, head_dim = 1, 1, 2
    kv_spec = KvSpec("gqa", (1, 2), (1, 2))
    dtype, device = torch.float32, torch.device("cpu")

    async def decode_step_async(self, kvs: list[torch.Tensor], kv_lens: list[int], inputs: list[int]) -> torch.Tensor:
        await asyncio.sleep(0.005)
        logits = torch.zeros(len(inputs), VOCAB)
        logits[:, TOKEN] = 5.0
        return logits

    def stats(self) -> dict[str, float]:
        return {}


class FakeBus:
    def __init__(self) -> None:
        self.published: list[tuple[str, object]] = []
        self.requested: list[object] = []

    async def publish(self, subject: str, msg) -> None:
        self.published.append((subject, msg))

    async def request(self, subject: str, msg, _reply, timeout: float = 0.0):
        self.requested.append(msg)
        return m.Ok()

    def events(self, rid: str) -> list[m.TokenEvent]:
        return [e for _, e in self.published if isinstance(e, m.TokenEvent) and e.request_id == rid]

    def freed(self) -> list[tuple[str, int]]:
        return [(r.request_id, r.attempt) for r in self.requested if isinstance(r, m.FreeRequest)]

    def claimed(self, rid: str = "r") -> list[tuple[str, int]]:
        return [(c.request_id, c.attempt) for _, c in self.published if isinstance(c, m.SlotClaimed) and c.request_id == rid]


def _engine(bus: FakeBus, tasks, block_tokens: int = 512) -> DecodeEngine:
    bt = block_tokens
    setup = SimpleNamespace(
        decoder=FakeDecoder(),
        layout=SimpleNamespace(
            block_tokens=bt, layers=1, block_bytes=64, bytes_per_token_layer=1, kv_layout=0, blocks_for=lambda n: -(-n // bt)
        ),
        nic=None,
        observer=None,
        oracle=True,  # no buffer slot to read the prompt KV from
        eos_ids=[0],
        model_dir="",
        dtype="float32",
    )
    cfg = SimpleNamespace(engine_id="d0", kv_capacity_tokens=4096, max_running=8, stream_interval=1)
    return DecodeEngine(bus, Subjects("t"), cfg, "D", setup, tasks)  # type: ignore[arg-type]


def _task(attempt: int, max_tokens: int = 400) -> m.DecodeTask:
    return m.DecodeTask(
        request_id="r",
        model="m",
        model_digest=1,
        prompt_tokens=[1] * 10,
        block_hashes=[],
        cached_blocks=0,
        first_token=TOKEN,
        first_logprob=0.0,
        first_top_logprobs=[],
        sampling={"temperature": 0.0, "max_tokens": max_tokens},
        reply_subject="t.out.gw.r",
        de_region_id="region",
        de_offset=0,
        read_path=int(m.ReadPath.NONE),
        prefill_engine="p0",
        attempt=attempt,
    )


async def _until(pred, timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not pred():
            await asyncio.sleep(0.002)


async def _two_more_steps(engine: DecodeEngine, bus: FakeBus) -> None:
    """Return once the loop has run two decode steps that began after this call (a long probe
    request's tokens show them): whatever a step under way at the call publishes is out by then,
    so an event that is absent afterwards never comes."""
    await engine.on_task(m.DecodeTask(**{**_task(0).to_wire(), "request_id": "probe"}))
    await _until(lambda: sum(len(e.token_ids) for e in bus.events("probe")) >= 3)


def _with_engine(body) -> FakeBus:
    bus = FakeBus()

    async def main() -> None:
        stop = asyncio.Event()
        async with anyio.create_task_group() as tasks:
            engine = _engine(bus, tasks)
            tasks.start_soon(engine.run, stop)
            try:
                await body(engine, bus)
            finally:
                stop.set()

    asyncio.run(main())
    return bus


def test_a_retry_replaces_the_run_it_still_holds_and_the_old_runs_events_stop():
    seen: dict = {}

    async def body(engine: DecodeEngine, bus: FakeBus) -> None:
        assert (await engine.on_task(_task(0))).detail == ""
        await _until(lambda: len(bus.events("r")) >= 3)  # the first attempt is decoding
        seen["retry"] = (await engine.on_task(_task(1, max_tokens=20))).detail
        seen["old_events_at_retry"] = len([e for e in bus.events("r") if e.attempt == 0])
        # The new run's finish comes 19 steps after the retry: an event of the old run from the
        # step under way at the retry would have been published long before it.
        await _until(lambda: any(e.finish_reason for e in bus.events("r")))
        seen["late_old"] = (await engine.on_task(_task(0))).detail
        seen["same_again"] = (await engine.on_task(_task(1))).detail
        seen["finished"] = engine.report().finished

    bus = _with_engine(body)
    events = bus.events("r")
    assert seen["retry"] == ""  # not "duplicate": the newer attempt runs
    old = [e for e in events if e.attempt == 0]
    assert len(old) == seen["old_events_at_retry"] and not any(e.finish_reason for e in old)  # nothing after the retry came
    new = [e for e in events if e.attempt == 1]
    assert [e.finish_reason for e in new if e.finish_reason] == ["length"]
    assert sum(len(e.token_ids) for e in new) == 19  # its whole answer after the first token (max_tokens 20)
    assert all(e.decode_engine == engine_name(e) for e in events)
    assert seen["late_old"] == "superseded" and ("r", 0) in bus.freed()  # its slot is given back
    assert seen["finished"] == ["r"]  # once: the old run is never reported finished
    assert seen["same_again"] == "superseded"  # a late copy of the finished attempt's hand-off does not run it again
    assert bus.claimed() == [("r", 0), ("r", 1)]  # each hand-off taken told its traffic manager (the refused one did not)


def engine_name(e: m.TokenEvent) -> str:
    name, _, incarnation = e.decode_engine.partition("@")
    return f"d0@{incarnation}" if name == "d0" and incarnation else "?"


def test_the_schedulers_retry_cancel_stops_older_runs_silently_and_refuses_their_late_hand_off():
    seen: dict = {}

    async def body(engine: DecodeEngine, bus: FakeBus) -> None:
        await engine.on_task(_task(1))
        await _until(lambda: len(bus.events("r")) >= 2)
        await engine.on_cancel(m.CancelRequest(request_id="r", reason="retried", before_attempt=1))
        seen["kept"] = engine.requests.get("r") is not None  # attempt 1 is not older than 1
        await engine.on_cancel(m.CancelRequest(request_id="r", reason="retried", before_attempt=2))
        n = len(bus.events("r"))
        await _until(lambda: engine.requests.get("r") is None)
        await _two_more_steps(engine, bus)
        seen["events_after_cancel"] = len(bus.events("r")) - n
        seen["late"] = (await engine.on_task(_task(1))).detail  # its hand-off crossed the retry
        seen["finished"] = engine.report().finished
        seen["retry"] = (await engine.on_task(_task(2, max_tokens=5))).detail
        await _until(lambda: any(e.finish_reason for e in bus.events("r")))

    bus = _with_engine(body)
    assert seen["kept"] and seen["events_after_cancel"] <= 1  # at most the token of the step under way
    assert seen["late"] == "superseded" and seen["finished"] == []
    assert seen["retry"] == "" and [e.attempt for e in bus.events("r") if e.finish_reason] == [2]


def test_a_hand_off_that_crossed_its_clients_cancel_ends_on_arrival_instead_of_decoding_for_nobody():
    seen: dict = {}

    async def body(engine: DecodeEngine, bus: FakeBus) -> None:
        await engine.on_cancel(m.CancelRequest(request_id="r", reason="client"))  # nothing of it here yet
        seen["answer"] = (await engine.on_task(_task(0))).detail
        await _two_more_steps(engine, bus)  # had it been taken in, it would be decoding by now
        seen["held"] = [h for h in engine.requests.holding() if h[0] == "r"] != []
        seen["report"] = engine.report()
        seen["repeated"] = [engine.report().finished for _ in range(3)]
        seen["again"] = (await engine.on_task(_task(1, max_tokens=3))).detail  # a later run of the request is not cancelled
        await _until(lambda: any(e.finish_reason for e in bus.events("r")))

    bus = _with_engine(body)
    assert seen["answer"] == "cancelled" and not seen["held"] and not [e for e in bus.events("r") if e.attempt == 0]
    assert seen["report"].finished == ["r"] and seen["report"].finished_attempts == [0]  # the scheduler forgets it
    assert seen["repeated"] == [["r"], ["r"], []]  # named in three reports in a row: one lost report loses no finish
    assert ("r", 0) in bus.freed() and bus.claimed() == [("r", 1)]  # its slot given back, never claimed
    assert seen["again"] == "" and [e.attempt for e in bus.events("r")] and all(e.attempt == 1 for e in bus.events("r"))


def _phase(engine: DecodeEngine, rid: str) -> DecodePhase | None:
    held = engine.requests.get(rid)
    return held.phase if held is not None else None


def test_a_retry_of_a_request_waiting_for_admission_replaces_it_at_once():
    seen: dict = {}

    async def body(engine: DecodeEngine, bus: FakeBus) -> None:
        engine.batcher.max_running = 1
        await engine.on_task(m.DecodeTask(**{**_task(0).to_wire(), "request_id": "other"}))  # holds the only running place
        await _until(lambda: _phase(engine, "other") is DecodePhase.RUNNING)
        await engine.on_task(_task(0))
        seen["waiting"] = _phase(engine, "r") is DecodePhase.WAITING
        seen["retry"] = (await engine.on_task(_task(1))).detail
        seen["held"] = engine.requests.get("r").attempt if _phase(engine, "r") is DecodePhase.WAITING else None
        await _until(lambda: ("r", 0) in bus.freed())  # the replaced attempt's slot is given back

    bus = _with_engine(body)
    assert seen == {"waiting": True, "retry": "", "held": 1}
    assert bus.freed().count(("r", 0)) == 1


class RefusingAllocBus(FakeBus):
    """The node's traffic manager refuses to stage generated blocks (buffer full, or gone)."""

    async def request(self, subject: str, msg, _reply, timeout: float = 0.0):
        if isinstance(msg, m.AllocRequest):
            self.requested.append(msg)
            raise TimeoutError(f"{subject}: no service listens")
        return await super().request(subject, msg, _reply, timeout)


def test_a_generated_block_the_traffic_manager_cannot_stage_is_not_persisted_and_decoding_goes_on():
    bus = RefusingAllocBus()

    async def main() -> None:
        stop = asyncio.Event()
        async with anyio.create_task_group() as tasks:
            engine = _engine(bus, tasks, block_tokens=4)  # blocks fill every few tokens
            tasks.start_soon(engine.run, stop)
            try:
                await engine.on_task(_task(0, max_tokens=20))
                await _until(lambda: any(e.finish_reason for e in bus.events("r")))
            finally:
                stop.set()

    asyncio.run(main())
    failed = [msg for _, msg in bus.published if isinstance(msg, m.TaskFailed)]
    assert failed == []  # persistence is best effort: the answer is not failed
    new = bus.events("r")
    assert [e.finish_reason for e in new if e.finish_reason] == ["length"]
    assert sum(len(e.token_ids) for e in new) == 19
    allocs = [r for r in bus.requested if isinstance(r, m.AllocRequest)]
    assert len(allocs) == 1  # after the first refusal the request's later blocks are not staged either
