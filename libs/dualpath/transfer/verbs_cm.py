"""Queue-pair connection set-up for the verbs transport, when the control plane does not
carry it.

Connecting RC queue pairs needs one exchange: the initiator's offer (its QP numbers, PSNs,
LID/GID) for the responder's answer. Services pass ``VerbsTransport`` a ``handshake``
coroutine that carries the offer over NATS to the peer's ``VerbsTransport.accept``; without
one, this module carries it itself: a small TCP listener next to the transport, one
length-prefixed msgpack offer and answer per connection. Only these few hundred bytes travel
here; region bytes move by RDMA.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack

from dualpath.transfer._tasks import TaskSet

__all__ = ["MAX_MESSAGE", "CmListener", "request_answer"]

MAX_MESSAGE = 64 * 1024
_LEN = struct.Struct("<I")

Accept = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


async def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    body = msgpack.packb(message)
    await asyncio.get_running_loop().sock_sendall(sock, _LEN.pack(len(body)) + body)


async def _recv_exactly(sock: socket.socket, nbytes: int) -> bytes:
    loop = asyncio.get_running_loop()
    out = bytearray()
    while len(out) < nbytes:
        chunk = await loop.sock_recv(sock, nbytes - len(out))
        if not chunk:
            raise ConnectionResetError("connection closed during the QP handshake")
        out += chunk
    return bytes(out)


async def _recv(sock: socket.socket) -> dict[str, Any]:
    (size,) = _LEN.unpack(await _recv_exactly(sock, _LEN.size))
    if size > MAX_MESSAGE:
        raise ValueError(f"QP handshake message of {size} B exceeds {MAX_MESSAGE} B")
    message = msgpack.unpackb(await _recv_exactly(sock, size))
    if not isinstance(message, dict):
        raise ValueError("QP handshake message is not a map")  # noqa: TRY004 - a malformed message, as its size above
    return message


async def request_answer(host: str, port: int, offer: dict[str, Any]) -> dict[str, Any]:
    """Send ``offer`` to the listener at ``host:port`` and return its answer.

    Raises:
        OSError: the listener cannot be reached or hung up.
        ValueError: the answer is malformed.
        RuntimeError: the responder refused the offer (its message says why).
    """
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, (host, port))
        await _send(sock, offer)
        answer = await _recv(sock)
    finally:
        sock.close()
    if "error" in answer:
        raise RuntimeError(f"QP handshake refused by {host}:{port}: {answer['error']}")
    return answer


class CmListener:
    """Answers QP offers on ``host:port`` with ``accept(offer)``."""

    def __init__(self, accept: Accept, *, host: str, port: int = 0) -> None:
        self._accept = accept
        self.host = host
        self.port = port
        self._sock: socket.socket | None = None
        self._tasks = TaskSet("verbs-cm")

    async def start(self) -> None:
        """Listen (port 0 picks a free port; ``self.port`` then holds it).

        Raises:
            OSError: the address cannot be bound.
        """
        sock = socket.create_server((self.host, self.port))
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._tasks.spawn(self._accept_loop(sock), name="accept")

    async def close(self) -> None:
        """Stop listening and drop handshakes in progress (idempotent)."""
        await self._tasks.aclose()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(listener)
            sock.setblocking(False)
            self._tasks.spawn(self._answer(sock), name="handshake")

    async def _answer(self, sock: socket.socket) -> None:
        try:
            offer = await _recv(sock)
            try:
                answer = await self._accept(offer)
            except Exception as exc:  # noqa: BLE001 - refuse this offer; keep serving others
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            await _send(sock, answer)
        except (OSError, ValueError, msgpack.UnpackException):
            pass  # a broken handshake is the initiator's error to report
        finally:
            sock.close()
