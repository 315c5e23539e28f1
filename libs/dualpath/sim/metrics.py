"""What a simulation measures, per turn and per agent, in compact arrays.

Per completed turn (virtual seconds): when it was submitted, TTFT (submission -> first token,
the end of its prefill), its queueing part (submission -> its first prefill batch, which
includes the scheduler queue, the storage read and the engine queue) and execution part
(first batch -> first token), TTST (first -> second token), TPOT ((last - first token) /
(tokens - 1); turns of one token have none), the decode pace after the second token (``pace``:
(last - second token) / (tokens - 2), what TPOT measures where TTST is reported beside it, as
the paper does) and e2e. ``array('f')`` keeps 7.5M turns in
~200 MB.
"""

from __future__ import annotations

from array import array

import numpy as np

__all__ = ["Metrics", "percentiles"]


def percentiles(values: array | list[float]) -> dict:
    """n, mean, p50, p90, p99, max of the non-negative values (none -> n = 0)."""
    a = np.frombuffer(values, dtype=np.float32).astype(np.float64) if isinstance(values, array) else np.asarray(values, float)
    a = a[a >= 0]
    if a.size == 0:
        return {"n": 0}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"n": int(a.size), "mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(a.max())}


class Metrics:
    """Per-turn latencies and counters of one run."""

    __slots__ = ("agent_end", "e2e", "exec", "hit_tokens", "pace", "prompt_tokens", "queue", "submit", "tpot", "ttft", "ttst", "turns_done")

    def __init__(self) -> None:
        self.submit = array("f")
        self.ttft = array("f")
        self.queue = array("f")
        self.exec = array("f")
        self.ttst = array("f")
        self.tpot = array("f")
        self.pace = array("f")
        self.e2e = array("f")
        self.agent_end = array("d")
        self.turns_done = 0
        self.hit_tokens = 0
        self.prompt_tokens = 0

    def turn(self, *, submit: float, first: float, batch: float, ttst: float, end: float, gen: int, prompt: int, hit: int) -> None:
        self.turns_done += 1
        self.hit_tokens += hit
        self.prompt_tokens += prompt
        self.submit.append(submit)
        self.ttft.append(first - submit)
        self.queue.append(batch - submit)
        self.exec.append(first - batch)
        self.e2e.append(end - submit)
        # turns of one token have no second token: -1, left out of percentiles, meets TPOT
        self.ttst.append(ttst if gen > 1 else -1.0)
        self.tpot.append((end - first) / (gen - 1) if gen > 1 else -1.0)
        self.pace.append((end - first - ttst) / (gen - 2) if gen > 2 else -1.0)

    def slo_attainment(
        self, ttft_s: float, tpot_s: float, since: float = 0.0, until: float = float("inf"), after_second: bool = False
    ) -> float | None:
        """Share of the turns submitted in ``[since, until)`` with TTFT <= ``ttft_s`` and
        TPOT <= ``tpot_s`` (``after_second``: the pace after the second token) (None when there
        are none)."""
        sub = np.frombuffer(self.submit, dtype=np.float32)
        keep = (sub >= since) & (sub < until)
        if not keep.any():
            return None
        ttft = np.frombuffer(self.ttft, dtype=np.float32)[keep]
        tpot = np.frombuffer(self.pace if after_second else self.tpot, dtype=np.float32)[keep]
        return float(((ttft <= ttft_s) & (tpot <= tpot_s)).mean())

    def window_latency(self, since: float = 0.0, until: float = float("inf")) -> dict[str, dict]:
        """``percentiles`` of TTFT, TTST, TPOT and the pace after the second token over the turns
        submitted in ``[since, until)``."""
        sub = np.frombuffer(self.submit, dtype=np.float32)
        keep = (sub >= since) & (sub < until)
        return {
            name: percentiles(np.frombuffer(getattr(self, name), dtype=np.float32)[keep].tolist())
            for name in ("ttft", "ttst", "tpot", "pace")
        }
