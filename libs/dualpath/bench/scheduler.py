"""Scheduler benchmark (a benchmark, not a test): the whole scheduler core at the paper's
load, on one core.

Cluster: ``engines`` GPUs as 1P:2D groups of 8-GPU nodes (1,152 = 48 groups: 384 PEs and
768 DEs; 10,008 = 417 groups). Load: the paper's per-GPU request rate. Its largest online
run serves 8.8 agents/s on 1,152 GPUs, each agent running 157 turns back to back (the 64K
set's average); by Little's law that is 8.8 × 157 = 1,381.6 requests/s, 1.1993 per GPU,
so 12,003 requests/s at 10,008 GPUs.

Every event the service would feed the core arrives at its real rate, in virtual time
stepped every ``tick_s``:

- ``RequestSubmitted``: Poisson arrivals at the per-GPU rate;
- ``EngineReported`` from every engine and ``NodeReported`` from every node every 0.2 s
  (phases spread evenly), carrying the fake engines' seq_e/tok_e/free HBM/read_q and the
  requests they finished since their previous report;
- ``SlotReserved`` and ``DispatchAnswered`` one tick after each ``ReserveSlot`` /
  ``Dispatch`` command;
- ``TimeAdvanced`` once per tick (the service ticks whenever a message arrived).

The fake cluster behind the commands: a read takes its node's storage NIC (FIFO, 400
Gbps, DeepSeek-V3.2 KV bytes per token), a prefill its PE's compute (FIFO, 10,000 miss
tokens/s), a decode ``gen × TPOT``. Only the core is timed: the CPU time of the calling
thread (``thread_time_ns``) around each tick's batch of ``core.handle`` calls, so other
processes on a shared machine do not inflate it. ``requests_per_s`` = requests submitted
in the measured window / core CPU seconds spent in it: the rate one core could sustain
with this event mix. ``core_utilisation`` = core CPU seconds / virtual seconds at the
offered load (below 1.0: one core keeps up). The garbage collector runs with the
thresholds the scheduler service sets (``dualpath.core.GC_THRESHOLDS``).
"""

from __future__ import annotations

import gc
import platform
import random
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass

from dualpath.core import (
    GC_THRESHOLDS,
    CoreConfig,
    Dispatch,
    DispatchAnswered,
    EngineReported,
    FailRequest,
    NodeReported,
    RequestSubmitted,
    ReserveSlot,
    SchedulerCore,
    SlotReserved,
    TimeAdvanced,
    tune_gc,
)
from dualpath.kv.hits import readable_hit_blocks
from dualpath.policy.errors import InvalidTopologyError
from dualpath.policy.registry import get_policy
from dualpath.policy.thresholds import Thresholds
from dualpath.policy.values import Role

__all__ = ["PAPER_REQUESTS_PER_GPU_S", "BenchWorkload", "format_report", "run_bench", "validate_engines"]

_BLOCK = 64
_GPUS_PER_NODE = 8
_GROUP_GPUS = 3 * _GPUS_PER_NODE  # one prefill node and two decode nodes
_KV_BYTES_PER_TOKEN = 656 * 61  # DeepSeek-V3.2, FP8 MLA (dualpath.cost.targets)
_SNIC_BYTES_PER_S = 50e9  # 400 Gbps storage NIC per node
_PREFILL_TOKENS_PER_S = 10_000.0  # miss tokens one GPU prefills per second (assumed)
_DECODE_HBM_TOKENS = 800_000  # KV capacity per decode GPU (assumed, ~40 GB at 48 KB/token)
_REPORT_S = 0.2  # engines and traffic managers report every 0.2 s
PAPER_REQUESTS_PER_GPU_S = 8.8 * 157 / 1152  # the paper's largest online load per GPU


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchWorkload:
    """Request shape (the 64K trace's averages, PAPER.md) and the per-GPU request rate."""

    requests_per_gpu_s: float = PAPER_REQUESTS_PER_GPU_S
    context_tokens: int = 32_721
    append_tokens: int = 429
    gen_tokens: int = 176
    tpot_s: float = 0.036


