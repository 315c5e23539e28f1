"""Control-plane protocol: message types (``messages``), subjects (``subjects``), codec (``codec``).

Everything that crosses a service boundary on NATS is defined here, so a reader finds the
whole wire contract in one package. Bulk KV bytes never appear in these messages: they move
over the data plane (``dualpath.transfer``); messages only carry region descriptors.
"""

from dualpath.protocol import messages, subjects
from dualpath.protocol.codec import PROTOCOL_VERSION, decode, encode
from dualpath.protocol.errors import ProtocolError, RemoteError

__all__ = ["PROTOCOL_VERSION", "ProtocolError", "RemoteError", "decode", "encode", "messages", "subjects"]
