"""msgpack codec for control messages: a versioned envelope around one message type.

Wire form of every message: a msgpack map ``{"v": PROTOCOL_VERSION, "t": <type code>, ...fields}``.
Never pickle: msgpack carries only plain data, so a hostile peer cannot run code here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar, cast

import msgpack

from dualpath.protocol.errors import ProtocolError

if TYPE_CHECKING:
    from dualpath.protocol.wire import Wire

__all__ = ["PROTOCOL_VERSION", "decode", "encode", "register"]

PROTOCOL_VERSION = 1
_BY_CODE: dict[int, type[Wire]] = {}
T = TypeVar("T")
W = TypeVar("W", bound="Wire")


def register(code: int) -> Callable[[type[W]], type[W]]:
    """Class decorator: give a message class its integer type code (unique)."""

    def wrap(cls: type[W]) -> type[W]:
        if code in _BY_CODE:
            raise ValueError(f"message type code {code} used twice ({_BY_CODE[code].__name__}, {cls.__name__})")
        _BY_CODE[code] = cls
        cls.TYPE_CODE = code
        return cls

    return wrap


def encode(msg: Wire) -> bytes:
    """Serialise a registered message dataclass into its msgpack envelope."""
    body = msg.to_wire()
    body["v"] = PROTOCOL_VERSION
    body["t"] = msg.TYPE_CODE
    packed: bytes = msgpack.packb(body, use_bin_type=True)  # msgpack is untyped: packb returns bytes here
    return packed


def decode(data: bytes, *expected: type[T]) -> T:
    """Parse an envelope and build the message, which must be one of ``expected``.

    Raises:
        ProtocolError: not msgpack, not a map, wrong version, unexpected type or bad fields.
    """
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
        raise ProtocolError(f"not a msgpack message: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("message is not a map")
    version = body.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r} (this service speaks {PROTOCOL_VERSION})")
    cls = _BY_CODE.get(body.pop("t", None))
    if cls is None or (expected and cls not in expected):
        names = ", ".join(c.__name__ for c in expected) or "a known message"
        raise ProtocolError(f"unexpected message type (want {names})")
    try:
        msg = cls.from_wire(body)
    except (TypeError, ValueError, KeyError) as exc:
        raise ProtocolError(f"bad {cls.__name__}: {exc}") from None
    return cast(T, msg)  # its class is one of ``expected`` (checked above), or any when none is named
