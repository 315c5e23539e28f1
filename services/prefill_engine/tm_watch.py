"""A load awaited from a traffic manager fails fast when that traffic manager dies.

``TIMEOUTS.tm_load`` (120 s) bounds a *live* traffic manager's answer: a load waits behind the
node's read queue. It cannot be the detector of a *dead* one, whose load is simply gone. So
while a load is awaited, its traffic manager is asked every ``PROBE_PERIOD_S`` whether it
still runs the load (``LoadProbe``; only once the load took that long, so a quick load costs
nothing). The load is given up, with ``TrafficManagerLost``, when:

- nobody serves the node's traffic manager (``no_responders``: the process is gone);
- it answers twice in a row that the load is not running there (it restarted: the new
  process never had it; twice, so a load whose answer is already on its way, or whose
  handler has not started yet, is not mistaken for a lost one);
- it leaves ``SILENT_PROBES`` probes in a row unanswered (hung, e.g. SIGSTOP'ed).

The error names the node, so the scheduler can stop placing work on it until it reports
again (``TaskFailed.node_unreachable``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from dualpath.bus import Bus, BusTimeoutError
from dualpath.protocol import RemoteError
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Subjects
from dualpath.protocol.timeouts import TIMEOUTS

__all__ = ["PROBE_PERIOD_S", "SILENT_PROBES", "TrafficManagerLost", "await_load", "lost_load"]

T = TypeVar("T")
PROBE_PERIOD_S = 1.0  # how often a load in flight is checked on
SILENT_PROBES = 3  # unanswered probes in a row (each waits TIMEOUTS.tm_probe) that give the load up
_GONE_ANSWERS = 2  # "not running here" answers in a row that give the load up


class TrafficManagerLost(Exception):
    """Raised by ``await_load`` when the traffic manager of ``node`` died or restarted while it
    owned the load (``why`` says how this was found): its answer will never come."""

    def __init__(self, node: str, why: str) -> None:
        super().__init__(f"traffic manager of node {node} lost the load: {why}")
        self.node = node
        self.why = why


def lost_load(exc: BaseException) -> TrafficManagerLost | None:
    """The ``TrafficManagerLost`` in ``exc`` (itself, or inside a split read's exception group)."""
    if isinstance(exc, TrafficManagerLost):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = lost_load(sub)
            if found is not None:
                return found
    return None


async def await_load(
    bus: Bus, subjects: Subjects, node: str, req: m.LoadRequest, call: Callable[[], Awaitable[T]], *, period: float = PROBE_PERIOD_S
) -> T:
    """Await ``call()`` (``req`` sent to ``node``'s traffic manager) while checking on it.

    Raises:
        TrafficManagerLost: the traffic manager died or restarted (see the module docstring),
            or nobody served it when ``call`` was made.
        Exception: whatever ``call()`` raises otherwise.
    """
    lost: list[str] = []
    result: list[T] = []
    failure: list[Exception] = []  # raised after the task group (inside it, anyio would wrap it in a group)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_watch, bus, subjects, node, req, period, lost, tg.cancel_scope)
        try:
            result.append(await call())
        except BusTimeoutError as exc:
            failure.append(TrafficManagerLost(node, "no service listens") if exc.no_responders else exc)
        except Exception as exc:  # noqa: BLE001 - the caller's to handle, unchanged
            failure.append(exc)
        finally:
            tg.cancel_scope.cancel()  # the watch ends with the call
    if failure:
        raise failure[0]
    if not result:
        raise TrafficManagerLost(node, lost[0] if lost else "cancelled")
    return result[0]


async def _watch(bus: Bus, subjects: Subjects, node: str, req: m.LoadRequest, period: float, lost: list[str], scope) -> None:
    """Probe until the load is found lost, then record why and cancel ``scope`` (the call)."""
    probe = m.LoadProbe(request_id=req.request_id, attempt=req.attempt)
    gone = silent = 0
    while True:
        await anyio.sleep(period)
        try:
            reply = await bus.request(subjects.tm(node, "probe"), probe, m.LoadProbeReply, timeout=TIMEOUTS.tm_probe)
        except BusTimeoutError as exc:
            if exc.no_responders:
                lost.append("no service listens (it died)")
                break
            silent += 1
            if silent >= SILENT_PROBES:
                lost.append(f"{silent} probes in a row unanswered")
                break
            continue
        except RemoteError:  # it answered (busy): alive
            silent = 0
            continue
        silent = 0
        gone = 0 if reply.running else gone + 1
        if gone >= _GONE_ANSWERS:
            lost.append("it no longer runs the load (restarted)")
            break
    scope.cancel()
