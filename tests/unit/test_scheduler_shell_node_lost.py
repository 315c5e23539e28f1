"""The scheduler service turns a task failure caused by a dead traffic manager
(``TaskFailed.node_unreachable``) into the core's "node down" event: on a 1P1D cluster the
request waits in the queue for the node's next report instead of burning its attempts on the
node while it restarts (the soak run saw three attempts used in ~80 ms, then a 503)."""

from __future__ import annotations

import asyncio

import anyio

from dualpath.core import CoreConfig, SchedulerCore, TimeAdvanced
from dualpath.policy import Thresholds, get_policy
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from services.scheduler.shell import SchedulerShell
from tests.unit.test_scheduler_shell_attempts import FakeBus, _report

REASON = "KV load failed: traffic manager of node P lost the load: no service listens"


def _node(node: str) -> m.NodeReport:
    return m.NodeReport(node_id=node, read_q_tokens=0, read_q_bytes=0, buffer_free_bytes=1 << 30, buffer_bytes=1 << 30)


class _CountingCore:
    """The core, counting the ticks (``TimeAdvanced``: a scheduling pass each) the shell drives."""

    def __init__(self, core: SchedulerCore) -> None:
        self._core, self.ticks = core, 0

    def handle(self, event):
        if isinstance(event, TimeAdvanced):
            self.ticks += 1
        return self._core.handle(event)

    def __getattr__(self, name: str):
        return getattr(self._core, name)


async def _until(cond, seconds: float = 5.0) -> None:
    with anyio.fail_after(seconds):
        while not cond():
            await asyncio.sleep(0.01)


def test_a_task_failed_by_a_dead_traffic_manager_waits_for_its_node_to_report_again_and_each_loss_uses_one_attempt():
    bus = FakeBus()
    quiet: list[int] = []

    async def main() -> None:
        policy = get_policy("dualpath", Thresholds(alpha_tokens=1 << 22, beta_tokens=1 << 22))
        core = _CountingCore(SchedulerCore(policy, CoreConfig(engine_timeout=60.0, max_attempts=3)))
        async with anyio.create_task_group() as tasks:
            shell = SchedulerShell(bus, Subjects("t"), core, tasks, instance="s1")  # type: ignore[arg-type]
            await shell.on_engine_report(_report("pe0", "P", m.Role.PREFILL, "p-1"))
            await shell.on_engine_report(_report("de0", "D", m.Role.DECODE, "d-1"))
            await shell.on_node_report(_node("P"))
            await shell.on_node_report(_node("D"))
            stop = asyncio.Event()
            tasks.start_soon(shell.run, stop)
            await shell.on_submit(
                m.SubmitRequest(
                    request_id="r",
                    model="m",
                    model_digest=1,
                    prompt_tokens=[1] * 100,
                    block_hashes=[],
                    hit_blocks=0,
                    sampling={"max_tokens": 8},
                    reply_subject="t.out.gw.r",
                )
            )
            for n in range(1, 3):  # the node's traffic manager dies under the task, twice in a row
                await _until(lambda n=n: len(bus.sent(m.PrefillTask)) == n)
                await shell.on_task_failed(m.TaskFailed(request_id="r", engine_id="pe0", reason=REASON, node_unreachable="P"))
                ticks = core.ticks
                await _until(lambda ticks=ticks: core.ticks >= ticks + 6)  # six passes: nothing is placed while P is down, nothing fails
                quiet.append((len(bus.sent(m.PrefillTask)), len(bus.sent(m.TokenEvent))))
                await shell.on_node_report(_node("P"))  # its traffic manager is back
            # each loss counted as an attempt (as a reservation the node did not answer is): a third ends it
            await _until(lambda: len(bus.sent(m.PrefillTask)) == 3)
            await shell.on_task_failed(m.TaskFailed(request_id="r", engine_id="pe0", reason=REASON, node_unreachable="P"))
            await _until(lambda: bool(bus.sent(m.TokenEvent)))
            stop.set()

    asyncio.run(main())
    assert quiet == [(1, 0), (2, 0)]
    [error] = bus.sent(m.TokenEvent)
    assert error.finish_reason == "error" and "after 3 attempts" in error.error
    assert [t.attempt for t in bus.sent(m.PrefillTask)] == [0, 1, 2]
