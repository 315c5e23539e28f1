"""The control-plane bus: a thin NATS client (``client.Bus``), its errors and the embedded server."""

from dualpath.bus.client import DEFAULT_MAX_IN_FLIGHT, Bus, Respond
from dualpath.bus.embedded import EmbeddedNats, nats_server_binary
from dualpath.bus.errors import BUSY, BusOverflowError, BusTimeoutError, HandlerError

__all__ = [
    "BUSY",
    "DEFAULT_MAX_IN_FLIGHT",
    "Bus",
    "BusOverflowError",
    "BusTimeoutError",
    "EmbeddedNats",
    "HandlerError",
    "Respond",
    "nats_server_binary",
]
