"""One agent of a simulation: its turns (``array('i')`` of append and generation lengths,
see ``workload``) and its progress through them. A module of its own so that the simulator's
compiled build holds it (the simulator reads an agent at every turn)."""

from __future__ import annotations

from array import array

__all__ = ["Agent"]


class Agent:
    """One agent's turns and its progress through them."""

    __slots__ = ("appends", "arrival", "ctx", "done_at", "gens", "index", "persisted", "system", "turn")

    def __init__(self, index: int, system: int, appends: array, gens: array, arrival: float) -> None:
        self.index = index
        self.system = system
        self.appends = appends
        self.gens = gens
        self.arrival = arrival
        self.turn = 0  # next turn to submit
        self.ctx = system  # tokens of context before the next turn's append
        self.persisted = 0  # tokens of its context whose Full Blocks are in storage
        self.done_at = -1.0

    @property
    def turns(self) -> int:
        return len(self.gens)

    def fresh(self) -> Agent:
        """A copy for another run: its own progress, the same turn arrays (no run changes
        them; ``copy.deepcopy`` of 48K agents would copy ~60 MB of them)."""
        a = Agent(self.index, self.system, self.appends, self.gens, self.arrival)
        a.turn, a.ctx, a.persisted, a.done_at = self.turn, self.ctx, self.persisted, self.done_at
        return a
