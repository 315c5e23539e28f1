"""The agents a simulation runs: the load generator's trajectory sets and files, and its
arrival processes (``loadgen.dataset``, ``loadgen.arrivals``), held compactly.

A trajectory becomes two ``array('i')`` of per-turn append and generation lengths plus the
system prompt length (~1.3 KB for a 157-turn agent instead of ~11 KB of Python ints), so
48K agents of the 64K set fit in tens of MB. Offline runs start every agent at 0; online runs
draw Poisson (``burstiness`` 1) or Gamma arrivals; ``tool_gap_s`` is the mean of an
exponential pause between an answer and the agent's next turn (its tool call).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np

from dualpath.sim.agent import Agent
from loadgen.arrivals import arrival_times
from loadgen.dataset import load_dataset

__all__ = ["Agent", "Workload", "build_agents"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """Which agents, and when they arrive.

    ``dataset``: 32k, 48k, 64k (synthetic, the paper's statistics) or a trajectory JSONL
    file; ``turns`` caps each agent (None: the whole trajectory); ``start_at`` meets agents
    that far through their trajectories; ``rate`` None is offline (all at 0, or agent ``i`` at
    ``i * stagger_s``: the testbed's ``--stagger-ms``).
    """

    dataset: str = "64k"
    agents: int = 64
    seed: int = 0
    turns: int | None = None
    start_at: float = 0.0
    scale: float = 1.0
    rate: float | None = None
    burstiness: float = 1.0
    tool_gap_s: float = 0.0
    duration_s: float | None = None  # online: arrivals stop after this (agents beyond are dropped)
    append_scale: float = 1.0  # every append multiplied by this (the paper's append-length sweep)
    warm: bool | None = None  # the context an agent starts with is already in storage (None: when start_at > 0)
    stagger_s: float = 0.0  # offline: agent i starts at i x this


def build_agents(w: Workload, block_tokens: int = 64) -> list[Agent]:
    """The agents of ``w`` with their arrival times (raises loadgen's InputError on bad input).

    Met mid-rollout (``start_at`` > 0) an agent's first prompt folds its earlier turns in; with
    ``warm`` (the default then) those tokens' Full Blocks are already in storage, as after the
    testbed's warm-up turns, so the first timed turn is a hit like any later one.
    """
    warm = w.start_at > 0 if w.warm is None else w.warm
    trajectories = load_dataset(w.dataset, agents=w.agents, seed=w.seed, turns=w.turns, scale=w.scale, start_at=w.start_at)
    times = arrival_times(len(trajectories), rate=w.rate, burstiness=w.burstiness, seed=w.seed + 7919, stagger=w.stagger_s)
    out = []
    for i, t in enumerate(trajectories):
        at = float(times[i])
        if w.duration_s is not None and w.rate is not None and at > w.duration_s:
            break
        appends = t.append_tokens if w.append_scale == 1.0 else [max(1, round(a * w.append_scale)) for a in t.append_tokens]
        agent = Agent(i, t.system_tokens, array("i", appends), array("i", t.gen_tokens), at)
        if warm:  # as the testbed's untimed warm-up turns leave it: the folded context is persisted
            agent.persisted = t.system_tokens - t.system_tokens % block_tokens
        out.append(agent)
    return out


def gap_sampler(mean_s: float, seed: int):
    """A function returning the next tool-call pause (exponential with mean ``mean_s``; 0 when 0)."""
    if mean_s <= 0:
        return lambda: 0.0
    rng = np.random.default_rng(seed + 104729)
    block: list[float] = []

    def draw() -> float:
        if not block:
            block.extend(rng.exponential(mean_s, 4096).tolist())
        return block.pop()

    return draw
