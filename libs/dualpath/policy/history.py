"""``DecodeHistory``: how long an agent's turns decode, learned from the turns it has run.

The scheduler's queue order favours the requests whose answers will take longest (longest
processing time first: in a closed loop of agents they are the critical path, and their
agents' next turns follow them). Nobody knows a request's decode length in advance — an
API's ``max_tokens`` is a cap, not a length — but an agent's turns are alike: the same tool
loop, the same kind of answer. So the scheduler predicts a session's next decode from what
it measured on that session's previous turns (from the prefill engine's hand-off to the
decode engine's finish, on the scheduler's own clock), as an exponentially weighted mean.
A session it has not seen yet is predicted the mean over the sessions it has seen (the
prior: with nothing known about an agent, expect the typical agent; 0 before any is seen);
a request with no session is predicted 0 (plain FIFO).

Bounded: at most ``max_sessions`` are remembered; the least recently updated is forgotten
first. No I/O, no clock of its own.
"""

from __future__ import annotations

from dualpath.policy.errors import InvalidThresholdError

__all__ = ["DecodeHistory"]


class DecodeHistory:
    """Per-session decode seconds, an exponentially weighted mean (module docstring).

    Raises:
        InvalidThresholdError: ``weight`` is not in (0, 1] or ``max_sessions`` < 1.
    """

    def __init__(self, *, weight: float = 0.5, max_sessions: int = 100_000) -> None:
        if not 0.0 < weight <= 1.0:
            raise InvalidThresholdError("weight", weight)
        if max_sessions < 1:
            raise InvalidThresholdError("max_sessions", max_sessions)
        self.weight, self.max_sessions = weight, max_sessions
        self._mean: dict[str, float] = {}  # insertion order = least recently updated first
        self._total = 0.0  # the sum of the per-session means (their mean is the prior)

    def observe(self, session: str, decode_s: float) -> None:
        """Session ``session`` decoded a turn in ``decode_s`` seconds (ignored without a
        session or for a negative duration)."""
        if not session or decode_s < 0:
            return
        old = self._mean.pop(session, None)
        if old is None and len(self._mean) >= self.max_sessions:
            self._total -= self._mean.pop(next(iter(self._mean)))
        new = decode_s if old is None else old + self.weight * (decode_s - old)
        self._mean[session] = new
        self._total += new - (old or 0.0)

    def predict(self, session: str) -> float:
        """Predicted decode seconds of ``session``'s next turn (the prior when unknown, 0
        without a session)."""
        if not session:
            return 0.0
        known = self._mean.get(session)
        return known if known is not None else self.prior()

    def knows(self, session: str) -> bool:
        """Whether ``session``'s turns have been measured."""
        return session in self._mean

    def prior(self) -> float:
        """The prediction for a session not seen yet: the mean over the sessions seen (0 when none)."""
        return self._total / len(self._mean) if self._mean else 0.0

    def __len__(self) -> int:
        return len(self._mean)
