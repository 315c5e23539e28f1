"""A decode engine in virtual time, with decode steps aggregated between membership changes.

Admission, steps and finishes are the engine's own core,
``dualpath.core.decode_batcher.DecodeBatcher``: a prefilled request waits there until its
whole footprint (prompt + generation, in blocks) fits the engine's KV memory, FIFO; once
admitted it runs ``steps_left`` steps (its decode steps, and a flush step when its final
token completes a block, as the decode engine runs them); when it leaves, ``run_steps``
accounts those steps at once and releases it, and the blocks it reports filled are the ones
persisted. The per-token ``next_step``/``finish_step`` loop is not driven one step at a time,
which would make event volume grow with tokens generated.

Between two membership changes (a request joins or leaves) every running request gains one
token per step, so the step time is a function of progress ``x`` (steps since the engine
started, fractional: the batch is a fluid): with ``n`` requests, ``keys(x) = K + n x``
(``K = Σ (prompt_i + 1 - x_join_i)``) and, under sparse attention, ``attended(x) =
sat * top_k + Σ_below min(v_i + x, top_k)``. ``CostModel.decode_step_time_totals`` turns
those sums into seconds in O(1). Step time is close to linear in ``x`` over a segment (the
roofline is a max of linear terms), so ``s(x) = a + b (x - x0)`` with ``b`` the secant to
the next leave, and the time for ``m`` steps is ``a m + b m^2 / 2`` — exact at the
segment's ends when nothing joins. A join or leave settles progress by inverting that
quadratic. Events per request: one join, one leave, whatever the number of tokens.
"""

from __future__ import annotations

import math
from typing import Protocol, cast

from dualpath.core.decode_batcher import DecodeBatcher
from dualpath.cost.model import CostModel
from dualpath.sim.clock import Deadline, EventLoop
from dualpath.sim.config import SimConfig
from dualpath.sim.minheap import Entry, MinHeap
from dualpath.sim.network import Link
from dualpath.sim.request import SimRequest

__all__ = ["DecodeEngineSim", "DecodeHost"]


class _Running(Entry):
    """A request in the batch: its last step ``end`` (progress), its place among equal ends
    (``seq``: admission order) and ``v``, its keys at progress 0 (``prompt + 1 - x_join``)."""

    __slots__ = ("req", "v")

    def __init__(self, end: float, seq: int, req: SimRequest, v: int) -> None:
        self.end = end
        self.seq = seq
        self.req = req
        self.v = v


class DecodeHost(Protocol):
    """What a decode engine needs of its simulation (``Simulation``, or a test's stub: a
    protocol, so the mypyc build checks no concrete class here)."""

    loop: EventLoop
    decode_cost: CostModel
    cfg: SimConfig

    def decode_done(self, req: SimRequest, de: DecodeEngineSim) -> None: ...


class DecodeEngineSim:
    """One decode GPU: its admission core, CNIC links and the fluid decode batch."""

    __slots__ = (
        "_seq",
        "_step_totals",
        "a",
        "b",
        "batcher",
        "below",
        "busy_s",
        "cnic_in",
        "cnic_out",
        "engine_id",
        "heap",
        "host_per_request_s",
        "host_s",
        "keys0",
        "leave",
        "loop",
        "n",
        "name",
        "node_id",
        "progress",
        "sat",
        "sim",
        "t",
        "topk",
        "waiting",
    )

    def __init__(self, sim: DecodeHost, engine_id: int, name: str, node_id: int, cnic_in: Link, cnic_out: Link, hbm_tokens: int) -> None:
        self.sim = sim
        self.engine_id, self.name, self.node_id = engine_id, name, node_id
        self.cnic_in, self.cnic_out = cnic_in, cnic_out
        self.batcher = DecodeBatcher(capacity_tokens=hbm_tokens, block_tokens=sim.cfg.block_tokens, max_running=sim.cfg.max_running)
        self.waiting: dict[str, SimRequest] = {}
        self.topk = sim.decode_cost.target.sparse_topk
        self.loop = sim.loop
        self._step_totals = sim.decode_cost.decode_step_time_totals
        self.host_s, self.host_per_request_s = sim.cfg.decode_host_s, sim.cfg.decode_host_per_request_s
        self.progress = 0.0  # steps since start (fluid)
        self.t = 0.0  # virtual time of ``progress``
        self.n = 0
        self.keys0 = 0  # Σ (prompt + 1 - x_join)
        self.sat = 0  # requests attending top_k keys (sparse attention)
        self.below: dict[str, int] = {}  # requests still under top_k: v = prompt + 1 - x_join
        self.heap = MinHeap()  # the batch (_Running) by (last step, admission)
        self._seq = 0
        self.a = 0.0  # step time at ``progress``
        self.b = 0.0  # its slope per step over the current segment
        self.leave = Deadline(self.loop, self._leave)  # the next leave (a join makes it later: no stale event)
        self.busy_s = 0.0

    # -- step time ---------------------------------------------------------------------
    def step_time(self, x: float) -> float:
        n = self.n
        if not n:
            return 0.0
        xi = int(x)
        keys = self.keys0 + n * xi
        topk = self.topk
        if topk:
            attended = self.sat * topk
            if self.below:  # most requests attend top_k keys from their first step
                attended += sum(min(v + xi, topk) for v in self.below.values())
        else:
            attended = keys
        step = self._step_totals(n, keys, attended)
        if self.host_s or self.host_per_request_s:  # host time per step (SimConfig.decode_host_s)
            step += self.host_s + self.host_per_request_s * n
        return step

    def _settle(self) -> None:
        now = self.loop.now
        dt = now - self.t
        if dt > 0 and self.n:
            a, b = self.a, self.b
            # a·d + b·d²/2 = dt, in the form that is stable for b -> 0
            d = 2 * dt / (a + math.sqrt(a * a + 2 * b * dt)) if a > 0 else 0.0
            self.progress += d
            self.busy_s += dt
            if self.below:
                self._saturate()
        self.t = now

    def _saturate(self) -> None:
        x, topk = self.progress, self.topk
        done = [k for k, v in self.below.items() if v + x >= topk]
        for k in done:
            del self.below[k]
            self.sat += 1

    def _reschedule(self) -> None:
        if not self.n:
            self.a = self.b = 0.0
            self.leave.clear()
            return
        x = self.progress
        m = self.heap.items[0].end - x
        self.a = a = self.step_time(x)
        if m > 1:
            self.b = b = max(0.0, (self.step_time(x + m) - a) / m)
        else:
            m, b = max(m, 0.0), 0.0
            self.b = 0.0
        self.leave.set(self.loop.now + a * m + b * m * m / 2)

    # -- membership ----------------------------------------------------------------------
    def add(self, req: SimRequest) -> None:
        """A prefilled request's KV is in this engine's HBM (or waits for room there)."""
        self._settle()
        self.waiting[req.key] = req
        self.batcher.add(req.key, prompt_tokens=req.prompt, max_tokens=req.gen)
        joined = self._admit()
        self._reschedule()
        for r in joined:
            r.ttst = self.loop.now - r.t_first + self.a  # the hand-off (HBM copy, admission) and its first step

    def _admit(self) -> list[SimRequest]:
        joined = []
        x = self.progress
        for key in self.batcher.admit():
            req = self.waiting.pop(key)
            v = req.prompt + 1 - int(x)
            self.n += 1
            self.keys0 += v
            if self.topk and req.prompt + 1 < self.topk:
                self.below[key] = v
            else:
                self.sat += 1
            self._seq += 1
            self.heap.push(_Running(x + self.batcher.steps_left(key), self._seq, req, v))
            joined.append(req)
        return joined

    def _leave(self) -> None:
        self._settle()
        heap = self.heap.items
        if heap and self.progress < heap[0].end:
            self.progress = heap[0].end  # this event is that request's last step
        done = []
        while heap and heap[0].end <= self.progress + 1e-6:
            m = cast("_Running", self.heap.pop())
            req = m.req
            self.n -= 1
            self.keys0 -= m.v
            if self.below.pop(req.key, None) is None:
                self.sat -= 1
            out = self.batcher.run_steps(req.key, self.batcher.steps_left(req.key))
            req.kv_blocks = out.filled[-1][1] + 1 if out.filled else 0
            done.append(req)
        joined = self._admit()
        self._reschedule()
        for r in joined:
            r.ttst = self.loop.now - r.t_first + self.a  # the hand-off (HBM copy, admission) and its first step
        for req in done:
            self.sim.decode_done(req, self)
