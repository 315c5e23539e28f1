"""Scheduler benchmark (a benchmark, not a test): how fast the policy decides at the paper's
largest scale, on one core.

Cluster: ``engines`` GPUs as 1P:2D nodes of 8 (1,152 → 48P96D: 384 PEs, 768 DEs).
Load: the paper's largest online run, 8.8 agents/s, each agent running its turns back to
back. By Little's law an agent that issues T requests during its life adds T requests to
the arrival stream whatever its turn duration, so the request rate is ``8.8 × T``; with
T = 157 (the 64K trace's average turns, the most of the three sets) that is 1,381.6
requests/s (528/s with the 32K set's 60 turns).

The harness is a small discrete-event loop in virtual time: Poisson arrivals; a read
finishes after its node's storage NIC (FIFO, 400 Gbps) reads the hit tokens, a prefill
after its PE computes the miss tokens, a decode after ``gen × TPOT``; every arrival and
every finish runs a scheduling pass over the waiting queue. Only the policy's own work is
timed, in CPU time of the calling thread (``thread_time_ns`` around ``schedule``,
``on_assigned`` and the completions, less the clock's own cost), so other processes on a
shared machine do not inflate it; the first ``warmup_s`` virtual seconds fill the cluster and are not recorded.
"""

from __future__ import annotations

import heapq
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass

from dualpath.policy.errors import InvalidTopologyError
from dualpath.policy.registry import Policy, get_policy
from dualpath.policy.state import ClusterState
from dualpath.policy.thresholds import Thresholds
from dualpath.policy.values import PendingRequest

__all__ = ["BenchWorkload", "format_report", "run_bench"]

_BLOCK = 64
_GPUS_PER_NODE = 8
_KV_BYTES_PER_TOKEN = 656 * 61  # DeepSeek-V3.2, FP8 MLA (dualpath.cost.targets)
_SNIC_BYTES_PER_S = 50e9  # 400 Gbps storage NIC per node
_PREFILL_TOKENS_PER_S = 10_000.0  # miss tokens one GPU prefills per second (assumed)
_DECODE_HBM_TOKENS = 800_000  # KV capacity per decode GPU (assumed, ~40 GB at 48 KB/token)
_BURST = 256  # queue length of the batched-pass measurement


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchWorkload:
    """Arrival process and request shape (the 64K trace's averages, PAPER.md)."""

    agents_per_s: float = 8.8
    turns_per_agent: int = 157
    context_tokens: int = 32_721
    append_tokens: int = 429
    gen_tokens: int = 176
    tpot_s: float = 0.036

    @property
    def request_rate(self) -> float:
        """Requests per second: agents/s × turns per agent (Little's law)."""
        return self.agents_per_s * self.turns_per_agent


def _request(rng: random.Random, rid: int, w: BenchWorkload) -> tuple[PendingRequest, int]:
    """A turn with context uniform in [0, 2×avg), the previous context as the block-aligned
    hit, and generation uniform in [gen/2, 3·gen/2]; returns it with its gen length."""
    context = rng.randrange(0, 2 * w.context_tokens)
    prompt = context + rng.randint(w.append_tokens // 2, 3 * w.append_tokens // 2)
    gen = rng.randint(w.gen_tokens // 2, 3 * w.gen_tokens // 2)
    hit = context // _BLOCK * _BLOCK
    return PendingRequest(request_id=rid, prompt_tokens=prompt, hit_tokens=hit, total_len=prompt + gen), gen


def _clock_overhead_ns() -> int:
    """The cost of one ``thread_time_ns`` pair (large on virtual machines), the median of
    many, so each timed region can have it subtracted."""
    perf = time.thread_time_ns
    samples = []
    for _ in range(2001):
        t0 = perf()
        samples.append(perf() - t0)
    return int(statistics.median(samples))


def _percentile(sorted_vals: list[int], q: float) -> float:
    if not sorted_vals:
        return 0.0
    return float(sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))])


