"""The scheduler service's wiring of attempts and lost engines (the real core, a fake bus):
attempts on the wire are offset by the gateway's submission (a scheduler that took over never
reuses the dead one's numbers), slots are reserved per attempt in the scheduler's name, and an
engine that restarted under its name (a new incarnation in its reports) is treated as lost at
once: its requests go back to the queue, older attempts are cancelled and their slots freed,
and gateways hear ``EngineLost``. Accepting a resubmission stops the runs of the dead scheduler's
placements (a cancel of every older attempt)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import anyio

from dualpath.core import CoreConfig, SchedulerCore
from dualpath.policy import Thresholds, get_policy
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from services.scheduler.shell import SchedulerShell

S = m.SUBMISSION_ATTEMPTS


class FakeBus:
    def __init__(self) -> None:
        self.published: list[object] = []
        self.requested: list[object] = []

    async def publish(self, subject: str, msg) -> None:
        self.published.append(msg)

    async def request(self, subject: str, msg, reply_type, timeout: float = 0.0):
        self.requested.append(msg)
        if isinstance(msg, m.AllocRequest):
            return m.AllocReply(region={"region_id": "D-buf"}, offset=0, nbytes=msg.blocks * msg.block_bytes)
        return m.Ok()

    def sent(self, kind: type) -> list:
        return [x for x in (*self.requested, *self.published) if isinstance(x, kind)]


def _report(engine: str, node: str, role: m.Role, incarnation: str) -> m.EngineReport:
    decode = role == m.Role.DECODE
    return m.EngineReport(
        engine_id=engine,
        role=int(role),
        node_id=node,
        seq=0,
        tok=0,
        free_hbm_tokens=100_000 if decode else 0,
        capacity_tokens=100_000 if decode else 0,
        block_bytes=4096,
        incarnation=incarnation,
    )


def _core(engine_timeout: float = 60.0) -> SchedulerCore:
    policy = get_policy("dualpath", Thresholds(alpha_tokens=1 << 22, beta_tokens=1 << 22))
    return SchedulerCore(policy, CoreConfig(engine_timeout=engine_timeout))


async def _leader(
    bus: FakeBus, core: SchedulerCore, tasks, decode: dict[str, str], prefill: m.EngineReport | None = None
) -> SchedulerShell:
    """The active scheduler "lead@7" with prefill engine p0 (node P; ``prefill``: its report)
    and ``decode`` (engine -> incarnation, node D) reported."""
    shell = SchedulerShell(bus, Subjects("t"), core, tasks, instance="lead@7")  # type: ignore[arg-type]
    await shell.on_engine_report(prefill or _report("p0", "P", m.Role.PREFILL, "p-1"))
    for engine, incarnation in decode.items():
        await shell.on_engine_report(_report(engine, "D", m.Role.DECODE, incarnation))
    return shell


async def _dispatched(bus: FakeBus) -> None:
    """Wait until the shell sent a prefill task."""
    with anyio.fail_after(5):
        while not bus.sent(m.PrefillTask):
            await asyncio.sleep(0.01)


def _submit(submission: int) -> m.SubmitRequest:
    """Request "r" as the gateway submits it the ``submission``-th time."""
    return m.SubmitRequest(
        request_id="r",
        model="m",
        model_digest=1,
        prompt_tokens=[1] * 100,
        block_hashes=[],
        hit_blocks=0,
        sampling={"max_tokens": 8},
        reply_subject=f"t.out.gw.r-s{submission}",
        submission=submission,
    )


def test_a_resubmitted_request_is_placed_with_attempts_after_the_dead_schedulers_and_a_restarted_engine_is_lost_at_once():
    bus = FakeBus()

    async def main() -> None:
        core = _core()
        async with anyio.create_task_group() as tasks:
            shell = await _leader(bus, core, tasks, {"d0": "d-1", "d1": "d-1b"})
            submit = _submit(2)  # the gateway's second resubmission (two failovers)
            stop = asyncio.Event()
            tasks.start_soon(shell.run, stop)  # its passes place the queue
            await shell.on_submit(submit)
            await _dispatched(bus)
            task = bus.sent(m.PrefillTask)[0]
            # its decode engine restarts under its name before the core found it silent
            await shell.on_engine_report(_report(task.decode_engine, "D", m.Role.DECODE, "restarted"))
            with anyio.fail_after(5):
                while len(bus.sent(m.PrefillTask)) < 2 or not bus.sent(m.FreeRequest):
                    await asyncio.sleep(0.01)
            stop.set()

    asyncio.run(main())
    alloc = bus.sent(m.AllocRequest)
    assert [(a.attempt, a.instance) for a in alloc[:2]] == [(2 * S, "lead@7"), (2 * S + 1, "lead@7")]
    first, second = bus.sent(m.PrefillTask)[:2]
    assert (first.attempt, second.attempt) == (2 * S, 2 * S + 1)
    lost = bus.sent(m.EngineLost)
    assert [(x.engine_id, x.incarnation) for x in lost] == [(first.decode_engine, "d-1" if first.decode_engine == "d0" else "d-1b")]
    # the dead scheduler's runs stop when the resubmission is accepted, then the restarted engine's attempt
    assert [c.before_attempt for c in bus.sent(m.CancelRequest)] == [2 * S, 2 * S + 1]
    assert [f.before_attempt for f in bus.sent(m.FreeRequest)] == [2 * S + 1]  # and its slot goes back


def test_a_submission_no_newer_than_one_already_run_here_is_refused_as_known():
    """After a failover the gateway resubmits a request whose first submit its dead scheduler
    never answered; if the late copy of that first submit reaches the new scheduler after the
    resubmission ran to its end, running it again would answer nobody: 409 (already held)."""
    from dualpath.bus import HandlerError

    bus = FakeBus()
    refused: list[int] = []

    async def main() -> None:
        core = _core()
        async with anyio.create_task_group() as tasks:
            shell = await _leader(bus, core, tasks, {"d0": "d-1"})
            stop = asyncio.Event()
            tasks.start_soon(shell.run, stop)
            await shell.on_submit(_submit(1))
            await _dispatched(bus)
            for engine, node, role in (("p0", "P", m.Role.PREFILL), ("d0", "D", m.Role.DECODE)):
                report = _report(engine, node, role, "p-1" if role == m.Role.PREFILL else "d-1")
                # reports name wire attempts: submission 0's attempt 0 is not this run's
                await shell.on_engine_report(replace(report, finished=["r"], finished_attempts=[0]))
                assert core.requests["r"].prefill_done == (role == m.Role.DECODE)  # nothing changed
                await shell.on_engine_report(replace(report, finished=["r"], finished_attempts=[S]))
                assert role == m.Role.DECODE or core.requests["r"].prefill_done
            assert "r" not in core.requests  # answered
            for submission in (0, 1):  # the late first submit, a duplicate of the one that ran
                try:
                    await shell.on_submit(_submit(submission))
                except HandlerError as exc:
                    refused.append(exc.code)
            assert "r" not in core.requests
            await shell.on_submit(_submit(2))  # a newer submission (another failover) runs
            assert "r" in core.requests
            stop.set()

    asyncio.run(main())
    assert refused == [409, 409]


def test_a_prefill_whose_failure_never_arrived_is_retried_once_its_engine_stops_listing_it():
    """The prefill engine dropped the task and its TaskFailed (published, at most once) was
    lost: its reports, which name what it holds in wire attempts, no longer list the task, and
    the scheduler places the request again instead of leaving it prefilling forever."""
    bus = FakeBus()

    async def main() -> None:
        p0 = replace(_report("p0", "P", m.Role.PREFILL, "p-1"), holding=[])
        d0 = _report("d0", "D", m.Role.DECODE, "d-1")
        async with anyio.create_task_group() as tasks:
            # 2 s: a stalled host that delays a report by less than that retries nothing
            shell = await _leader(bus, _core(engine_timeout=2.0), tasks, {"d0": "d-1"}, prefill=p0)
            stop = asyncio.Event()
            tasks.start_soon(shell.run, stop)
            await shell.on_submit(_submit(1))
            await _dispatched(bus)
            task = bus.sent(m.PrefillTask)[0]
            held = replace(p0, seq=1, holding=["r"], holding_attempts=[task.attempt])
            for _ in range(25):  # held for longer than the engine timeout: nothing happens
                await shell.on_engine_report(held)
                await shell.on_engine_report(d0)
                await asyncio.sleep(0.1)
            assert len(bus.sent(m.PrefillTask)) == 1
            with anyio.fail_after(5):
                while len(bus.sent(m.PrefillTask)) < 2:  # then it is gone from the reports
                    await shell.on_engine_report(p0)
                    await shell.on_engine_report(d0)
                    await asyncio.sleep(0.1)
            stop.set()

    asyncio.run(main())
    first, second = bus.sent(m.PrefillTask)[:2]
    assert (first.attempt, second.attempt) == (S, S + 1)
    # the first stops the runs of submission 0 (accepting a resubmission), the second the lost run, wherever it is
    assert [c.before_attempt for c in bus.sent(m.CancelRequest)] == [S, S + 1]
