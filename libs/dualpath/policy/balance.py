"""Load-balance figures the system reports (paper §7): the max/avg ratio of a quantity
across members, e.g. storage-NIC bytes across nodes (1.53 with round robin, 1.18 with
DualPath) or attention time across prefill engines (≤ 1.06). 1.0 is perfect balance.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from dualpath.policy.errors import (
    EmptyValuesError,
    NegativeLoadError,
    UnknownMemberError,
)

__all__ = ["LoadAccumulator", "max_over_avg"]


def max_over_avg(values: Iterable[float], what: str = "values") -> float:
    """max(values) / mean(values). All zeros (nothing happened yet) count as balanced: 1.0.

    Raises:
        EmptyValuesError: ``values`` is empty.
        NegativeLoadError: a value is negative (a load cannot be).
    """
    vals = list(values)
    if not vals:
        raise EmptyValuesError(what)
    if min(vals) < 0:
        raise NegativeLoadError(what, min(vals))
    total = sum(vals)
    if total == 0:
        return 1.0
    return max(vals) * len(vals) / total


class LoadAccumulator:
    """Sums a load per member; members declared up front count even while idle (an idle
    storage NIC is exactly the imbalance the paper measures).

    Raises:
        EmptyValuesError: constructed with no members.
    """

    __slots__ = ("_totals", "what")

    def __init__(self, members: Iterable[Hashable], what: str = "load") -> None:
        self._totals: dict[Hashable, float] = {m: 0.0 for m in members}
        self.what = what
        if not self._totals:
            raise EmptyValuesError(what)

    def add(self, member: Hashable, amount: float) -> None:
        """Add ``amount`` (bytes, seconds, …) to ``member``'s total.

        Raises:
            UnknownMemberError: ``member`` was not declared.
            NegativeLoadError: ``amount`` is negative.
        """
        if amount < 0:
            raise NegativeLoadError(self.what, amount)
        if member not in self._totals:
            raise UnknownMemberError(self.what, member)
        self._totals[member] += amount

    def totals(self) -> dict[Hashable, float]:
        """A copy of the per-member totals."""
        return dict(self._totals)

    def max_over_avg(self) -> float:
        """max/avg of the totals (1.0 while all are zero)."""
        return max_over_avg(self._totals.values(), self.what)

    def reset(self) -> None:
        """Zero every total (e.g. to measure a window such as the job's first 5%)."""
        for member in self._totals:
            self._totals[member] = 0.0
