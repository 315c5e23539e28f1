"""``Supervisor``: keep a set of child processes running, like a small process manager.

Each child is a command line with its environment and log file. A background thread polls
the children; one that exits while the supervisor runs is restarted after a back-off that
doubles with each quick death (``min_backoff`` .. ``max_backoff``) and resets once the
child has stayed up ``stable_after`` seconds. Every death and restart is an event: kept in
``events`` (for tests and reports), appended as a JSON line to ``<logs>/supervisor.log`` and
passed to the ``on_event`` callback. The other children keep running meanwhile.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dualpath.childproc import die_with_parent
from dualpath.runtime import PARENT_ENV

__all__ = ["Child", "Supervisor", "SupervisorEvent"]


@dataclass(slots=True, kw_only=True)
class Child:
    """One supervised process: how to run it and its current state."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    quick_deaths: int = 0  # deaths in a row before ``stable_after``: sets the back-off
    restart_at: float | None = None  # a pending restart
    watches_parent: bool = True  # reads PARENT_ENV (our services); False: a foreign binary such as nats-server

    def spawn(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            env = {**self.env, PARENT_ENV: str(os.getpid())}  # the child stops if this process dies
            # A foreign binary cannot watch PARENT_ENV: the kernel's parent-death signal stops it instead.
            hook = None if self.watches_parent else die_with_parent()
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=hook)
        self.started_at = time.monotonic()
        self.restart_at = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SupervisorEvent:
    """A child died (``kind="exited"``) or was started again (``kind="restarted"``)."""

    kind: str
    name: str
    ts: float  # wall clock
    code: int | None = None
    restarts: int = 0
    backoff_s: float = 0.0
    pid: int | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "event": f"child_{self.kind}",
                "child": self.name,
                "ts": self.ts,
                "code": self.code,
                "restarts": self.restarts,
                "backoff_s": self.backoff_s,
                "pid": self.pid,
            }
        )


@dataclass(slots=True, kw_only=True)
class Supervisor:
    """Children by name, in start order; ``watch()`` starts the restart thread."""

    logs: Path
    min_backoff: float = 0.5
    max_backoff: float = 30.0
    stable_after: float = 30.0
    poll: float = 0.1
    on_event: Callable[[SupervisorEvent], None] | None = None
    children: dict[str, Child] = field(default_factory=dict)
    events: list[SupervisorEvent] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _thread: threading.Thread | None = None

    def add(self, name: str, cmd: list[str], env: dict[str, str], *, watches_parent: bool = True) -> Child:
        """Start a child now; ``watches_parent=False`` for a program that does not read
        ``PARENT_ENV`` (see ``dualpath.childproc``). Raises OSError if it cannot be started."""
        child = Child(name=name, cmd=cmd, env=env, log=self.logs / f"{name}.log", watches_parent=watches_parent)
        child.spawn()
        with self._lock:
            self.children[name] = child
        return child

    def watch(self) -> None:
        """Start restarting children that exit (idempotent)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
            self._thread.start()

    def unwatch(self) -> None:
        """Stop restarting (children keep running); used before a deliberate shutdown."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def restart_now(self, name: str) -> None:
        """Start a child that is down without waiting for its back-off (e.g. after a test stopped it)."""
        with self._lock:
            child = self.children[name]
            if child.proc is None or child.proc.poll() is not None:
                child.spawn()

    def hold(self, name: str) -> None:
        """Leave ``name`` down until ``restart_now`` (a test that simulates a long outage)."""
        with self._lock:
            self.children[name].restart_at = float("inf")

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            with self._lock:
                for child in list(self.children.values()):
                    self._tend(child, time.monotonic())

    def _tend(self, child: Child, now: float) -> None:
        proc = child.proc
        if proc is None or proc.poll() is None:
            return
        if child.restart_at is None:  # just died
            lived = now - child.started_at
            child.quick_deaths = 0 if lived >= self.stable_after else child.quick_deaths + 1
            backoff = min(self.max_backoff, self.min_backoff * 2 ** max(0, child.quick_deaths - 1))
            child.restart_at = now + backoff
            self._emit(
                SupervisorEvent(
                    kind="exited",
                    name=child.name,
                    ts=time.time(),
                    code=proc.returncode,
                    restarts=child.restarts,
                    backoff_s=backoff,
                    pid=proc.pid,
                )
            )
        elif now >= child.restart_at:
            try:
                child.spawn()
            except OSError as exc:
                child.restart_at = now + self.max_backoff
                self._emit(SupervisorEvent(kind="spawn_failed", name=child.name, ts=time.time(), backoff_s=self.max_backoff))
                print(f"supervisor: cannot start {child.name}: {exc}", flush=True)
                return
            child.restarts += 1
            self._emit(
                SupervisorEvent(
                    kind="restarted", name=child.name, ts=time.time(), restarts=child.restarts, pid=child.proc.pid if child.proc else None
                )
            )

    def _emit(self, event: SupervisorEvent) -> None:
        self.events.append(event)
        try:
            with open(self.logs / "supervisor.log", "a") as f:
                f.write(event.to_json() + "\n")
        except OSError:
            pass
        if self.on_event is not None:
            self.on_event(event)

    def stop(self, names: list[str], timeout: float) -> dict[str, int | None]:
        """SIGTERM ``names`` together, wait up to ``timeout``, SIGKILL the rest; returns exit codes
        (None when killed). They are not restarted."""
        with self._lock:
            group = [self.children.pop(n) for n in names if n in self.children]
        for child in group:
            if child.proc is not None and child.proc.poll() is None:
                try:
                    child.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        for child in group:
            if child.proc is None:
                continue
            try:
                codes[child.name] = child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(child.proc)
                codes[child.name] = None
        return codes


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the child leads its own group
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()
