"""``Bus``: NATS request/reply and pub/sub for msgpack messages, with trace context in headers.

Services register handlers with ``serve``: each message is decoded (a garbage or wrong-version
message gets an ``ErrorReply`` and the service keeps serving) and runs as its own task in the
task group the bus was given (``Bus.open`` makes one; the service runner opens it), and its
return value is the reply. Each subscription runs at most ``max_in_flight`` handlers at once:
past that a request is answered at once with a ``BUSY`` error reply and a publish is dropped,
and the overflow is reported as a ``BusOverflowError`` (nats.py reports a slow consumer the same
way), so nothing queues without bound. A hot subject can be served ``inline`` instead: its
handler runs in the subscription's own delivery task, one message after the other, with no task
per message (a few microseconds each that a subject carrying thousands of messages a second
notices); such a handler must not block, and it may answer later through the ``respond``
callable it is given (the kv-persistence replica answers a commit once its stream record is
stored). Decoding, error replies and trace context are the same in both modes. ``request`` raises ``RemoteError`` when the other side
answered with an error and ``BusTimeoutError`` when nobody answered; its timeout comes from
``dualpath.protocol.timeouts.TIMEOUTS``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import anyio
import nats
import nats.aio.client
from anyio.abc import TaskGroup
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.aio.transport import TcpTransport
from nats.errors import FlushTimeoutError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from opentelemetry import context as otel_context
from opentelemetry import propagate

from dualpath.bus.errors import BUSY, BusOverflowError, BusTimeoutError, HandlerError
from dualpath.protocol import ProtocolError, RemoteError, decode, encode
from dualpath.protocol.messages import ErrorReply
from dualpath.telemetry.logs import get_logger

__all__ = ["BUSY", "DEFAULT_MAX_IN_FLIGHT", "Bus", "BusOverflowError", "BusTimeoutError", "HandlerError", "Respond"]

log = get_logger("bus")
T = TypeVar("T")
Handler = Callable[..., Awaitable[Any]]  # (message) -> reply, or inline: (message, respond) -> reply
Respond = Callable[[Any], Awaitable[None]]  # publishes a reply (a message, or its encoding as bytes)
ErrorCallback = Callable[[Exception], Awaitable[None]]

DEFAULT_MAX_IN_FLIGHT = 1024  # handlers one subscription runs at once (nats.py buffers 512 Ki messages per subscription)
_TLS_SHUTDOWN_S = 0.5  # how long closing a TLS connection waits for the server's close_notify
_RECONNECT_WAIT_S = 0.5  # the pause before trying a server again that already failed in this outage
_ROUND_TRIP_S, _ROUND_TRIP_TRY_S = 10.0, 2.0  # ``_round_trip``: in all (nats.py's flush default), one PING
_RECONNECT_POLL_S = 0.02  # ``_round_trip``: how often it looks whether a reconnection is done
_CLOSE_GRACE_S = 2.0  # how long ``close`` lets in-flight handlers finish before cancelling them


class _BoundedCloseTransport(TcpTransport):
    """nats.py's TCP transport, but closing a connection waits at most ``_TLS_SHUTDOWN_S``.

    nats.py closes the connection to a server that stopped answering, and waits for it to be
    closed, before it tries another server. Over TLS, closing waits for the server's
    close_notify: up to the event loop's SSL shutdown timeout (30 s in asyncio and in uvloop,
    which uvicorn picks when it is installed), and a server cut off by the network never
    answers. Past the bound the connection is aborted and the wait ends with the
    ``TimeoutError`` nats.py reports through the error callback, as before."""

    async def wait_closed(self) -> None:
        writer = self._io_writer
        if writer is None:
            return
        try:
            await asyncio.wait_for(writer.wait_closed(), _TLS_SHUTDOWN_S)
        except TimeoutError:
            writer.transport.abort()
            raise TimeoutError("SSL shutdown timed out") from None


# nats.py makes its transport by this module-level name (one per server it connects to).
nats.aio.client.TcpTransport = _BoundedCloseTransport  # type: ignore[misc]


class ReconnectOrder:
    """Which server of a cluster a client tries next after it lost its connection: the one it
    lost last of all.

    nats.py shuffles its servers and tries them in turn. A server cut off by the network fails
    a connect only after the connect timeout (2 s), so a client whose shuffle puts that server
    first waits those seconds before it tries a live one. Here a server counts its failed
    tries in this outage, and the one just lost counts one more: every other server is tried
    once before it, then all take turns (a client that cannot reach any server keeps trying
    each one, and finds the lost one when it is the only one back). A server is tried at once
    the first time; a second try waits ``_RECONNECT_WAIT_S``, as nats.py's own order does.
    """

    def __init__(self) -> None:
        self.lost = ""  # host:port of the server the client was last connected to

    def connected(self, url: Any) -> None:
        self.lost = url.netloc if url is not None else ""

    def __call__(self, servers: list[nats.aio.client.Server], info: dict[str, Any]) -> tuple[nats.aio.client.Server | None, float]:
        if not servers:
            return None, 0.0
        pick = min(servers, key=lambda s: s.reconnects + (s.uri.netloc == self.lost))  # first of the equals: nats.py shuffled them
        return pick, (_RECONNECT_WAIT_S if pick.reconnects > 0 else 0.0)


async def _log_error(exc: Exception) -> None:
    log.warning("nats_error", error=str(exc), kind=type(exc).__name__)


@dataclass(slots=True)
class _Served:
    """One ``serve`` subscription: its handler limit and counters."""

    subject: str
    limit: int
    sender: Callable[[Any], str] | None = None  # the sender id a message must carry: the subject's last token
    in_flight: int = 0
    refused: int = 0  # messages answered BUSY or dropped because ``limit`` handlers were running


class Bus:
    """One NATS connection of one service; handlers run in ``tasks``."""

    def __init__(self, nc: nats.NATS, name: str, tasks: TaskGroup, *, error_cb: ErrorCallback = _log_error) -> None:
        self.nc = nc
        self.name = name
        self._tasks = tasks
        self._error_cb = error_cb
        self._subs: list[Subscription] = []
        self._served: list[_Served] = []
        self._scopes: set[anyio.CancelScope] = set()  # one per running handler, cancelled by ``close``
        self._idle: anyio.Event | None = None  # set when the last handler ends while ``close`` waits
        self._closing = False

    @classmethod
    async def connect(cls, url: str | list[str], name: str, *, tasks: TaskGroup, **options: Any) -> Bus:
        """Connect (with reconnects forever) to ``url``; handlers will run in ``tasks``.

        ``options`` go to ``nats.connect`` and may carry ``user_credentials``, ``tls`` etc.
        (see ``dualpath.config.BusConfig``).
        """
        nc, order = nats.NATS(), ReconnectOrder()

        async def disconnected() -> None:
            if not nc.is_closed:  # a close calls this too
                log.warning("nats_disconnected", server=order.lost)

        async def reconnected() -> None:
            order.connected(nc.connected_url)
            log.info("nats_reconnected", server=order.lost)

        options = {"reconnect_time_wait": _RECONNECT_WAIT_S, **options}  # a float: nats.py annotates an int, sleeps any number
        await nc.connect(
            url,
            name=name,
            max_reconnect_attempts=-1,
            reconnect_to_server_handler=order,
            error_cb=_log_error,
            disconnected_cb=disconnected,
            reconnected_cb=reconnected,
            allow_reconnect=True,
            **options,
        )
        order.connected(nc.connected_url)
        return cls(nc, name, tasks)

    @classmethod
    @asynccontextmanager
    async def open(cls, url: str | list[str], name: str, **options: Any) -> AsyncIterator[Bus]:
        """``async with Bus.open(url, name) as bus``: a connection with its own handler task group.

        On exit the bus is closed (``close``) and every handler task has ended.
        """
        async with anyio.create_task_group() as tasks:
            bus = await cls.connect(url, name, tasks=tasks, **options)
            try:
                yield bus
            finally:
                with anyio.CancelScope(shield=True):
                    await bus.close()

    @property
    def refused(self) -> int:
        """Messages refused so far because a subscription was at its handler limit."""
        return sum(s.refused for s in self._served)

    # ---- sending ---------------------------------------------------------------------------
    @staticmethod
    def _headers() -> dict[str, str] | None:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        return carrier or None

    async def publish(self, subject: str, msg: Any) -> None:
        await self.nc.publish(subject, encode(msg), headers=self._headers())

    async def request(self, subject: str, msg: Any, reply_type: type[T], *, timeout: float) -> T:
        """Send ``msg`` and wait for a ``reply_type`` answer (``timeout``: a ``TIMEOUTS`` entry).

        Raises:
            RemoteError: the service answered with an ErrorReply (code ``BUSY``: it was at its limit).
            BusTimeoutError: no answer in time, or no service subscribed.
            ProtocolError: the answer was not a ``reply_type``.
        """
        data, headers = encode(msg), self._headers()
        deadline = time.monotonic() + timeout
        try:
            try:
                reply = await self.nc.request(subject, data, timeout=timeout, headers=headers)
            except NoRespondersError:
                # A fresh connection can be told "no responders" for a subject that was just
                # served from another connection (seen in ~7% of tries on a busy host); after a
                # round trip to the server the answer is the real one. Both stay within ``timeout``.
                await self._round_trip(timeout=max(deadline - time.monotonic(), 0.01))
                left = max(deadline - time.monotonic(), 0.01)
                reply = await self.nc.request(subject, data, timeout=left, headers=headers)
        except NoRespondersError:
            raise BusTimeoutError(subject, timeout, no_responders=True) from None
        except NatsTimeoutError:
            raise BusTimeoutError(subject, timeout) from None
        answer: Any = decode(reply.data, reply_type, ErrorReply)
        if isinstance(answer, ErrorReply):
            raise RemoteError(answer.code, answer.message, subject)
        return cast(T, answer)

    # ---- serving ---------------------------------------------------------------------------
    async def serve(
        self,
        subject: str,
        handler: Handler,
        *accepts: type,
        queue: str = "",
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        inline: bool = False,
        sender: Callable[[Any], str] | None = None,
    ) -> None:
        """Run ``handler(message)`` for every message of the ``accepts`` types on ``subject``.

        Returns once the server has the subscription. The handler's return value (a message, its
        encoding as bytes, or None) is the reply when the sender waits for one. Each message runs
        in its own task, so a slow handler does not block others; at most ``max_in_flight`` run at
        once (see the module docstring for what happens past it).

        ``inline``: ``handler(message, respond)`` runs in the subscription's delivery task instead
        (messages in order, no task each, no in-flight bound: the handler must not block, and it
        bounds whatever it leaves pending itself, e.g. by raising ``HandlerError(BUSY, ...)``). It
        returns the reply, or None and calls ``respond(reply)`` once when the answer is ready.

        ``sender``: for a subject whose last token names its publisher (a report subscribed with
        a wildcard): ``sender(message)`` must equal that token, or the message is dropped and
        logged. The server's permissions let an identity publish only under its own id, so a
        message claiming another id inside is forged.

        Raises:
            ValueError: ``max_in_flight`` < 1.
        """
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        served = _Served(subject, max_in_flight, sender)

        async def on_msg(raw: Msg) -> None:
            if self._closing:
                return
            if served.in_flight >= served.limit:
                await self._refuse(served, raw)
                return
            served.in_flight += 1
            self._tasks.start_soon(self._run_handler, served, raw, handler, accepts, name=f"bus:{subject}")

        async def on_inline(raw: Msg) -> None:
            if not self._closing:
                await self._handle(raw, handler, accepts, inline=True, sender=served.sender)

        self._served.append(served)
        self._subs.append(await self.nc.subscribe(subject, queue=queue, cb=on_inline if inline else on_msg))
        await self._round_trip()  # the server knows the subscription before anyone is told we serve

    async def _round_trip(self, timeout: float = _ROUND_TRIP_S) -> None:
        """Wait until the server has everything sent so far (a PING answered), across a
        reconnection: the PING of a flush can go out on a connection that drops before the PONG
        comes back, and nats.py then waits out the whole timeout. A try that takes more than
        ``_ROUND_TRIP_TRY_S`` is given up and another PING sent (on the new connection, whose
        subscriptions nats.py has replayed), until ``timeout``. While the client is reconnecting
        it waits for the new connection: nats.py's flush would return at once without a PING.

        Raises:
            nats.errors.FlushTimeoutError: no PING answered within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise FlushTimeoutError
            if self.nc.is_reconnecting:
                # nats.py's flush returns at once, with no PING, while its read loop is down:
                # wait for the new connection instead.
                await asyncio.sleep(min(_RECONNECT_POLL_S, left))
                continue
            try:
                await self.nc.flush(timeout=min(_ROUND_TRIP_TRY_S, left))  # type: ignore[arg-type]  # a float; annotated int
            except NatsTimeoutError:
                if time.monotonic() + 0.01 >= deadline:
                    raise
                continue
            if not self.nc.is_reconnecting:  # else that flush was the no-PING one: go round again
                return

    async def subscribe_raw(self, subject: str, cb: Callable[[Msg], Awaitable[None]]) -> Subscription:
        """Subscribe ``cb`` to raw messages; it runs in order, in the subscription's own delivery task."""
        sub = await self.nc.subscribe(subject, cb=cb)
        self._subs.append(sub)
        await self._round_trip()
        return sub

    async def _refuse(self, served: _Served, raw: Msg) -> None:
        served.refused += 1
        err = BusOverflowError(served.subject, served.limit, served.refused)
        if raw.reply:
            await self.nc.publish(raw.reply, encode(ErrorReply(code=BUSY, message=str(err))))
        if served.refused & (served.refused - 1) == 0:  # 1st, 2nd, 4th, 8th ...: an overload does not flood the log
            await self._error_cb(err)

    async def _run_handler(self, served: _Served, raw: Msg, handler: Handler, accepts: tuple[type, ...]) -> None:
        try:
            with anyio.CancelScope() as scope:
                self._scopes.add(scope)
                try:
                    await self._handle(raw, handler, accepts, sender=served.sender)
                finally:
                    self._scopes.discard(scope)
        finally:
            served.in_flight -= 1
            if self._idle is not None and not self._scopes:
                self._idle.set()

    async def _handle(
        self, raw: Msg, handler: Handler, accepts: tuple[type, ...], *, inline: bool = False, sender: Callable[[Any], str] | None = None
    ) -> None:
        # W3C trace context from the headers; a message without headers (tracing off) skips it:
        # extracting an empty carrier still costs microseconds on an inline hot path.
        token = otel_context.attach(propagate.extract(raw.headers)) if raw.headers else None
        try:
            try:
                msg: Any = decode(raw.data, *accepts)
                if sender is not None and (claimed := sender(msg)) != raw.subject.rsplit(".", 1)[-1]:
                    log.warning("forged_sender", subject=raw.subject, claimed=claimed)
                    return
                answer = await (handler(msg, self._responder(raw.reply)) if inline else handler(msg))
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
                await self.nc.publish(raw.reply, answer if isinstance(answer, bytes) else encode(answer))
        finally:
            if token is not None:
                otel_context.detach(token)

    def _responder(self, reply: str) -> Respond:
        """What an inline handler calls to answer later: publishes to ``reply`` (nothing without one)."""

        async def respond(answer: Any) -> None:
            if not reply:
                return
            try:
                await self.nc.publish(reply, answer if isinstance(answer, bytes) else encode(answer))
            except Exception as exc:  # noqa: BLE001 - the connection is going: the requester times out and retries
                log.warning("reply_failed", error=str(exc))

        return respond

    async def stop_serving(self) -> None:
        """Unsubscribe every subject served so far: no new messages, the connection stays open
        (so answers still owed, e.g. by inline handlers, can be published). Idempotent."""
        subs, self._subs = self._subs, []
        for sub in subs:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # noqa: BLE001 - the connection may already be gone
                log.debug("unsubscribe_failed", error=str(exc))
        try:
            await self.nc.flush()  # a round trip: the server has the unsubscriptions (its routing caches may lag a moment)
        except Exception as exc:  # noqa: BLE001 - as above
            log.debug("unsubscribe_flush_failed", error=str(exc))

    async def close(self, grace: float = _CLOSE_GRACE_S) -> None:
        """Unsubscribe, let in-flight handlers finish for ``grace`` seconds, cancel the rest, drain."""
        self._closing = True
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001, S110 - the connection may already be gone
                pass
        if self._scopes:
            self._idle = anyio.Event()
            with anyio.move_on_after(grace):
                await self._idle.wait()
            for scope in list(self._scopes):
                scope.cancel()
        if not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception:  # noqa: BLE001 - fall back to a hard close
                try:
                    await self.nc.close()
                except Exception as exc:  # noqa: BLE001 - closing must not add an error to a service's exit
                    log.warning("bus_close_failed", error=str(exc))
