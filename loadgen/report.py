"""Per-turn records, their statistics, SLO attainment, goodput and ``report.json``.

Definitions (all latencies in seconds):

* TTFT: request handed to the transport → first token; TTST: first → second token;
  TPOT: (last token - first token) / (completion tokens - 1); ITL: gaps between token
  events (tokens that arrive in one read have gap 0); e2e: request → end of response.
* A completed turn *meets the SLO* when TTFT ≤ ``slo.ttft_s`` and (TPOT ≤ ``slo.tpot_s``
  or it produced one token). A failed turn misses. A turn cut off by the end of the run
  misses if its TTFT bound was already broken, and is left out otherwise.
* attainment = turns meeting the SLO / turns counted; the run *meets* the SLO when
  attainment ≥ ``slo.attainment``.
* goodput = turns (and their output tokens) that met the SLO per second of run time.
* achieved APS = agents launched / time of the last launch (online runs).
* untimed turns (``--untimed-turns N``): each agent's first N turns run as usual but are
  left out of every figure above except the error count (``turns.untimed`` counts them).

ITL percentiles come from a log histogram with 1% wide buckets (bounded memory for
millions of tokens); every other percentile is exact.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

__all__ = ["Slo", "TurnRecord", "AgentRecord", "LogHistogram", "distribution", "summarize", "write_json", "write_turns"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Slo:
    """Service level objective: TTFT and TPOT bounds and the fraction of turns to meet."""

    ttft_s: float = 4.0
    tpot_s: float = 0.05
    attainment: float = 0.99


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnRecord:
    """One turn as measured. ``t_start``: when its request was sent, in seconds since the
    run began (for a turn that never got a response: when it was about to be sent).

    ``error_kind``: None (ok), unreachable, http, stream, timeout, cancelled.
    """

    agent: int
    turn: int
    t_start: float
    expected_prompt_tokens: int
    expected_gen_tokens: int
    error_kind: str | None = None
    error: str | None = None
    ttft: float | None = None
    ttst: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    max_itl: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    server_timing: str | None = None  # the response's Server-Timing header, if any
    ttft_queue: float | None = None  # TTFT spent queueing (admission -> first prefill batch), if the server reports it
    ttft_exec: float | None = None  # TTFT spent executing (first prefill batch -> first token), if reported

    @property
    def ok(self) -> bool:
        """Whether the turn completed."""
        return self.error_kind is None

    def slo_outcome(self, slo: Slo) -> bool | None:
        """True/False whether it met ``slo``; None when it does not count (cut off in time)."""
        if self.ok:
            return self.ttft is not None and self.ttft <= slo.ttft_s and (self.tpot is None or self.tpot <= slo.tpot_s)
        if self.error_kind == "cancelled":
            late = (self.ttft is not None and self.ttft > slo.ttft_s) or (self.ttft is None and (self.e2e or 0.0) > slo.ttft_s)
            return False if late else None
        return False


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentRecord:
    """One agent: scheduled arrival, actual start and end (run seconds), turns done."""

    agent: int
    scheduled: float
    started: float
    ended: float
    turns_done: int
    turns_total: int
    status: str  # done | failed | cancelled


class LogHistogram:
    """Counts of non-negative values in 1%-wide log buckets from 1 µs up (plus a 0 bucket)."""

    _LOW, _RATIO = 1e-6, math.log(1.01)

    def __init__(self, buckets: int = 2400) -> None:
        self.counts = np.zeros(buckets + 1, dtype=np.int64)  # [0 bucket + log buckets]
        self.max = 0.0

    def add(self, value: float) -> None:
        """Count one value (seconds)."""
        if value > self.max:
            self.max = value
        if value < self._LOW:
            self.counts[0] += 1
        else:
            self.counts[min(len(self.counts) - 1, 1 + int(math.log(value / self._LOW) / self._RATIO))] += 1

    def percentile(self, q: float) -> float | None:
        """The q-th percentile (0–100) as its bucket's geometric middle; None if empty."""
        total = int(self.counts.sum())
        if total == 0:
            return None
        index = int(np.searchsorted(np.cumsum(self.counts), math.ceil(q / 100 * total)))
        return 0.0 if index == 0 else min(self.max, self._LOW * math.exp((index - 0.5) * self._RATIO))

    def summary(self) -> dict:
        """p50/p90/p99, mean (from bucket middles), max and count."""
        n = int(self.counts.sum())
        if n == 0:
            return {"n": 0}
        mids = np.concatenate(([0.0], self._LOW * np.exp((np.arange(1, len(self.counts)) - 0.5) * self._RATIO)))
        return {
            "n": n,
            "p50": self.percentile(50),
            "p90": self.percentile(90),
            "p99": self.percentile(99),
            "mean": float((mids * self.counts).sum() / n),
            "max": self.max,
        }


