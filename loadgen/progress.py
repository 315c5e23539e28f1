"""A one-line live status on stderr, refreshed every second.

``auto`` draws it only when stderr is a terminal (rewriting the line in place);
``always`` prints a new line every second even to a file or pipe; ``never`` is silent.
"""

from __future__ import annotations

import sys
from typing import TextIO

import numpy as np

__all__ = ["Progress", "MODES"]

MODES = ("auto", "always", "never")


class Progress:
    """Renders run counters. Raises ValueError for an unknown mode."""

    def __init__(self, mode: str = "auto", stream: TextIO | None = None, label: str = "") -> None:
        if mode not in MODES:
            raise ValueError(f"progress mode must be one of {MODES}, got {mode!r}")
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = mode == "always" or (mode == "auto" and self.tty)
        self.label = label
        self.last_tokens, self.last_t = 0, 0.0
        self.drawn = False

    def update(
        self,
        *,
        elapsed: float,
        launched: int,
        total: int,
        active: int,
        finished: int,
        turns: int,
        errors: int,
        tokens: int,
        recent_ttft: list[float],
    ) -> None:
        """Draw the current state (no-op when disabled)."""
        if not self.enabled:
            return
        rate = (tokens - self.last_tokens) / max(elapsed - self.last_t, 1e-9)
        self.last_tokens, self.last_t = tokens, elapsed
        ttft = f"{np.median(recent_ttft):.3f}s" if recent_ttft else "-"
        width = len(str(total))
        line = (
            f"{self.label}{elapsed:7.1f}s agents {launched:{width}d}/{total} active {active:{width}d} "
            f"done {finished:{width}d} | turns {turns} err {errors} | {rate:8.0f} tok/s | ttft p50 {ttft}"
        )
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
            self.drawn = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the live line so later output starts on a fresh line."""
        if self.enabled and self.tty and self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False
