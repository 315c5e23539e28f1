"""The attempt core's lifecycle rules, event by event (no engine, no I/O)."""

from __future__ import annotations

from enum import Enum

import pytest

from dualpath.core.attempts import MAX_REMEMBERED, AttemptTable, Discard, Drop, Halt, Refuse, Start, Stop


class Ph(Enum):
    WAITING = "waiting"
    RUNNING = "running"

    @property
    def queued(self) -> bool:
        return self is Ph.WAITING


def table(**kw) -> AttemptTable[str]:
    return AttemptTable(Ph.WAITING, **kw)


def kinds(cmds) -> list[tuple[str, str]]:
    """Each command as (its kind, the task it concerns)."""
    out = []
    for c in cmds:
        task = c.run.task if isinstance(c, (Start, Drop, Halt)) else c.task
        out.append((type(c).__name__, task))
    return out


def running(t: AttemptTable[str], rid: str, attempt: int, task: str):
    [start] = t.arrive(rid, attempt, task)
    assert isinstance(start, Start)
    t.move(start.run, Ph.RUNNING)
    return start.run


def test_a_new_request_starts_and_a_copy_of_it_is_a_duplicate():
    t = table()
    assert kinds(t.arrive("r", 0, "a0")) == [("Start", "a0")]
    assert kinds(t.arrive("r", 0, "a0 again")) == [("Refuse", "a0 again")]
    assert t.arrive("r", 0, "x")[0].detail == "duplicate"
    assert t.holding() == [("r", 0)]


def test_a_newer_attempt_replaces_a_queued_run_at_once():
    t = table()
    t.arrive("r", 0, "a0")
    cmds = t.arrive("r", 2, "a2")
    assert kinds(cmds) == [("Drop", "a0"), ("Start", "a2")]
    assert cmds[0].run.stop is Stop.SUPERSEDED
    assert t.get("r").task == "a2" and t.holding() == [("r", 2)]


def test_a_newer_attempt_waits_for_an_active_run_to_leave_and_starts_then():
    t = table()
    old = running(t, "r", 0, "a0")
    cmds = t.arrive("r", 1, "a1")
    assert kinds(cmds) == [("Halt", "a0")] and old.stop is Stop.SUPERSEDED
    assert t.holding() == [("r", 0), ("r", 1)] and t.successor("r") == "a1"
    assert t.arrive("r", 1, "a1 copy")[0].detail == "duplicate"  # the successor's copy
    assert t.arrive("r", 0, "a0 late")[0].detail == "superseded"
    assert kinds(t.leave(old)) == [("Start", "a1")]
    assert t.get("r").attempt == 1 and t.successor("r") is None


def test_a_still_newer_attempt_discards_the_successor_that_never_started():
    t = table()
    old = running(t, "r", 0, "a0")
    t.arrive("r", 1, "a1")
    cmds = t.arrive("r", 2, "a2")
    assert kinds(cmds) == [("Discard", "a1")] and cmds[0].why is Stop.SUPERSEDED  # a0 already halts: no second Halt
    assert kinds(t.leave(old)) == [("Start", "a2")]


def test_older_attempts_are_refused_and_a_finished_attempt_is_not_run_again():
    t = table()
    run = running(t, "r", 3, "a3")
    assert t.arrive("r", 2, "a2")[0].detail == "superseded"
    assert t.leave(run, finished=True) == []
    assert len(t) == 0
    assert t.arrive("r", 3, "a3 late copy")[0].detail == "superseded"
    assert kinds(t.arrive("r", 4, "a4")) == [("Start", "a4")]


def test_a_run_that_failed_leaves_and_its_attempt_may_come_again():
    t = table()
    run = running(t, "r", 0, "a0")
    t.leave(run)  # failed: the scheduler decides; a copy of the same attempt is not refused
    assert kinds(t.arrive("r", 0, "a0")) == [("Start", "a0")]


def test_the_schedulers_retry_cancel_retires_older_attempts_and_stops_them_silently():
    t = table()
    run = running(t, "r", 1, "a1")
    assert t.retry_cancel("r", 1) == [] and run.stop is None  # attempt 1 is not older than 1
    cmds = t.retry_cancel("r", 2)
    assert kinds(cmds) == [("Halt", "a1")] and run.stop is Stop.SUPERSEDED
    assert t.leave(run) == []
    assert t.arrive("r", 1, "a1 late")[0].detail == "superseded"  # its hand-off crossed the retry
    assert kinds(t.arrive("r", 2, "a2")) == [("Start", "a2")]


def test_a_retry_cancel_drops_a_queued_run_and_starts_a_successor_it_does_not_retire():
    t = table()
    old = running(t, "r", 0, "a0")
    t.arrive("r", 2, "a2")
    t.move(old, Ph.WAITING)  # (a run back in a queue, e.g. a prefill job whose load ended)
    old.stop = None
    cmds = t.retry_cancel("r", 1)
    assert kinds(cmds) == [("Drop", "a0"), ("Start", "a2")]