def run_bench(
    engines: int = 1152,
    seconds: float = 20.0,
    seed: int = 0,
    *,
    policy: str = "dualpath",
    warmup_s: float = 10.0,
    workload: BenchWorkload = BenchWorkload(),
) -> dict:
    """Simulate ``warmup_s + seconds`` virtual seconds of the workload and time the policy.

    Returns a JSON-ready dict (see ``format_report`` for the meaning of each figure).

    Raises:
        InvalidTopologyError: ``engines`` is not a positive multiple of 24 (1P:2D nodes of
            8 GPUs).
        UnknownPolicyError: unknown ``policy``.
    """
    if engines < 24 or engines % 24:
        raise InvalidTopologyError(f"engines={engines}: need a multiple of 24 (1P:2D nodes of 8 GPUs)")
    p_nodes = engines // 24
    state = ClusterState.from_topology(
        prefill_nodes=p_nodes, decode_nodes=2 * p_nodes, gpus_per_node=_GPUS_PER_NODE,
        decode_hbm_tokens=_DECODE_HBM_TOKENS,
    )
    thresholds = Thresholds.from_profile(
        snic_bytes_per_s=_SNIC_BYTES_PER_S, kv_bytes_per_token=_KV_BYTES_PER_TOKEN,
        prefill_tokens_per_s=_PREFILL_TOKENS_PER_S,
    )
    chosen = get_policy(policy, thresholds)
    sim = _Sim(state, chosen, workload, random.Random(seed), warmup_s)
    wall0 = time.perf_counter()
    sim.run(warmup_s + seconds)
    burst = _burst_rate(chosen, state, workload, random.Random(seed + 1))
    d = _summary(sim, seconds, workload)
    d.update({
        "policy": policy,
        "engines": engines,
        "prefill_engines": len(state.prefill_engines),
        "decode_engines": len(state.decode_engines),
        "topology": f"{p_nodes}P{2 * p_nodes}D x {_GPUS_PER_NODE} GPUs",
        "alpha_tokens": thresholds.alpha_tokens,
        "beta_tokens": thresholds.beta_tokens,
        "burst_queue": _BURST,
        "burst_decisions_per_s": burst,
        "wall_seconds": time.perf_counter() - wall0,
        "clock_overhead_ns": sim.clock_ns,
        "python": platform.python_version(),
    })
    return d


def _summary(sim: _Sim, seconds: float, w: BenchWorkload) -> dict:
    """The timing figures of a finished run."""
    lat = sorted(sim.pass_ns)
    decide_s = sum(sim.pass_ns) / 1e9
    total_s = decide_s + (sim.apply_ns + sim.update_ns) / 1e9
    rate = w.request_rate
    return {
        "workload": asdict(w),
        "request_rate_per_s": rate,
        "rate_derivation": (f"{w.agents_per_s} agents/s x {w.turns_per_agent} turns/agent "
                            f"(Little's law) = {rate:.1f} requests/s"),
        "virtual_seconds": seconds,
        "decisions": sim.decisions,
        "passes": len(lat),
        "decisions_per_pass": sim.decisions / len(lat) if lat else 0.0,
        "mean_in_flight": statistics.fmean(sim.in_flight) if sim.in_flight else 0.0,
        "max_waiting": sim.max_waiting,
        "pass_latency_us": {"p50": _percentile(lat, 0.50) / 1e3, "p99": _percentile(lat, 0.99) / 1e3,
                            "max": (lat[-1] / 1e3) if lat else 0.0},
        "decisions_per_s": sim.decisions / decide_s if decide_s else 0.0,
        "decisions_per_s_with_state_updates": sim.decisions / total_s if total_s else 0.0,
        "core_fraction_used": total_s / seconds,
        "headroom": (sim.decisions / total_s) / rate if total_s else 0.0,
        "headroom_policy_only": (sim.decisions / decide_s) / rate if decide_s else 0.0,
    }


def _burst_rate(policy: Policy, state: ClusterState, w: BenchWorkload, rng: random.Random) -> float:
    """Decisions/s of one pass over a queue of ``_BURST`` requests on the warm state (not
    applied), the median of several passes: the batched regime of a periodic scheduler."""
    queue = [_request(rng, 10**12 + i, w)[0] for i in range(_BURST)]
    rates = []
    for _ in range(9):
        t0 = time.thread_time_ns()
        placed = len(policy.schedule(queue, state))
        elapsed = time.thread_time_ns() - t0
        rates.append(placed / (elapsed / 1e9) if elapsed else 0.0)
    return statistics.median(rates)