def validate_engines(engines: int) -> None:
    """Raises InvalidTopologyError unless ``engines`` is a positive multiple of 24."""
    if engines < _GROUP_GPUS or engines % _GROUP_GPUS:
        raise InvalidTopologyError(
            f"--engines {engines}: need a positive multiple of {_GROUP_GPUS} "
            f"(groups of one prefill and two decode nodes of {_GPUS_PER_NODE} GPUs), e.g. 1152 or 10008"
        )


def run_bench(
    engines: int = 1152,
    seconds: float = 10.0,
    seed: int = 0,
    *,
    policy: str = "dualpath",
    warmup_s: float = 8.0,
    tick_s: float = 0.001,
    workload: BenchWorkload = BenchWorkload(),
) -> dict:
    """Drive a ``SchedulerCore`` for ``warmup_s + seconds`` virtual seconds; JSON-ready figures.

    Raises:
        InvalidTopologyError: ``engines`` is not a positive multiple of 24.
        UnknownPolicyError: unknown ``policy``.
        ValueError: ``seconds`` or ``tick_s`` not positive, or ``warmup_s`` negative.
    """
    validate_engines(engines)
    if not seconds > 0 or not tick_s > 0 or warmup_s < 0:
        raise ValueError(f"need seconds > 0, tick > 0 and warmup >= 0 (got {seconds}, {tick_s}, {warmup_s})")
    thresholds = Thresholds.from_profile(
        snic_bytes_per_s=_SNIC_BYTES_PER_S, kv_bytes_per_token=_KV_BYTES_PER_TOKEN, prefill_tokens_per_s=_PREFILL_TOKENS_PER_S
    )
    core = SchedulerCore(get_policy(policy, thresholds), CoreConfig(max_queue=1 << 30))
    previous_gc = tune_gc()  # as the scheduler service runs it
    try:
        sim = _FakeCluster(core, engines, workload, random.Random(seed), tick_s)
        wall0 = time.perf_counter()
        sim.run(warmup_s, record=False)
        sim.run(seconds, record=True)
        wall = time.perf_counter() - wall0
    finally:
        gc.set_threshold(*previous_gc)
    core_s = sim.core_ns / 1e9
    groups = engines // _GROUP_GPUS
    return {
        "engines": engines,
        "topology": f"{groups}P{2 * groups}D x {_GPUS_PER_NODE} GPUs",
        "policy": policy,
        "offered_requests_per_s": workload.requests_per_gpu_s * engines,
        "rate_derivation": f"8.8 agents/s x 157 turns / 1152 GPUs = {workload.requests_per_gpu_s:.4f} requests/s per GPU",
        "virtual_seconds": seconds,
        "warmup_seconds": warmup_s,
        "tick_s": tick_s,
        "submitted": sim.submitted,
        "finished": sim.finished,
        "failed": sim.failed,
        "events_per_s": {k: v / seconds for k, v in sorted(sim.events.items())},
        "commands_per_s": {k: v / seconds for k, v in sorted(sim.commands.items())},
        "mean_in_flight": sim.in_flight_sum / max(1, sim.steps_recorded),
        "max_queued": sim.max_queued,
        "core_cpu_seconds": core_s,
        "requests_per_s": sim.submitted / core_s if core_s else 0.0,
        "core_utilisation": core_s / seconds,
        "aim_requests_per_s": 12_000,
        "wall_seconds": wall,
        "python": platform.python_version(),
        "gc_thresholds": list(GC_THRESHOLDS),
        "workload": asdict(workload),
        "alpha_tokens": thresholds.alpha_tokens,
        "beta_tokens": thresholds.beta_tokens,
    }


