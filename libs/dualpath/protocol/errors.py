"""Errors of the control-plane protocol.

Hierarchy::

    ProtocolError            a message could not be decoded or has the wrong shape
    RemoteError              a service answered a request with an ErrorReply
"""

from __future__ import annotations

__all__ = ["ProtocolError", "RemoteError"]


class ProtocolError(Exception):
    """Raised when bytes on a subject are not a valid message of the expected type and version."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RemoteError(Exception):
    """Raised by ``Bus.request`` when the remote service replied with an ``ErrorReply``.

    ``code`` is an HTTP-like status (400 bad message, 404 unknown, 409 conflict, 503 no capacity,
    500 internal), so the gateway can map it straight onto its HTTP answer.
    """

    def __init__(self, code: int, message: str, subject: str = "") -> None:
        super().__init__(f"{subject}: [{code}] {message}" if subject else f"[{code}] {message}")
        self.code = code
        self.message = message
        self.subject = subject
