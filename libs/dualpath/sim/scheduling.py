"""The scheduler as the simulator runs it: ``dualpath.core.SchedulerCore``, driven in virtual time.

The core is the scheduler service's own (events in, commands out; it runs the policy
library's passes); this driver does in virtual time what the service does over NATS:

- events in: ``RequestSubmitted`` for each turn; ``TimeAdvanced`` for a pass whenever
  something that could unblock the queue happened (a submission, a read, a prefill or a
  decode finished, a buffer freed), at most once per ``pass_interval_s``; ``SlotReserved`` or
  ``DispatchFailed(BUFFER_FULL)`` for each ``ReserveSlot`` (the decode node's DRAM buffer has
  room for the prompt's KV or not: back-pressure, as the traffic manager answers);
  ``DispatchAnswered`` for each ``Dispatch``; ``RequestFinished`` from the prefill engine and
  from the decode engine; ``NodeReported`` with each node's storage read queue and free
  buffer, at start and then every ``report_interval_s`` for the nodes whose queue or slots
  changed (the traffic managers' reports; the policy ranks decode nodes without room last);
- commands out: ``ReserveSlot``, ``Dispatch`` (handed to the cluster), ``FreeSlot``,
  ``FailRequest`` and ``RejectRequest`` (counted; a failed turn ends its agent).

The pass window (``SchedulerCore.pass_window``, from ``CoreConfig.pass_window``: how much
of the queue a pass hands the policy, which places a FIFO prefix of it) adapts: it doubles while passes place all of it
(another pass follows at once) and shrinks to twice what the last pass placed otherwise, so
a pass costs in proportion to what it can place. Decisions do not change: the policy never
reaches the requests beyond a prefix it cannot place.

Engines join with one ``EngineReported`` at start and do not report again: in virtual time
the core's own charges are exact (nothing is lost or delayed), so reports would only repeat
them. Engine expiry is off (no engine dies in a simulation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from dualpath.core.scheduler import CoreConfig, SchedulerCore
from dualpath.core.scheduler_events import (
    BUFFER_FULL,
    Dispatch,
    DispatchAnswered,
    DispatchFailed,
    EngineReported,
    FailRequest,
    FreeSlot,
    NodeReported,
    Prefetch,
    RejectRequest,
    RequestFinished,
    RequestSubmitted,
    ReserveSlot,
    SlotReserved,
    Stage,
    TimeAdvanced,
)
from dualpath.policy import Policy, Role
from dualpath.sim.clock import EventLoop
from dualpath.sim.request import SimRequest
from dualpath.sim.storage import NodeStorage

__all__ = ["SimScheduler"]

WINDOW_MIN: Final = 4
WINDOW_MAX: Final = 512


class SimScheduler:
    """Drives a ``SchedulerCore`` (module docstring). ``reserve(node, rid, nbytes)`` answers a
    slot request (True: reserved), ``free(node, rid)`` releases one, ``dispatch(req, cmd)`` starts
    a placed request, ``failed(req, reason)`` ends one."""

    def __init__(
        self,
        loop: EventLoop,
        policy: Policy,
        *,
        interval: float,
        report_interval: float,
        reserve: Callable[[str, str, float], bool],
        free: Callable[[str, str], None],
        dispatch: Callable[[SimRequest, Dispatch], None],
        failed: Callable[[SimRequest, str], None],
        prefetch: Callable[[SimRequest, str], None] | None = None,
    ) -> None:
        self.loop = loop
        self.core = SchedulerCore(
            policy,
            CoreConfig(
                engine_timeout=float("inf"),
                max_queue=1 << 40,
                pass_window=WINDOW_MIN,
                buffer_wait_s=float("inf"),
                prefetch=prefetch is not None,
            ),
        )
        self._prefetch = prefetch  # agent-aware prefetch: the core's Prefetch(node) for a finished turn
        self.interval, self.report_interval = interval, report_interval
        self._reserve, self._free, self._dispatch, self._failed = reserve, free, dispatch, failed
        self._scheduled = False
        self._last_pass = -1.0
        self._dirty: dict[str, NodeStorage] = {}  # nodes whose read queue or slots changed since the last report
        self._report_scheduled = False
        self.passes = 0
        self.back_pressure = 0
        self.failures = 0

    def join(self, engine: str, node: str, role: Role, *, capacity_tokens: int, block_bytes: int) -> None:
        """An engine's first report (its figures are all charges from then on)."""
        self.core.handle(
            EngineReported(
                now=self.loop.now,
                engine=engine,
                node=node,
                role=role,
                seq=0,
                tok=0,
                free_hbm_tokens=capacity_tokens,
                capacity_tokens=capacity_tokens,
                block_bytes=block_bytes,
            )
        )

    def submit(self, req: SimRequest, block_tokens: int) -> None:
        cmds = self.core.handle(
            RequestSubmitted(
                now=self.loop.now,
                request_id=req.key,
                prompt_tokens=req.prompt,
                hit_blocks=req.hit // block_tokens,
                block_tokens=block_tokens,
                max_tokens=req.gen,
                payload=req,
                session=str(req.agent.index),  # as the load generator's X-Session-ID: the queue order learns from it
            )
        )
        for cmd in cmds:
            if isinstance(cmd, RejectRequest):
                self.failures += 1
                self._failed(req, f"{cmd.code} {cmd.reason}")
                return
        self.kick()

    def kick(self, _: object = None) -> None:
        """Something changed: run a pass soon (coalesced)."""
        if self._scheduled or not self.core.queue:
            return
        self._scheduled = True
        self.loop.at(max(self.loop.now, self._last_pass + self.interval), self._pass)

    def _pass(self, _: object = None) -> None:
        self._scheduled = False
        self._last_pass = self.loop.now
        self.passes += 1
        core = self.core
        before, refused = len(core.queue), self.back_pressure
        if self.loop.now >= core.held_until:
            cmds = core.handle(TimeAdvanced(now=self.loop.now))
            if cmds:
                self._apply(cmds)
        # else: paused by back-pressure, the pass would place nothing (and with engine expiry
        # off, TimeAdvanced would change nothing else): skip the event, keep its timing
        placed = before - len(core.queue)
        window = core.pass_window
        if placed >= window and core.queue and self.back_pressure == refused:
            core.pass_window = min(WINDOW_MAX, 2 * window)
            self._scheduled = True
            self.loop.at(self.loop.now, self._pass)
        else:
            core.pass_window = max(WINDOW_MIN, min(WINDOW_MAX, 2 * placed))

    def _apply(self, cmds: list) -> None:
        handle, now = self.core.handle, self.loop.now
        for cmd in cmds:
            if isinstance(cmd, ReserveSlot):
                nbytes = cmd.blocks * cmd.block_bytes
                if self._reserve(cmd.node, cmd.request_id, nbytes):
                    self._apply(handle(SlotReserved(now=now, request_id=cmd.request_id, attempt=cmd.attempt)))
                else:
                    self.back_pressure += 1
                    self._apply(
                        handle(
                            DispatchFailed(
                                now=now,
                                request_id=cmd.request_id,
                                attempt=cmd.attempt,
                                stage=Stage.RESERVE,
                                reason="decode node buffer full",
                                code=BUFFER_FULL,
                            )
                        )
                    )
                    self.loop.at(now + self.core.cfg.buffer_backoff_s, self.kick)
            elif isinstance(cmd, Dispatch):
                handle(DispatchAnswered(now=now, request_id=cmd.request_id, attempt=cmd.attempt))
                self._dispatch(cmd.payload, cmd)
            elif isinstance(cmd, FreeSlot):
                self._free(cmd.node, cmd.request_id)
            elif isinstance(cmd, FailRequest):
                self.failures += 1
                self._failed(cmd.payload, f"{cmd.code} {cmd.reason}")
            elif isinstance(cmd, Prefetch) and self._prefetch is not None:
                self._prefetch(cmd.payload, cmd.node)

    # -- what engines and nodes tell it ----------------------------------------------------
    def finished(self, req: SimRequest, engine: str) -> None:
        """``engine`` finished its part of ``req`` (prefill: handed over; decode: done)."""
        cmds = self.core.handle(RequestFinished(now=self.loop.now, request_id=req.key, engine=engine))
        if cmds:  # a Prefetch hint (the only command a finish gives here)
            self._apply(cmds)
        self.kick()

    def node_changed(self, node: NodeStorage) -> None:
        """A node's storage read queue or buffer slots changed; it reports at the next report tick."""
        self._dirty[node.name] = node
        if not self._report_scheduled:
            self._report_scheduled = True
            self.loop.at(self.loop.now + self.report_interval, self._report)

    def report(self, node: NodeStorage) -> None:
        """The node's traffic manager reports now (its first report: the buffer's size)."""
        free, total = node.buffer_report()
        self.core.handle(
            NodeReported(now=self.loop.now, node=node.name, read_q_tokens=node.read_q, buffer_free_bytes=free, buffer_bytes=total)
        )

    def _report(self, _: object = None) -> None:
        self._report_scheduled = False
        dirty, self._dirty = self._dirty, {}
        for node in dirty.values():
            self.report(node)
        self.kick()
