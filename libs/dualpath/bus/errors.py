"""Errors of the control-plane bus.

Hierarchy::

    TimeoutError
     └── BusTimeoutError      a request got no answer in time, or nobody serves its subject
    Exception
     ├── HandlerError         raised by a handler to answer with an error code (400, 404, 409 ...)
     └── BusOverflowError     a subscription already runs its limit of handlers (reported, not raised)

A service that answered with an ``ErrorReply`` surfaces as ``dualpath.protocol.RemoteError``.
"""

from __future__ import annotations

__all__ = ["BUSY", "BusOverflowError", "BusTimeoutError", "HandlerError"]

BUSY = 503  # ErrorReply code of a request refused because its subscription is at its handler limit


class BusTimeoutError(TimeoutError):
    """Raised by ``Bus.request`` when no reply came within the timeout (or nobody listens)."""

    def __init__(self, subject: str, timeout: float, no_responders: bool = False) -> None:
        why = "no service listens" if no_responders else f"no reply within {timeout:.1f}s"
        super().__init__(f"{subject}: {why}")
        self.subject = subject
        self.timeout = timeout
        self.no_responders = no_responders


class HandlerError(Exception):
    """Raise inside a handler to answer with a specific error code (400, 404, 409, 503 ...)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class BusOverflowError(Exception):
    """A message arrived on a subscription that already runs ``limit`` handlers.

    Like nats.py's ``SlowConsumerError``, it is not raised into anyone's code: the bus hands it
    to the connection's error callback (which logs it) and counts it. The message itself is not
    queued: a request is answered at once with an ``ErrorReply`` of code ``BUSY`` (so its sender
    gets a ``RemoteError`` instead of waiting for its timeout), a publish is dropped.
    """

    def __init__(self, subject: str, limit: int, refused: int) -> None:
        super().__init__(f"{subject}: busy, {limit} handlers already in flight ({refused} messages refused so far)")
        self.subject = subject
        self.limit = limit
        self.refused = refused
