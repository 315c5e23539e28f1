"""The agents of a run: a synthetic set by name, or a JSONL trajectory file.

A set holds a fixed number of trajectories: a file its lines, a synthetic set the paper's
500 (``DEFAULT_AGENTS``: PAPER.md "Traces": 500 trajectories per set). More agents than
that cycle through the set, as the paper's runs of 1K-48K agents replay its 500 traces, so
the longest trajectory is the longest of 500 at any agent count (independent draws would
lengthen the tail with the count: the longest of 2,048 draws of the 64K set has 2,062
turns, of 500 has 1,478, and an offline JCT is its last agent's). Copies after the first of
a recorded (text-carrying) trajectory get their first segment prefixed with an agent tag,
so copies never share a prompt prefix (the paper gives extra agents "a synthetic random
first round" for the same reason). Length-only agents get unique text at replay time: the
replay seeds each agent's text with its index.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from loadgen.errors import InputError
from loadgen.synthetic import SPECS, generate
from loadgen.trajectory import Trajectory, load_trajectories

__all__ = ["load_dataset", "DEFAULT_AGENTS"]

DEFAULT_AGENTS = 500  # the paper's set size


def load_dataset(
    name: str, *, agents: int | None = None, seed: int = 0, turns: int | None = None, scale: float = 1.0, start_at: float = 0.0
) -> list[Trajectory]:
    """Trajectories for ``agents`` agents, each met ``start_at`` of the way through its turns
    (``Trajectory.from_turn``), capped to ``turns`` and scaled by ``scale``.

    ``name`` is 32k, 48k, 64k (synthetic, drawn with ``seed``) or a JSONL file path
    (``agents`` defaults to the number of lines). Raises InputError for an unknown name,
    bad ``agents``/``turns``/``scale``, and TrajectoryFormatError for a malformed file.
    """
    if agents is not None and agents < 1:
        raise InputError(f"--agents must be >= 1, got {agents}")
    if turns is not None and turns < 1:
        raise InputError(f"--turns must be >= 1, got {turns}")
    if not scale > 0:
        raise InputError(f"--scale must be > 0, got {scale}")
    if not 0 <= start_at < 1:
        raise InputError(f"--start-at must be in [0, 1), got {start_at}")
    key = name.lower()
    if key in SPECS:
        count = agents or DEFAULT_AGENTS
        traces = generate(SPECS[key], min(count, DEFAULT_AGENTS), seed)
    elif Path(name).is_file():
        traces = load_trajectories(name)
        count = agents or len(traces)
    else:
        raise InputError(f"--dataset must be one of {', '.join(SPECS)} or a trajectory JSONL file; {name!r} is neither")
    base = [_copy(traces[i % len(traces)], i, i // len(traces)) for i in range(count)]
    return [t.from_turn(int(start_at * t.turns)).capped(turns).scaled(scale) for t in base]


def _copy(t: Trajectory, agent: int, copy: int) -> Trajectory:
    if copy == 0:
        return t
    t = replace(t, id=f"{t.id}#{copy}")
    tag = f"agent{agent}: "
    if t.system_text:
        return replace(t, system_text=tag + t.system_text)
    if t.append_texts is not None:
        return replace(t, append_texts=(tag + t.append_texts[0],) + t.append_texts[1:])
    return t