def distribution(values: list[float]) -> dict:
    """n, mean, min, p50, p90, p99, max of ``values`` (empty → just n = 0)."""
    if not values:
        return {"n": 0}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "n": len(a),
        "mean": float(a.mean()),
        "min": float(a.min()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(a.max()),
    }


def summarize(
    turns: list[TurnRecord],
    agents: list[AgentRecord],
    *,
    slo: Slo,
    wall_s: float,
    itl: LogHistogram,
    launched_at: list[float],
    offline: bool,
    untimed_turns: int = 0,
) -> dict:
    """The measured part of report.json (see the module docstring for definitions).

    ``untimed_turns``: each agent's first turns that run but are left out of every latency,
    cache, SLO and goodput figure (a lead-in whose predecessors ran elsewhere); a failed one
    still counts among the errors."""
    lead_in = [t for t in turns if t.turn < untimed_turns]
    turns = [t for t in turns if t.turn >= untimed_turns] if untimed_turns else turns
    done = [t for t in turns if t.ok]
    outcomes = [o for o in (t.slo_outcome(slo) for t in turns) if o is not None]
    good = [t for t in turns if t.slo_outcome(slo)]
    out_tokens = sum(t.completion_tokens or 0 for t in done)
    prompt_tokens = sum(t.prompt_tokens or 0 for t in done)
    cached = sum(t.cached_tokens or 0 for t in done)
    wall = max(wall_s, 1e-9)
    kinds: dict[str, int] = {}
    for t in (*lead_in, *turns):
        if t.error_kind:
            kinds[t.error_kind] = kinds.get(t.error_kind, 0) + 1
    status = {s: sum(a.status == s for a in agents) for s in ("done", "failed", "cancelled")}
    mismatched = sum(1 for t in done if t.completion_tokens is not None and t.completion_tokens != t.expected_gen_tokens)
    return {
        "wall_s": wall_s,
        "jct_s": max((a.ended for a in agents), default=0.0) if offline else None,
        "agents": {"launched": len(agents), **status},
        "turns": {
            "completed": len(done),
            "untimed": sum(1 for t in lead_in if t.ok),
            "errors": kinds,
            "gen_length_mismatches": mismatched,
        },
        "latency_s": {
            "ttft": distribution([t.ttft for t in done if t.ttft is not None]),
            "ttft_queue": distribution([t.ttft_queue for t in done if t.ttft_queue is not None]),
            "ttft_exec": distribution([t.ttft_exec for t in done if t.ttft_exec is not None]),
            "ttst": distribution([t.ttst for t in done if t.ttst is not None]),
            "tpot": distribution([t.tpot for t in done if t.tpot is not None]),
            "itl": itl.summary(),
            "e2e": distribution([t.e2e for t in done if t.e2e is not None]),
            "agent_completion": distribution([a.ended - a.started for a in agents if a.status == "done"]),
        },
        "throughput": {
            "output_tokens_per_s": out_tokens / wall,
            "prompt_tokens_per_s": prompt_tokens / wall,
            "turns_per_s": len(done) / wall,
            "output_tokens": out_tokens,
            "prompt_tokens": prompt_tokens,
        },
        "cache": {"prompt_tokens": prompt_tokens, "cached_tokens": cached, "hit_rate": cached / prompt_tokens if prompt_tokens else None},
        "slo": {
            "ttft_s": slo.ttft_s,
            "tpot_s": slo.tpot_s,
            "attainment_target": slo.attainment,
            "turns_counted": len(outcomes),
            "turns_met": sum(outcomes),
            "attainment": sum(outcomes) / len(outcomes) if outcomes else None,
            "ttft_attainment": _share(done, lambda t: t.ttft is not None and t.ttft <= slo.ttft_s),
            "tpot_attainment": _share(done, lambda t: t.tpot is None or t.tpot <= slo.tpot_s),
            "met": bool(outcomes) and sum(outcomes) / len(outcomes) >= slo.attainment,
        },
        "goodput": {"turns_per_s": len(good) / wall, "output_tokens_per_s": sum(t.completion_tokens or 0 for t in good) / wall},
        "aps": {"achieved": (len(launched_at) / max(launched_at)) if launched_at and max(launched_at) > 0 and not offline else None},
    }


def _share(turns: list[TurnRecord], pred) -> float | None:
    return sum(1 for t in turns if pred(t)) / len(turns) if turns else None


def write_json(path: str | Path, obj: dict) -> None:
    """Write ``obj`` as JSON atomically (temp file + rename). Raises OSError on failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_plain) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_turns(path: str | Path, turns: list[TurnRecord]) -> None:
    """Write one JSON object per turn (``turns.jsonl``). Raises OSError on failure."""
    with open(path, "w", encoding="utf-8") as f:
        for t in turns:
            f.write(json.dumps(asdict(t), separators=(",", ":")) + "\n")


def _plain(obj: object) -> object:
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
