"""Process runtime shared by every service: logging, tracing, metrics, bus connection, clean shutdown.

A service is an ``async def main(bus, stop: asyncio.Event)`` coroutine; ``run_service``
configures the process, connects to NATS, runs it, and on SIGINT/SIGTERM sets ``stop`` so the
service finishes in-flight work and exits with status 0.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Awaitable, Callable

from dualpath.bus import Bus
from dualpath.config import BusConfig
from dualpath.telemetry.logs import configure_logging, get_logger
from dualpath.telemetry.metrics import configure_metrics, shutdown_metrics
from dualpath.telemetry.tracing import configure_tracing, shutdown_tracing

__all__ = ["ServiceMain", "periodic", "run_service"]

ServiceMain = Callable[[Bus, asyncio.Event], Awaitable[None]]


async def _run(name: str, bus_cfg: BusConfig, main: ServiceMain) -> None:
    log = get_logger(name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    bus = await Bus.connect(bus_cfg.urls(), name, **bus_cfg.connect_options())
    log.info("service_started", nats=bus_cfg.nats_url)
    try:
        await main(bus, stop)
    finally:
        await bus.close()
        log.info("service_stopped")


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
        print(f"{name}: fatal: {exc}", file=sys.stderr)
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
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass
