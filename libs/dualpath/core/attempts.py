"""``AttemptTable``: an engine's requests and the lifecycle of their attempts, with no I/O.

A scheduler may place a request again (a retry after a failure, or a resubmission after a
scheduler failover): ``attempt`` numbers orders the placements as engines see them, the
newest wins. An engine holds at most one run per request, the *current* attempt, and at most
one *successor*: a newer attempt waiting for the current one to leave. The rules, the same
for the prefill and the decode engine:

- **arrive**: a new request starts; a copy of the current attempt is a duplicate; an attempt
  older than the newest held or started one, or one the scheduler already retired, is refused
  (``superseded``); a newer one replaces the current attempt (it stops silently) and starts
  at once when the current one was only queued, else as soon as it has left;
- **retry cancel** (``CancelRequest.before_attempt``): attempts below it are retired (a late
  hand-off of one is refused) and stopped silently;
- **client cancel**: the request's run stops and is told as cancelled; a successor never
  starts; with ``remember_cancels`` a cancel of a request not held here is remembered, so a
  hand-off that crossed it ends on arrival instead of running for nobody;
- **leave**: a run ended (finished, failed or stopped at a safe point); a finished one
  retires its own attempt (a late copy of the hand-off must not run it again); the successor
  starts.

Stopping depends on where a run is: a *queued* one (``Phase.queued``: waiting in a queue,
nothing of it under way) is dropped at once (``Drop``); an *active* one (a KV load writing, a
batch or decode step running it, a hand-off under way) is told to stop (``Halt``) and leaves
at its next safe point, which the service reports with ``leave``.

The service keeps this table as its one table of requests: each ``Attempt`` has the service's
own ``phase`` (an enum like vLLM's ``RequestStatus``, whose members say whether they are
queued) and the service's record of the run (``state``). Events go in as method calls; the
commands that come back say what the service must do, in order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, Protocol, TypeVar

__all__ = [
    "Attempt",
    "AttemptCommand",
    "AttemptTable",
    "Discard",
    "Drop",
    "Halt",
    "Phase",
    "Refuse",
    "Start",
    "Stop",
]

T = TypeVar("T")  # the service's task message (PrefillTask, DecodeTask)
MAX_REMEMBERED = 4096  # requests remembered as retired below an attempt, or as cancelled (oldest forgotten first)


class Phase(Protocol):
    """Where a run is: the service's own enum; ``queued`` members can be dropped at once."""

    @property
    def queued(self) -> bool: ...


class Stop(Enum):
    """Why a run stops before its end."""

    SUPERSEDED = "superseded"  # a newer attempt replaced it, or a retry cancel retired it: silently
    CANCELLED = "cancelled"  # its client cancelled it: told to the scheduler


@dataclass(slots=True, eq=False)
class Attempt(Generic[T]):
    """One run of a request held by an engine."""

    request_id: str
    attempt: int
    task: T
    phase: Phase
    stop: Stop | None = None  # set when it must leave at its next safe point (``Halt``)
    state: Any = None  # the service's record of the run (a prefill job, a decode sequence)

    @property
    def stopping(self) -> bool:
        return self.stop is not None


@dataclass(frozen=True, slots=True)
class Start(Generic[T]):
    """Run ``run`` (a new request, or a successor whose predecessor left)."""

    run: Attempt[T]


@dataclass(frozen=True, slots=True)
class Refuse(Generic[T]):
    """Answer an arriving ``task`` with ``detail`` (``superseded``, ``duplicate``, ``cancelled``)
    and run nothing; for ``superseded`` and ``cancelled`` the attempt's buffer slot is not
    needed; ``cancelled`` ends the request here (reported finished)."""

    task: T
    detail: str


@dataclass(frozen=True, slots=True)
class Discard(Generic[T]):
    """A successor that never started is given up (replaced by a newer one, retired, or its
    client cancelled the request: ``why``)."""

    task: T
    why: Stop


@dataclass(frozen=True, slots=True)
class Drop(Generic[T]):
    """A queued run is taken out of the service's queues now and has left (``run.stop`` says
    why); the table no longer holds it."""

    run: Attempt[T]


@dataclass(frozen=True, slots=True)
class Halt(Generic[T]):
    """An active run must stop at its next safe point (``run.stop`` says why), then ``leave``."""

    run: Attempt[T]


AttemptCommand = Start[T] | Refuse[T] | Discard[T] | Drop[T] | Halt[T]


def _remember(memory: OrderedDict[str, Any], rid: str, value: Any) -> None:
    memory[rid] = value
    memory.move_to_end(rid)
    while len(memory) > MAX_REMEMBERED:
        memory.popitem(last=False)


