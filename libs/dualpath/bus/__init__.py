"""The control-plane bus: a thin NATS client (``client.Bus``) and the embedded server."""

from dualpath.bus.client import Bus, BusTimeoutError
from dualpath.bus.embedded import EmbeddedNats, nats_server_binary

__all__ = ["Bus", "BusTimeoutError", "EmbeddedNats", "nats_server_binary"]
