"""OpenTelemetry metrics with a Prometheus scrape endpoint, one per service process.

``configure_metrics(service, port)`` installs a ``MeterProvider`` whose reader is the
Prometheus exporter and serves ``GET /metrics`` on ``port`` (``BusConfig.metrics_port``,
env ``DUALPATH_METRICS_PORT``; 0 leaves metrics off and every instrument a no-op).

Instruments are named ``dualpath.*`` (Prometheus: ``dualpath_*``). Most are observable: a
callback reads state the service keeps anyway (engine ``seq``/``tok``, the node's read queue,
NIC byte counters) at scrape time, so no hot path does any extra work. ``nic_observations``
turns emulated NICs (``dualpath.transfer.nic.EmulatedNic``) into per-class byte counts and
utilisation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource

from dualpath.telemetry.logs import get_logger

if TYPE_CHECKING:
    from dualpath.transfer.types import TrafficClass

__all__ = ["Reading", "configure_metrics", "get_meter", "nic_observations", "observe", "shutdown_metrics"]

log = get_logger("metrics")
_provider: MeterProvider | None = None

# One reading of an observable instrument: a value and its attributes (labels).
Reading = tuple[float, dict[str, str]]
# Histogram bounds in seconds, from a millisecond TPOT to a minute-long TTFT.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 4.0, 10.0, 30.0, 60.0)


def configure_metrics(service: str, port: int) -> bool:
    """Export this process's metrics on ``http://0.0.0.0:{port}/metrics``; False when ``port`` is 0.

    Raises:
        OSError: the port cannot be bound (in use, or privileged).
    """
    global _provider
    if port <= 0:
        return False
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import start_http_server

    reader = PrometheusMetricReader(scope_info_enabled=False)  # names are unique; scope labels would be noise
    provider = MeterProvider(resource=Resource.create({"service.name": service}), metric_readers=[reader])
    start_http_server(port, addr="0.0.0.0")
    metrics.set_meter_provider(provider)
    _provider = provider
    log.info("metrics_endpoint", port=port)
    return True


def shutdown_metrics() -> None:
    """Stop the meter provider (the HTTP endpoint is a daemon thread and ends with the process)."""
    if _provider is not None:
        _provider.shutdown()


def get_meter(name: str = "dualpath") -> metrics.Meter:
    """The meter for ``name`` (instruments made before ``configure_metrics`` start working after it)."""
    return metrics.get_meter(name)


def observe(
    name: str,
    description: str,
    read: Callable[[], Iterable[Reading]],
    *,
    unit: str = "",
    kind: str = "gauge",
    meter: metrics.Meter | None = None,
) -> None:
    """Register an observable instrument whose value ``read()`` gives at each scrape.

    ``kind`` is ``gauge`` (a level: queue length, occupancy) or ``counter`` (a cumulative total
    that only grows: bytes). ``read`` runs in the scrape thread; one that raises is logged and
    yields nothing that scrape.

    Raises:
        ValueError: an unknown ``kind``.
    """
    meter = meter or get_meter()

    def callback(_options: CallbackOptions) -> Iterable[Observation]:
        # Scrapes run in the HTTP server's thread while the event loop changes the state read
        # here; iterating a dict or deque that changes raises RuntimeError: read again.
        for attempt in range(3):
            try:
                return [Observation(value, attrs) for value, attrs in read()]
            except RuntimeError:
                if attempt == 2:
                    return []
            except Exception as exc:  # noqa: BLE001 - a broken reading must not break the scrape
                log.warning("metric_read_failed", metric=name, error=str(exc))
                return []
        return []

    if kind == "gauge":
        meter.create_observable_gauge(name, callbacks=[callback], unit=unit, description=description)
    elif kind == "counter":
        meter.create_observable_counter(name, callbacks=[callback], unit=unit, description=description)
    else:
        raise ValueError(f"unknown instrument kind {kind!r} (use gauge or counter)")


class _NicLike(Protocol):
    """What ``nic_observations`` reads from a NIC (``transfer.nic.EmulatedNic``)."""

    @property
    def name(self) -> str: ...

    def bytes_sent(self, traffic_class: TrafficClass) -> int: ...

    def throughput(self, traffic_class: TrafficClass, window_s: float = ...) -> float: ...

    def utilisation(self, window_s: float = ...) -> float: ...


def nic_observations(nics: Callable[[], Sequence[_NicLike]], *, window_s: float = 1.0, meter: metrics.Meter | None = None) -> None:
    """Per-NIC bytes by traffic class and utilisation of the emulated NICs ``nics()`` returns.

    ``dualpath.nic.bytes{nic, traffic_class}`` counts bytes the link started sending;
    ``dualpath.nic.utilization{nic}`` is the busy fraction of the last ``window_s`` seconds,
    and ``dualpath.nic.throughput{nic, traffic_class}`` the bytes per second over it.
    """
    from dualpath.transfer.types import TrafficClass

    def sent() -> list[Reading]:
        return [(nic.bytes_sent(tc), {"nic": nic.name, "traffic_class": tc.name.lower()}) for nic in nics() for tc in TrafficClass]

    def rate() -> list[Reading]:
        return [
            (nic.throughput(tc, window_s), {"nic": nic.name, "traffic_class": tc.name.lower()}) for nic in nics() for tc in TrafficClass
        ]

    def busy() -> list[Reading]:
        return [(nic.utilisation(window_s), {"nic": nic.name}) for nic in nics()]

    observe("dualpath.nic.bytes", "bytes sent through the (emulated) NIC, by traffic class", sent, unit="By", kind="counter", meter=meter)
    observe(
        "dualpath.nic.throughput", f"NIC bytes per second over the last {window_s:g} s, by traffic class", rate, unit="By/s", meter=meter
    )
    observe("dualpath.nic.utilization", f"busy fraction of the NIC over the last {window_s:g} s", busy, unit="1", meter=meter)