class AttemptTable(Generic[T]):
    """An engine's requests, one current attempt each (see the module docstring)."""

    def __init__(self, first_phase: Phase, *, remember_cancels: bool = False) -> None:
        self._first_phase = first_phase  # a started run's phase until the service moves it on
        self._runs: dict[str, Attempt[T]] = {}
        self._successors: dict[str, tuple[int, T]] = {}
        self._retired: OrderedDict[str, int] = OrderedDict()  # request -> attempts below this one are over
        self._cancels: OrderedDict[str, None] | None = OrderedDict() if remember_cancels else None

    # ---- views -------------------------------------------------------------------------------
    def get(self, request_id: str) -> Attempt[T] | None:
        """The current run of ``request_id``, or None."""
        return self._runs.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._runs

    def __len__(self) -> int:
        return len(self._runs)

    def __iter__(self) -> Iterator[Attempt[T]]:
        return iter(list(self._runs.values()))

    def in_phase(self, *phases: Phase) -> list[Attempt[T]]:
        return [a for a in self._runs.values() if a.phase in phases]

    def holding(self) -> list[tuple[str, int]]:
        """Every (request, attempt) held here: current runs, then successors waiting."""
        return [(a.request_id, a.attempt) for a in self._runs.values()] + [(rid, n) for rid, (n, _) in self._successors.items()]

    def successor(self, request_id: str) -> T | None:
        held = self._successors.get(request_id)
        return held[1] if held is not None else None

    def retired_below(self, request_id: str) -> int:
        return self._retired.get(request_id, 0)

    # ---- events ------------------------------------------------------------------------------
    def arrive(self, request_id: str, attempt: int, task: T) -> list[AttemptCommand[T]]:
        """A task for ``request_id`` (its ``attempt``) arrived."""
        if self._cancels is not None and request_id in self._cancels:
            del self._cancels[request_id]
            self._retire(request_id, attempt + 1)
            return [Refuse(task, Stop.CANCELLED.value)]
        newest = self._newest(request_id)
        if attempt < self.retired_below(request_id) or (newest is not None and attempt < newest):
            return [Refuse(task, Stop.SUPERSEDED.value)]
        if newest is not None and attempt == newest:
            return [Refuse(task, "duplicate")]
        if newest is None:
            return [Start(self._start(request_id, attempt, task))]
        self._retire(request_id, attempt)  # a successor that never starts still retires what it replaced
        cmds: list[AttemptCommand[T]] = self._stop_below(request_id, attempt)
        if request_id in self._runs:  # it leaves at its safe point; this one starts then
            self._successors[request_id] = (attempt, task)
        else:
            cmds.append(Start(self._start(request_id, attempt, task)))
        return cmds

    def retry_cancel(self, request_id: str, before: int) -> list[AttemptCommand[T]]:
        """The scheduler retried the request: attempts below ``before`` are over, silently."""
        self._retire(request_id, before)
        cmds = self._stop_below(request_id, before)
        run = self._runs.get(request_id)
        if run is None:  # nothing current: a successor at or above ``before`` may start now
            cmds += self._promote(request_id)
        return cmds

    def cancel(self, request_id: str, before_attempt: int = -1) -> list[AttemptCommand[T]]:
        """A ``CancelRequest``: the scheduler's retry cancel when ``before_attempt >= 0``, else its client's."""
        if before_attempt >= 0:
            return self.retry_cancel(request_id, before_attempt)
        return self.client_cancel(request_id)

    def client_cancel(self, request_id: str) -> list[AttemptCommand[T]]:
        """The request's client cancelled it: its run stops (told as cancelled), no successor starts."""
        cmds: list[AttemptCommand[T]] = []
        held = self._successors.pop(request_id, None)
        if held is not None:
            cmds.append(Discard(held[1], Stop.CANCELLED))
        run = self._runs.get(request_id)
        if run is not None:
            cmds += self._stop(run, Stop.CANCELLED)
        elif held is None and self._cancels is not None:
            _remember(self._cancels, request_id, None)
        return cmds

    def move(self, run: Attempt[T], phase: Phase) -> None:
        """``run`` moved on to ``phase`` (e.g. from waiting to running)."""
        run.phase = phase

    def leave(self, run: Attempt[T], *, finished: bool = False) -> list[AttemptCommand[T]]:
        """``run`` ended: ``finished`` (its work is done: a late copy must not run it again),
        failed, or stopped at its safe point. Its successor, if any, starts. The table forgets
        ``run.state``: a service record that points back at its ``Attempt`` would otherwise
        make a cycle that only the cyclic collector frees (and with it the run's KV views)."""
        run.state = None
        rid = run.request_id
        if finished:
            self._retire(rid, run.attempt + 1)
        if self._runs.get(rid) is not run:
            return []
        del self._runs[rid]
        return self._promote(rid)

    # ---- internals ---------------------------------------------------------------------------
    def _newest(self, request_id: str) -> int | None:
        held = self._successors.get(request_id)
        if held is not None:
            return held[0]
        run = self._runs.get(request_id)
        return run.attempt if run is not None else None

    def _start(self, request_id: str, attempt: int, task: T) -> Attempt[T]:
        run = Attempt(request_id=request_id, attempt=attempt, task=task, phase=self._first_phase)
        self._runs[request_id] = run
        self._retire(request_id, attempt)  # newest wins: an older attempt arriving later is stale
        return run

    def _stop(self, run: Attempt[T], why: Stop) -> list[AttemptCommand[T]]:
        if run.stop is Stop.SUPERSEDED or run.stop is why:
            return []  # already on its way out (a superseded run stays silent)
        run.stop = why
        if why is Stop.CANCELLED:  # the request is over here: a late copy of its hand-off must not run it
            self._retire(run.request_id, run.attempt + 1)
        if run.phase.queued:
            del self._runs[run.request_id]
            return [Drop(run)]
        return [Halt(run)]

    def _stop_below(self, request_id: str, before: int) -> list[AttemptCommand[T]]:
        cmds: list[AttemptCommand[T]] = []
        held = self._successors.get(request_id)
        if held is not None and held[0] < before:
            del self._successors[request_id]
            cmds.append(Discard(held[1], Stop.SUPERSEDED))
        run = self._runs.get(request_id)
        if run is not None and run.attempt < before:
            cmds += self._stop(run, Stop.SUPERSEDED)
        return cmds

    def _promote(self, request_id: str) -> list[AttemptCommand[T]]:
        held = self._successors.pop(request_id, None)
        if held is None:
            return []
        return [Start(self._start(request_id, held[0], held[1]))]

    def _retire(self, request_id: str, before: int) -> None:
        _remember(self._retired, request_id, max(before, self._retired.get(request_id, 0)))