class _Sim:
    """The virtual-time harness around one policy and one cluster state."""

    def __init__(self, state: ClusterState, policy: Policy, w: BenchWorkload, rng: random.Random, warmup_s: float) -> None:
        self.state, self.policy, self.w, self.rng, self.warmup_s = state, policy, w, rng, warmup_s
        self.events: list[tuple[float, int, int, int]] = []  # (time, seq, kind, request id)
        self.seq = 0
        self.waiting: list[PendingRequest] = []
        self.gen: dict[int, int] = {}
        self.read_free_at: dict[int, float] = {}  # node -> time its storage NIC is idle
        self.pe_free_at: dict[int, float] = {}
        self.read_rate = _SNIC_BYTES_PER_S / _KV_BYTES_PER_TOKEN  # tokens/s per node
        self.pass_ns: list[int] = []
        self.apply_ns = self.update_ns = self.decisions = self.max_waiting = 0
        self.in_flight: list[int] = []
        self.clock_ns = _clock_overhead_ns()  # subtracted from every timed region

    def _push(self, t: float, kind: int, rid: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, rid))

    def run(self, until: float) -> None:
        """Process events up to virtual time ``until``."""
        rid = 0
        self._push(self.rng.expovariate(self.w.request_rate), 0, rid)
        state, perf = self.state, time.thread_time_ns
        finish = (None, state.on_read_finished, state.on_prefill_finished, state.on_finished)
        while self.events and self.events[0][0] < until:
            now, _, kind, r = heapq.heappop(self.events)
            record = now >= self.warmup_s
            if kind == 0:  # arrival
                req, self.gen[r] = _request(self.rng, r, self.w)
                self.waiting.append(req)
                rid += 1
                self._push(now + self.rng.expovariate(self.w.request_rate), 0, rid)
            else:
                t0 = perf()
                finish[kind](r)
                if record:
                    self.update_ns += max(0, perf() - t0 - self.clock_ns)
                if kind != 3:
                    continue
                del self.gen[r]
            if self.waiting:
                self._pass(now, record)

    def _pass(self, now: float, record: bool) -> None:
        state, perf = self.state, time.thread_time_ns
        t0 = perf()
        decided = self.policy.schedule(self.waiting, state)
        t1 = perf()
        for a in decided:
            state.on_assigned(a)
        t2 = perf()
        if record:
            self.max_waiting = max(self.max_waiting, len(self.waiting))
            if decided:
                self.pass_ns.append(max(0, t1 - t0 - self.clock_ns))
                self.decisions += len(decided)
                self.apply_ns += max(0, t2 - t1 - self.clock_ns)
                self.in_flight.append(state.live_count)
        del self.waiting[: len(decided)]
        for a in decided:
            read_done = max(now, self.read_free_at.get(a.read_node, 0.0)) + a.read_tokens / self.read_rate
            self.read_free_at[a.read_node] = read_done
            prefill_done = max(read_done, self.pe_free_at.get(a.prefill_engine, 0.0)) + (
                a.prefill_tokens / _PREFILL_TOKENS_PER_S)
            self.pe_free_at[a.prefill_engine] = prefill_done
            self._push(read_done, 1, a.request_id)
            self._push(prefill_done, 2, a.request_id)
            self._push(prefill_done + self.gen[a.request_id] * self.w.tpot_s, 3, a.request_id)


def format_report(d: dict) -> str:
    """The benchmark result as a few human-readable lines."""
    lat = d["pass_latency_us"]
    return "\n".join([
        f"scheduler bench: policy={d['policy']}  {d['engines']} GPUs = {d['topology']} "
        f"({d['prefill_engines']} PEs, {d['decode_engines']} DEs), python {d['python']}, one core",
        f"load: {d['rate_derivation']}; mean in flight {d['mean_in_flight']:.0f}, max waiting {d['max_waiting']}",
        f"thresholds: alpha={d['alpha_tokens']:,} tokens (3 s of SNIC), beta={d['beta_tokens']:,} tokens (5 s of GPU)",
        f"decisions: {d['decisions']:,} in {d['passes']:,} passes over {d['virtual_seconds']:.0f} virtual s "
        f"({d['decisions_per_pass']:.2f} per pass)",
        f"pass latency (thread CPU time): p50 {lat['p50']:.1f} us, p99 {lat['p99']:.1f} us, max {lat['max']:.1f} us",
        f"throughput: {d['decisions_per_s']:,.0f} decisions/s (policy), "
        f"{d['decisions_per_s_with_state_updates']:,.0f}/s with state updates",
        f"batched: one pass over {d['burst_queue']} queued requests places them at "
        f"{d['burst_decisions_per_s']:,.0f} decisions/s",
        f"one core: {100 * d['core_fraction_used']:.1f}% busy at {d['request_rate_per_s']:.1f} req/s "
        f"-> headroom {d['headroom']:.1f}x with state updates, {d['headroom_policy_only']:.1f}x "
        f"for the decisions alone (aim >= 10x)",
    ])
