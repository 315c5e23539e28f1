"""Synthetic agent sets matching the paper's 32K / 48K / 64K trace statistics.

The paper (PAPER.md "Traces") gives, per set, the max length and the averages of turns,
append, generation, total (final context) and context (prompt length over turns). The
averages are per agent first, then over agents: "avg append" is the mean over agents of
each agent's mean append. (Pooled over turns they would contradict the table: 60 turns x
(608 + 148) tokens exceeds the 28,639-token average total.) That makes agents with few,
long turns weigh as much as agents with many short ones, so the model needs turn counts
that vary a lot between agents while their total lengths do not.

Generative model, per agent j:

* system prompt ``S_j ~ LogNormal(mean=system_mean, sigma=system_sigma)`` (≤ max_len/2);
* turns ``n_j ~ LogNormal(mean=turns_mean, sigma=turns_sigma)``, rounded, ≥ 1;
* fill ``phi_j ~ Beta(fill_alpha, 1)``: the agent grows its context by
  ``B_j = phi_j (max_len - S_j)`` tokens (most agents run close to the context limit);
* ``B_j`` is split into a generation share ``gen_fraction`` and an append share; each
  share is spread over the ``n_j`` turns with Dirichlet weights (``append_kappa`` = 0.5:
  bursty tool outputs; ``gen_kappa`` = 4: steadier generations), every turn ≥ 1 token.

Then avg total = E[S] + E[B]; avg append + avg gen = E[B/n] = E[B] E[1/n], and
E[n] E[1/n] = exp(turns_sigma^2) for a log-normal, so turns_sigma alone sets how far the
per-agent mean turn size sits above total/turns. The fitted sigma is 0.81-0.84 for all
three sets. Agent-level draws use stratified quantiles ((k + 0.5)/N, shuffled), so any set
of >= 100 agents matches the table within about 2%. ``calibrate`` fits the five free
parameters to a target by fixed-point iteration (each parameter mainly moves one
statistic); ``SPECS`` holds its output for the three paper sets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from statistics import NormalDist

import numpy as np

from loadgen.trajectory import Trajectory

__all__ = ["TraceStats", "SyntheticSpec", "PAPER_STATS", "SPECS", "generate", "trace_stats", "calibrate"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceStats:
    """Statistics of an agent set, defined as in the module docstring (tokens)."""

    agents: int
    max_len: int
    avg_turns: float
    avg_append: float
    avg_gen: float
    avg_total: float
    avg_context: float


@dataclass(frozen=True, slots=True, kw_only=True)
class SyntheticSpec:
    """Parameters of the generative model (see the module docstring)."""

    name: str
    max_len: int
    system_mean: float
    turns_mean: float
    turns_sigma: float
    fill_alpha: float
    gen_fraction: float
    system_sigma: float = 0.3
    append_kappa: float = 0.5
    gen_kappa: float = 4.0


PAPER_STATS = {
    "32k": TraceStats(agents=500, max_len=32768, avg_turns=60, avg_append=608, avg_gen=148, avg_total=28639, avg_context=17183),
    "48k": TraceStats(agents=500, max_len=49152, avg_turns=106, avg_append=474, avg_gen=172, avg_total=42607, avg_context=25120),
    "64k": TraceStats(agents=500, max_len=65536, avg_turns=157, avg_append=429, avg_gen=176, avg_total=55958, avg_context=32721),
}

# Output of calibrate(name, PAPER_STATS[name]) with its defaults.
SPECS = {
    "32k": SyntheticSpec(
        name="32k", max_len=32768, system_mean=5324.4, turns_mean=60.038, turns_sigma=0.81266, fill_alpha=5.6628, gen_fraction=0.195767
    ),
    "48k": SyntheticSpec(
        name="48k", max_len=49152, system_mean=7244.4, turns_mean=106.058, turns_sigma=0.81514, fill_alpha=5.3777, gen_fraction=0.266254
    ),
    "64k": SyntheticSpec(
        name="64k", max_len=65536, system_mean=9092.8, turns_mean=157.101, turns_sigma=0.83932, fill_alpha=4.8926, gen_fraction=0.290909
    ),
}

_NORMAL = NormalDist()


def _strata(rng: np.random.Generator, n: int) -> np.ndarray:
    """Shuffled midpoints of n equal-probability strata: a low-variance uniform sample."""
    return rng.permutation((np.arange(n) + 0.5) / n)


def _lognormal(rng: np.random.Generator, n: int, mean: float, sigma: float) -> np.ndarray:
    z = np.array([_NORMAL.inv_cdf(u) for u in _strata(rng, n)])
    return mean * np.exp(sigma * z - sigma * sigma / 2)


def _split(rng: np.random.Generator, total: int, parts: int, kappa: float) -> np.ndarray:
    """``parts`` integers ≥ 1 summing to ``total`` (≥ parts), Dirichlet(kappa) shaped."""
    weights = rng.gamma(kappa, size=parts)
    extra = (total - parts) * weights / weights.sum()
    base = np.floor(extra).astype(np.int64)
    short = int(total - parts - base.sum())
    if short:
        # Largest remainders get the leftover tokens so the sum is exact.
        base[np.argsort(extra - base)[-short:]] += 1
    return base + 1


def generate(spec: SyntheticSpec, agents: int, seed: int = 0) -> list[Trajectory]:
    """Draw ``agents`` length-only trajectories from ``spec`` (deterministic in ``seed``).

    Raises ValueError when ``agents`` < 1.
    """
    if agents < 1:
        raise ValueError(f"agents must be >= 1, got {agents}")
    rng = np.random.default_rng(seed)
    systems = np.minimum(np.round(_lognormal(rng, agents, spec.system_mean, spec.system_sigma)), spec.max_len // 2).astype(np.int64)
    turns = np.maximum(1, np.round(_lognormal(rng, agents, spec.turns_mean, spec.turns_sigma))).astype(np.int64)
    fills = _strata(rng, agents) ** (1.0 / spec.fill_alpha)  # inverse CDF of Beta(alpha, 1)
    out = []
    for j in range(agents):
        grow = max(2, int((spec.max_len - systems[j]) * fills[j]))
        n = int(min(turns[j], grow // 2))
        append_total = min(max(round((1 - spec.gen_fraction) * grow), n), grow - n)
        appends = _split(rng, append_total, n, spec.append_kappa)
        gens = _split(rng, grow - append_total, n, spec.gen_kappa)
        out.append(
            Trajectory(
                id=f"{spec.name}-{seed}-{j}",
                system_tokens=int(systems[j]),
                append_tokens=tuple(appends.tolist()),
                gen_tokens=tuple(gens.tolist()),
            )
        )
    return out


def trace_stats(trajectories: list[Trajectory]) -> TraceStats:
    """Statistics of a set, per agent first then averaged (module docstring).

    Raises ValueError for an empty list.
    """
    if not trajectories:
        raise ValueError("no trajectories")
    rows = []
    for t in trajectories:
        rows.append(
            (t.turns, sum(t.append_tokens) / t.turns, sum(t.gen_tokens) / t.turns, t.total_tokens, sum(t.prompt_lengths()) / t.turns)
        )
    m = np.array(rows, dtype=np.float64).mean(axis=0)
    return TraceStats(
        agents=len(trajectories),
        max_len=max(t.total_tokens for t in trajectories),
        avg_turns=float(m[0]),
        avg_append=float(m[1]),
        avg_gen=float(m[2]),
        avg_total=float(m[3]),
        avg_context=float(m[4]),
    )


def calibrate(name: str, target: TraceStats, *, agents: int = 2000, seed: int = 12345, iterations: int = 12) -> SyntheticSpec:
    """Fit a spec whose generated statistics match ``target`` (max_len is taken as is).

    Fixed-point iteration on common random numbers; each update moves the parameter that
    mainly drives one statistic. Raises ValueError for a target the model cannot express
    (non-positive averages, or a total not below max_len).
    """
    t = target
    if min(t.avg_turns, t.avg_append, t.avg_gen, t.avg_context) <= 0 or not 0 < t.avg_total < t.max_len:
        raise ValueError(f"target statistics out of range: {t}")
    spec = SyntheticSpec(
        name=name,
        max_len=t.max_len,
        system_mean=0.2 * t.avg_total,
        turns_mean=t.avg_turns,
        turns_sigma=0.8,
        fill_alpha=6.0,
        gen_fraction=t.avg_gen / (t.avg_gen + t.avg_append),
    )
    for _ in range(iterations):
        got = trace_stats(generate(spec, agents, seed))
        fill = spec.fill_alpha / (spec.fill_alpha + 1) * t.avg_total / got.avg_total
        fill = min(fill, 0.995)
        size_ratio = (t.avg_append + t.avg_gen) / (got.avg_append + got.avg_gen)
        got_share = got.avg_gen / (got.avg_gen + got.avg_append)
        spec = replace(
            spec,
            turns_mean=spec.turns_mean * t.avg_turns / got.avg_turns,
            turns_sigma=math.sqrt(max(0.01, spec.turns_sigma**2 + math.log(size_ratio))),
            gen_fraction=min(0.95, spec.gen_fraction * (t.avg_gen / (t.avg_gen + t.avg_append)) / got_share),
            system_mean=max(1.0, spec.system_mean + 2 * (t.avg_context - got.avg_context) - (t.avg_total - got.avg_total)),
            fill_alpha=fill / (1 - fill),
        )
    return spec
