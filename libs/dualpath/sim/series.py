"""Amounts over virtual time in fixed-width bins whose width doubles as the run grows.

A link records the bytes it moved, an engine the attention seconds it computed. A run's
length is not known in advance, so a series starts with ``width`` seconds per bin and, when
the run outgrows ``max_bins`` bins, merges neighbours pairwise (width x 2): memory stays
bounded and all widths are ``width * 2**k``, so series can be re-binned onto a common grid.
"""

from __future__ import annotations

__all__ = ["Series"]


class Series:
    """Per-bin totals of an amount spread uniformly over the intervals it was added for."""

    __slots__ = ("bins", "max_bins", "width")

    def __init__(self, width: float = 0.5, max_bins: int = 2048) -> None:
        self.width = width
        self.max_bins = max_bins
        self.bins: list[float] = []

    def _grow(self, t: float) -> None:
        while t >= self.width * self.max_bins:
            b = self.bins
            self.bins = [b[i] + (b[i + 1] if i + 1 < len(b) else 0.0) for i in range(0, len(b), 2)]
            self.width *= 2

    def add(self, t0: float, t1: float, amount: float) -> None:
        """Add ``amount`` spread uniformly over ``[t0, t1]`` (at ``t0`` when ``t1 <= t0``)."""
        if amount <= 0:
            return
        if t1 >= self.width * self.max_bins:
            self._grow(t1)
        w, bins = self.width, self.bins
        i0 = int(t0 / w)
        i1 = int(t1 / w) if t1 > t0 else i0
        if i1 >= len(bins):
            bins.extend([0.0] * (i1 + 1 - len(bins)))
        if i0 == i1:
            bins[i0] += amount
            return
        rate = amount / (t1 - t0)
        bins[i0] += rate * ((i0 + 1) * w - t0)
        for i in range(i0 + 1, i1):
            bins[i] += rate * w
        bins[i1] += rate * (t1 - i1 * w)

    def total(self) -> float:
        """The sum of every amount added."""
        return sum(self.bins)

    def rebinned(self, width: float, end: float) -> list[float]:
        """Totals on a grid of ``width`` (a multiple of this series' width) up to ``end``."""
        k = max(1, round(width / self.width))
        n = int(end / width) + 1
        out = [0.0] * n
        for i, v in enumerate(self.bins):
            j = i // k
            if j < n:
                out[j] += v
        return out

    def window(self, t0: float, t1: float) -> float:
        """Total within ``[t0, t1)``, bins cut proportionally at the edges."""
        w, total = self.width, 0.0
        for i, v in enumerate(self.bins):
            a, b = i * w, (i + 1) * w
            lo, hi = max(a, t0), min(b, t1)
            if hi > lo:
                total += v * (hi - lo) / w
        return total