def test_a_retry_cancel_discards_a_successor_below_it():
    t = table()
    old = running(t, "r", 0, "a0")
    t.arrive("r", 1, "a1")
    cmds = t.retry_cancel("r", 2)
    assert kinds(cmds) == [("Discard", "a1")]
    assert t.leave(old) == []  # nothing left to start
    assert len(t) == 0


def test_a_clients_cancel_drops_a_queued_run_halts_an_active_one_and_discards_the_successor():
    t = table()
    t.arrive("q", 0, "q0")
    cmds = t.client_cancel("q")
    assert kinds(cmds) == [("Drop", "q0")] and cmds[0].run.stop is Stop.CANCELLED and "q" not in t
    run = running(t, "r", 0, "r0")
    t.arrive("r", 1, "r1")
    cmds = t.client_cancel("r")
    assert kinds(cmds) == [("Discard", "r1")] and cmds[0].why is Stop.CANCELLED  # a0 already halts, silently
    assert run.stop is Stop.SUPERSEDED
    other = running(t, "s", 0, "s0")
    assert kinds(t.client_cancel("s")) == [("Halt", "s0")] and other.stop is Stop.CANCELLED
    assert t.client_cancel("s") == []  # once
    assert t.leave(other, finished=True) == []


def test_a_newer_attempt_turns_a_clients_cancel_into_a_silent_stop():
    t = table()
    run = running(t, "r", 0, "r0")
    t.client_cancel("r")
    assert kinds(t.arrive("r", 1, "r1")) == [("Halt", "r0")] and run.stop is Stop.SUPERSEDED
    assert kinds(t.leave(run)) == [("Start", "r1")]


def test_a_cancel_that_came_before_its_hand_off_ends_the_hand_off_on_arrival_when_remembered():
    remembering, forgetting = table(remember_cancels=True), table()
    for t in (remembering, forgetting):
        assert t.client_cancel("r") == []
    assert kinds(remembering.arrive("r", 0, "a0")) == [("Refuse", "a0")]
    assert remembering.arrive("r", 0, "a0")[0].detail == "superseded"  # not run later either
    assert kinds(remembering.arrive("r", 1, "a1")) == [("Start", "a1")]  # a later run of the request is not cancelled
    assert kinds(forgetting.arrive("r", 0, "a0")) == [("Start", "a0")]


def test_memories_are_bounded_and_forget_the_oldest_first():
    t = table(remember_cancels=True)
    for i in range(MAX_REMEMBERED + 10):
        t.retry_cancel(f"r{i}", 5)
    assert t.retired_below("r0") == 0 and t.retired_below(f"r{MAX_REMEMBERED + 9}") == 5
    assert kinds(t.arrive("r0", 1, "x")) == [("Start", "x")]


@pytest.mark.parametrize("seed", range(20))
def test_random_event_sequences_keep_at_most_one_run_and_one_successor_per_request_and_start_only_the_newest(seed):
    """Whatever the order of arrivals, cancels and leaves: one current run per request, a
    successor only behind a run and newer than it, and nothing older than a started attempt starts."""
    import random

    rng = random.Random(seed)
    t = table(remember_cancels=True)
    started: dict[str, int] = {}
    for _ in range(400):
        rid = rng.choice("abc")
        op = rng.random()
        if op < 0.4:
            n = rng.randrange(6)
            cmds = t.arrive(rid, n, f"{rid}{n}")
        elif op < 0.55:
            cmds = t.retry_cancel(rid, rng.randrange(6))
        elif op < 0.65:
            cmds = t.client_cancel(rid)
        else:
            run = t.get(rid)
            if run is None:
                continue
            if rng.random() < 0.5 and not run.stopping:
                t.move(run, rng.choice(list(Ph)))
                continue
            cmds = t.leave(run, finished=rng.random() < 0.5)
        for c in cmds:
            if isinstance(c, Start):
                assert c.run.attempt >= started.get(rid, -1)
                started[rid] = c.run.attempt
                assert c.run.attempt >= t.retired_below(rid)
            if isinstance(c, (Drop, Halt)):
                assert c.run.stop is not None
            if isinstance(c, Refuse):
                assert c.detail in ("superseded", "duplicate", "cancelled")
            if isinstance(c, Discard):
                assert t.successor(rid) != c.task
        for key in "abc":
            run, succ = t.get(key), t.successor(key)
            if succ is not None:
                assert run is not None and run.stopping  # a successor waits only for a run on its way out
                assert int(succ[1:]) > run.attempt


def test_a_cancel_request_is_the_schedulers_retry_cancel_with_an_attempt_and_the_clients_without():
    t = table()
    run = running(t, "r", 1, "r1")
    assert t.cancel("r", 1) == [] and run.stop is None  # retry cancel below 1: not this run
    assert kinds(t.cancel("r")) == [("Halt", "r1")] and run.stop is Stop.CANCELLED


def test_leaving_forgets_the_services_record_so_a_record_pointing_back_at_its_attempt_is_no_cycle():
    t = table()
    run = running(t, "r", 0, "r0")
    run.state = {"attempt": run}  # a service record that refers to its attempt
    t.leave(run, finished=True)
    assert run.state is None
