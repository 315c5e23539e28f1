"""``Bus``: NATS request/reply and pub/sub for msgpack messages, with trace context in headers.

Services register handlers with ``serve``: each message is decoded (a garbage or wrong-version
message gets an ``ErrorReply`` and the service keeps serving), runs in its own task inside
the bus's task group, and its return value is the reply. ``request`` raises ``RemoteError``
when the other side answered with an error and ``BusTimeoutError`` when nobody answered.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, TypeVar

import nats
from nats.errors import NoRespondersError, TimeoutError as NatsTimeoutError
from opentelemetry import context as otel_context, propagate

from dualpath.protocol import ProtocolError, RemoteError, decode, encode
from dualpath.protocol.messages import ErrorReply
from dualpath.telemetry.logs import get_logger

__all__ = ["Bus", "BusTimeoutError", "HandlerError"]

log = get_logger("bus")
T = TypeVar("T")


class BusTimeoutError(TimeoutError):
    """Raised by ``Bus.request`` when no reply came within the timeout (or nobody listens)."""

    def __init__(self, subject: str, timeout: float, no_responders: bool = False) -> None:
        why = "no service listens" if no_responders else f"no reply within {timeout:.1f}s"
        super().__init__(f"{subject}: {why}")
        self.subject = subject
        self.no_responders = no_responders


class HandlerError(Exception):
    """Raise inside a handler to answer with a specific error code (400, 404, 409, 503 ...)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


Handler = Callable[[Any], Awaitable[Any]]


class Bus:
    """One NATS connection of one service."""

    def __init__(self, nc: nats.NATS, name: str) -> None:
        self.nc = nc
        self.name = name
        self._tasks: set[asyncio.Task] = set()
        self._subs = []

    @classmethod
    async def connect(cls, url: str | list[str], name: str, **options) -> "Bus":
        """Connect (with reconnects forever) to ``url``; options go to ``nats.connect``.

        ``options`` may carry ``user_credentials``, ``tls`` etc. (see ``dualpath.config.BusConfig``).
        """
        async def on_error(exc: Exception) -> None:
            log.warning("nats_error", error=str(exc))

        nc = await nats.connect(url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                error_cb=on_error, allow_reconnect=True, **options)
        return cls(nc, name)

    # ---- sending ---------------------------------------------------------------------------
    @staticmethod
    def _headers() -> dict[str, str] | None:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        return carrier or None

    async def publish(self, subject: str, msg: Any) -> None:
        await self.nc.publish(subject, encode(msg), headers=self._headers())

    async def request(self, subject: str, msg: Any, reply_type: type[T], *, timeout: float = 5.0) -> T:
        """Send ``msg`` and wait for a ``reply_type`` answer.

        Raises:
            RemoteError: the service answered with an ErrorReply.
            BusTimeoutError: no answer in time, or no service subscribed.
            ProtocolError: the answer was not a ``reply_type``.
        """
        try:
            reply = await self.nc.request(subject, encode(msg), timeout=timeout, headers=self._headers())
        except NoRespondersError:
            raise BusTimeoutError(subject, timeout, no_responders=True) from None
        except NatsTimeoutError:
            raise BusTimeoutError(subject, timeout) from None
        answer = decode(reply.data, reply_type, ErrorReply)
        if isinstance(answer, ErrorReply):
            raise RemoteError(answer.code, answer.message, subject)
        return answer

    # ---- serving ---------------------------------------------------------------------------
    async def serve(self, subject: str, handler: Handler, *accepts: type, queue: str = "") -> None:
        """Run ``handler(message)`` for every message of the ``accepts`` types on ``subject``.

        The handler's return value (a message or None) is the reply when the sender waits
        for one. Each message runs in its own task, so a slow handler does not block others.
        """
        async def on_msg(raw) -> None:
            self._spawn(self._handle(raw, handler, accepts))

        self._subs.append(await self.nc.subscribe(subject, queue=queue, cb=on_msg))

    async def subscribe_raw(self, subject: str, cb) -> Any:
        sub = await self.nc.subscribe(subject, cb=cb)
        self._subs.append(sub)
        return sub

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, raw, handler: Handler, accepts: tuple[type, ...]) -> None:
        token = otel_context.attach(propagate.extract(raw.headers or {}))
        try:
            try:
                msg = decode(raw.data, *accepts)
                answer = await handler(msg)
            except ProtocolError as exc:
                log.warning("bad_message", subject=raw.subject, error=exc.reason)
                answer = ErrorReply(code=400, message=exc.reason)
            except HandlerError as exc:
                answer = ErrorReply(code=exc.code, message=exc.message)
            except RemoteError as exc:
                answer = ErrorReply(code=exc.code, message=str(exc))
            except Exception as exc:  # noqa: BLE001 - a handler bug must not kill the service
                log.exception("handler_failed", subject=raw.subject)
                answer = ErrorReply(code=500, message=f"{type(exc).__name__}: {exc}")
            if raw.reply and answer is not None:
                await self.nc.publish(raw.reply, encode(answer))
        finally:
            otel_context.detach(token)

    async def close(self) -> None:
        """Drain subscriptions, wait for in-flight handlers (bounded), close the connection."""
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection may already be gone
                pass
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
            for t in list(self._tasks):
                t.cancel()
        if not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception:  # noqa: BLE001
                await self.nc.close()