class _FakeCluster:
    """Engines and traffic managers that answer the core's commands in virtual time."""

    def __init__(self, core: SchedulerCore, engines: int, w: BenchWorkload, rng: random.Random, tick_s: float) -> None:
        self.core, self.w, self.rng, self.tick = core, w, rng, tick_s
        self.rate = w.requests_per_gpu_s * engines
        groups = engines // _GROUP_GPUS
        nodes = 3 * groups
        self.node_names = [f"n{j}" for j in range(nodes)]
        self.names = [f"e{i}" for i in range(engines)]
        self.node_of = [i // _GPUS_PER_NODE for i in range(engines)]
        self.decode = [self.node_of[i] % 3 != 0 for i in range(engines)]  # node 3g prefill, 3g+1 and 3g+2 decode
        self.index = {name: i for i, name in enumerate(self.names)}
        self.node_index = {name: j for j, name in enumerate(self.node_names)}
        self.seq = [0] * engines
        self.tok = [0] * engines
        self.free = [_DECODE_HBM_TOKENS if d else 0 for d in self.decode]
        self.done: list[list[str]] = [[] for _ in range(engines)]
        self.read_q = [0] * nodes
        self.snic_free_at = [0.0] * nodes
        self.pe_free_at = [0.0] * engines
        self.read_rate = _SNIC_BYTES_PER_S / _KV_BYTES_PER_TOKEN  # tokens/s per node
        period = max(1, round(_REPORT_S / tick_s))
        self.period = period
        self.engine_phase: list[list[int]] = [[] for _ in range(period)]
        for i in range(engines):
            self.engine_phase[i * period // engines].append(i)
        self.node_phase: list[list[int]] = [[] for _ in range(period)]
        for j in range(nodes):
            self.node_phase[j * period // nodes].append(j)
        self.later: defaultdict[int, list[tuple]] = defaultdict(list)  # step -> things that happen then
        self.shape: dict[str, tuple[int, int, int, int]] = {}  # request -> (miss, hit, total, gen)
        self.step = 0
        self.next_rid = 0
        self.next_arrival = rng.expovariate(self.rate)
        self.answers: list = []  # events for the next tick (answers to this tick's commands)
        self.core_ns = 0
        self.submitted = self.finished = self.failed = self.max_queued = self.in_flight_sum = self.steps_recorded = 0
        self.events: Counter[str] = Counter()
        self.commands: Counter[str] = Counter()
        # Every engine and node introduces itself at time 0 (membership is built once).
        hello = [self._report(i, 0.0) for i in range(engines)] + [NodeReported(now=0.0, node=n, read_q_tokens=0) for n in self.node_names]
        for ev in hello:
            core.handle(ev)

    def _report(self, i: int, now: float) -> EngineReported:
        done = self.done[i]
        self.done[i] = []
        decode = self.decode[i]
        role = Role.DECODE if decode else Role.PREFILL
        return EngineReported(
            now=now,
            engine=self.names[i],
            node=self.node_names[self.node_of[i]],
            role=role,
            seq=self.seq[i],
            tok=self.tok[i],
            free_hbm_tokens=self.free[i],
            capacity_tokens=_DECODE_HBM_TOKENS if decode else 0,
            block_bytes=_KV_BYTES_PER_TOKEN * _BLOCK,
            finished=tuple(done),
        )

    def _arrivals(self, now: float, events: list) -> None:
        w, rng = self.w, self.rng
        while self.next_arrival < now:
            context = rng.randrange(0, 2 * w.context_tokens)
            prompt = context + rng.randint(w.append_tokens // 2, 3 * w.append_tokens // 2)
            gen = rng.randint(w.gen_tokens // 2, 3 * w.gen_tokens // 2)
            rid = f"r{self.next_rid}"
            self.next_rid += 1
            hit = readable_hit_blocks(prompt, context // _BLOCK, _BLOCK) * _BLOCK
            self.shape[rid] = (prompt - hit, hit, prompt + gen, gen)
            events.append(
                RequestSubmitted(
                    now=now, request_id=rid, prompt_tokens=prompt, hit_blocks=context // _BLOCK, block_tokens=_BLOCK, max_tokens=gen
                )
            )
            self.next_arrival += rng.expovariate(self.rate)

    def _due(self, now: float) -> None:
        """What the fake cluster finishes in this tick (reads, prefills, decodes)."""
        for item in self.later.pop(self.step, ()):
            kind = item[0]
            if kind == 0:  # read done on node j
                self.read_q[item[1]] -= item[2]
            elif kind == 1:  # prefill done: PE -> DE
                _, rid, pe, de = item
                miss, _hit, total, gen = self.shape[rid]
                self.seq[pe] -= 1
                self.tok[pe] -= miss
                self.done[pe].append(rid)
                self.seq[de] += 1
                self.tok[de] += total
                self.free[de] -= total
                self._at(now + gen * self.w.tpot_s, (2, rid, de))
            else:  # decode done
                _, rid, de = item
                _miss, _hit, total, _gen = self.shape.pop(rid)
                self.seq[de] -= 1
                self.tok[de] -= total
                self.free[de] += total
                self.done[de].append(rid)
                self.finished += 1

    def _at(self, t: float, item: tuple) -> None:
        self.later[max(self.step + 1, int(t / self.tick))].append(item)

    def _run_task(self, c: Dispatch, now: float) -> None:
        """The PE accepted ``c``: it queues the read on the read node, then computes."""
        pe, de = self.index[c.prefill_engine], self.index[c.decode_engine]
        miss, hit, _total, _gen = self.shape[c.request_id]
        self.seq[pe] += 1
        self.tok[pe] += miss
        ready = now
        if c.read_side is not None:
            j = self.node_index[c.prefill_node if c.read_side == 0 else c.decode_node]
            self.read_q[j] += hit
            ready = max(now, self.snic_free_at[j]) + hit / self.read_rate
            self.snic_free_at[j] = ready
            self._at(ready, (0, j, hit))
        done = max(ready, self.pe_free_at[pe]) + miss / _PREFILL_TOKENS_PER_S
        self.pe_free_at[pe] = done
        self._at(done, (1, c.request_id, pe, de))

    def run(self, seconds: float, *, record: bool) -> None:
        core, perf = self.core, time.thread_time_ns
        handle = core.handle
        for _ in range(round(seconds / self.tick)):
            self.step += 1
            now = self.step * self.tick
            phase = self.step % self.period
            events = self.answers
            self.answers = []
            self._arrivals(now, events)
            self._due(now)
            events.extend(self._report(i, now) for i in self.engine_phase[phase])
            events.extend(NodeReported(now=now, node=self.node_names[j], read_q_tokens=self.read_q[j]) for j in self.node_phase[phase])
            events.append(TimeAdvanced(now=now))
            t0 = perf()
            out = [handle(ev) for ev in events]
            spent = perf() - t0
            if record:
                self.core_ns += spent
                self.steps_recorded += 1
                self.in_flight_sum += core.running
                self.max_queued = max(self.max_queued, core.queued)
                for ev in events:
                    self.events[type(ev).__name__] += 1
                    if type(ev) is RequestSubmitted:
                        self.submitted += 1
            for cmds in out:
                for c in cmds:
                    self._command(c, now, record)

    def _command(self, c, now: float, record: bool) -> None:
        if record:
            self.commands[type(c).__name__] += 1
        if type(c) is ReserveSlot:
            self.answers.append(SlotReserved(now=now + self.tick, request_id=c.request_id, attempt=c.attempt, region=None, offset=0))
        elif type(c) is Dispatch:
            self._run_task(c, now + self.tick)
            self.answers.append(DispatchAnswered(now=now + self.tick, request_id=c.request_id, attempt=c.attempt))
        elif type(c) is FailRequest:
            self.shape.pop(c.request_id, None)
            self.failed += 1


def format_report(d: dict) -> str:
    """The benchmark result as a few human-readable lines."""
    ev = d["events_per_s"]
    return "\n".join(
        [
            f"scheduler core bench: policy={d['policy']}  {d['engines']} GPUs = {d['topology']}, python {d['python']}, one core",
            f"load: {d['rate_derivation']} -> {d['offered_requests_per_s']:,.0f} requests/s offered",
            "events/s: " + ", ".join(f"{k} {v:,.0f}" for k, v in ev.items()),
            (
                f"requests: {d['submitted']:,} submitted, {d['finished']:,} finished, {d['failed']} failed "
                f"in {d['virtual_seconds']:.0f} virtual s (after {d['warmup_seconds']:.0f} s warm-up); "
                f"mean in flight {d['mean_in_flight']:,.0f}, max queued {d['max_queued']}"
            ),
            (
                f"core: {d['core_cpu_seconds']:.3f} CPU s -> {d['requests_per_s']:,.0f} requests/s on one core "
                f"(aim {d['aim_requests_per_s']:,}); utilisation {100 * d['core_utilisation']:.1f}% of one core at the offered load"
            ),
        ]
    )
