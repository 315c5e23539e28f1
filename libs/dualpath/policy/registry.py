"""Policies by name, one interface: ``get_policy(name, thresholds).schedule(waiting, state)``.

Names (``SchedulerConfig.policy``, ``--policy``):

- ``dualpath``: the paper's algorithm (``inter.schedule_dualpath``); read side = shorter
  storage read queue.
- ``round_robin``, ``least_tokens``: the baselines of ``baselines``. Round robin assigns the
  read side round robin too (the paper's load-balance comparison, SNIC max/avg 1.53 → 1.18,
  is round robin vs DualPath); least tokens reads on the side with the shorter storage read
  queue, so it differs from ``dualpath`` only in engine selection.
- ``basic``: the paper's Basic system: ``round_robin`` selection and every read on the
  prefill side. Round robin because the paper's ablation adds "the scheduling algorithm"
  on top of dual-path loading and compares load balance against round robin, so that is
  the scheduler its framework had before.

``read_path`` (``auto`` | ``pe`` | ``de``) overrides the read side of any policy except
``basic``, whose read side is PE by definition.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dualpath.policy.baselines import schedule_least_tokens, schedule_round_robin
from dualpath.policy.errors import UnknownPolicyError
from dualpath.policy.inter import schedule_dualpath
from dualpath.policy.state import ClusterState
from dualpath.policy.thresholds import Thresholds
from dualpath.policy.values import Assignment, PendingRequest, ReadPath

__all__ = ["POLICY_NAMES", "Policy", "get_policy"]

_Schedule = Callable[[Sequence[PendingRequest], ClusterState, Thresholds, ReadPath], list[Assignment]]

_SCHEDULERS: dict[str, _Schedule] = {
    "dualpath": schedule_dualpath,
    "round_robin": schedule_round_robin,
    "least_tokens": schedule_least_tokens,
    "basic": schedule_round_robin,
}

POLICY_NAMES = tuple(_SCHEDULERS)


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """A named inter-engine policy bound to its thresholds and read-side rule."""

    name: str
    thresholds: Thresholds
    read_path: ReadPath
    _schedule: _Schedule

    def schedule(self, waiting: Sequence[PendingRequest], state: ClusterState) -> list[Assignment]:
        """Place the longest FIFO prefix of ``waiting`` that fits; the rest keeps waiting.

        Returns one ``Assignment`` per placed request, in queue order. ``state`` is not
        modified: apply each assignment with ``state.on_assigned`` before the next pass.
        """
        return self._schedule(waiting, state, self.thresholds, self.read_path)


def get_policy(name: str, thresholds: Thresholds, *, read_path: ReadPath | str = ReadPath.AUTO) -> Policy:
    """The policy called ``name`` (see the module docstring).

    Raises:
        UnknownPolicyError: ``name`` is not in ``POLICY_NAMES`` or ``read_path`` is not
            ``auto``, ``pe`` or ``de``.
    """
    schedule = _SCHEDULERS.get(name)
    if schedule is None:
        raise UnknownPolicyError(name, list(POLICY_NAMES))
    try:
        path = ReadPath(read_path)
    except ValueError:
        raise UnknownPolicyError(f"read_path={read_path}", [p.value for p in ReadPath]) from None
    if name == "basic":
        path = ReadPath.PE
    return Policy(name=name, thresholds=thresholds, read_path=path, _schedule=schedule)
