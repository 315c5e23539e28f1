"""Process runtime shared by every service: logging, tracing, metrics, bus connection, clean shutdown.

A service is an ``async def main(bus, stop, tasks)`` coroutine (``async def main(bus, stop)`` is
still accepted). ``run_service`` configures the process and opens two task groups, one inside
the other, so every task of the process has an owner:

- the bus's handler group (``Bus.open``): one task per message being handled;
- the service's own group, ``tasks``, handed to ``main``: background work the service starts
  (dispatches, periodic reports, persists) goes there with ``tasks.start_soon``, never as a
  bare ``create_task``.

On SIGINT/SIGTERM ``stop`` is set; ``main`` finishes in-flight work and returns; the service's
own tasks get ``_GRACE_S`` seconds to end before they are cancelled; then the bus closes
(in-flight handlers get their own grace) and the process exits with status 0. A service
started by a supervisor (``PARENT_ENV`` names its pid) stops the same way when that parent is
gone: a ``dualpath up`` or test run killed with SIGKILL leaves no orphaned stack behind.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import sys
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import TaskGroup

from dualpath.bus import Bus
from dualpath.config import BusConfig
from dualpath.telemetry.logs import configure_logging, get_logger
from dualpath.telemetry.metrics import configure_metrics, shutdown_metrics
from dualpath.telemetry.tracing import configure_tracing, shutdown_tracing

__all__ = ["PARENT_ENV", "ServiceMain", "periodic", "run_service", "start_logged", "wait_any"]

ServiceMain = Callable[[Bus, asyncio.Event, TaskGroup], Awaitable[None]] | Callable[[Bus, asyncio.Event], Awaitable[None]]

_GRACE_S = 10.0  # seconds the service's own tasks (persists, final events) get to end after ``main`` returned
PARENT_ENV = "DUALPATH_PARENT_PID"  # set by the supervisor: the pid whose death stops this service
_PARENT_POLL_S = 1.0


async def _call_main(main: ServiceMain, bus: Bus, stop: asyncio.Event, tasks: TaskGroup) -> None:
    if len(inspect.signature(main).parameters) >= 3:
        await main(bus, stop, tasks)  # type: ignore[call-arg]
    else:
        await main(bus, stop)  # type: ignore[call-arg]


async def _run(name: str, bus_cfg: BusConfig, main: ServiceMain) -> None:
    log = get_logger(name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    parent = os.environ.get(PARENT_ENV, "")
    if parent.isdigit():
        _watch_parent(loop, stop, int(parent))
    async with Bus.open(bus_cfg.urls(), name, **bus_cfg.connect_options()) as bus:
        log.info("service_started", nats=bus_cfg.nats_url)
        try:
            async with anyio.create_task_group() as tasks:
                await _call_main(main, bus, stop, tasks)
                tasks.cancel_scope.deadline = anyio.current_time() + _GRACE_S
        finally:
            log.info("service_stopped")


def _watch_parent(loop: asyncio.AbstractEventLoop, stop: asyncio.Event, parent: int) -> None:
    """Set ``stop`` once this process's parent is no longer ``parent`` (it died: the orphan was
    re-parented); checked every ``_PARENT_POLL_S`` by a loop callback, not a task."""
    if stop.is_set():
        return
    if os.getppid() != parent:
        get_logger("runtime").warning("parent_gone", parent=parent)
        stop.set()
        return
    loop.call_later(_PARENT_POLL_S, _watch_parent, loop, stop, parent)


def _fatal_message(exc: BaseException) -> str:
    """One line for what ended the service: the first error inside (nested) exception groups."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for inner in e.exceptions:
                walk(inner)
        else:
            leaves.append(e)

    walk(exc)
    first = leaves[0] if leaves else exc
    return f"{first}" + (f" (and {len(leaves) - 1} more errors)" if len(leaves) > 1 else "")


def run_service(name: str, bus_cfg: BusConfig, main: ServiceMain) -> int:
    """Run ``main`` until it returns or the process is asked to stop; returns the exit status."""
    configure_logging(name)
    configure_tracing(name)
    try:
        configure_metrics(name, bus_cfg.metrics_port)
        asyncio.run(_run(name, bus_cfg, main))
        return 0
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # noqa: BLE001 - report a clear fatal error, not a traceback
        get_logger(name).exception("service_failed", error=str(exc))
        print(f"{name}: fatal: {_fatal_message(exc)}", file=sys.stderr)
        return 1
    finally:
        shutdown_metrics()
        shutdown_tracing()


async def periodic(stop: asyncio.Event, interval: float, tick: Callable[[], Awaitable[None]]) -> None:
    """Call ``tick()`` every ``interval`` seconds until ``stop`` is set (errors are logged, not fatal)."""
    log = get_logger("runtime")
    while not stop.is_set():
        try:
            await tick()
        except Exception as exc:  # noqa: BLE001 - a failed report must not stop the service
            log.warning("periodic_failed", error=str(exc))
        with anyio.move_on_after(interval):
            await stop.wait()


def start_logged(tasks: TaskGroup, what: str, fn: Callable[..., Awaitable[object]], *args: object) -> None:
    """Start ``fn(*args)`` in ``tasks``; an exception it raises is logged as ``what`` and goes no
    further (one request's background work must not end the service's task group)."""

    async def run() -> None:
        try:
            await fn(*args)
        except Exception:  # noqa: BLE001 - logged with its traceback; the service goes on
            get_logger("runtime").exception("background_task_failed", task=what)

    tasks.start_soon(run, name=what)


async def wait_any(*events: asyncio.Event) -> None:
    """Return as soon as one of ``events`` is set."""
    async with anyio.create_task_group() as group:

        async def one(event: asyncio.Event) -> None:
            await event.wait()
            group.cancel_scope.cancel()

        for event in events:
            group.start_soon(one, event)
