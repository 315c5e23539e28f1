"""Per-agent connections: ``FastConnection`` (asyncio Protocol) and ``HttpxConnection``.

Both expose ``await request(body, sink) -> TurnResult`` and ``await aclose()``, send a
``POST`` of ``body`` (JSON bytes) to the endpoint's completions path, and raise the
``ServerError`` subclasses of ``loadgen.errors``. Each agent owns one connection and runs
its turns on it back to back (HTTP keep-alive; a closed connection is reopened).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import cast

from loadgen.client import MALFORMED, Endpoint, ItlSink, ResponseConsumer, TurnResult, parse_response_head
from loadgen.errors import LoadgenError, RequestTimeoutError, ServerUnreachableError, StreamError

__all__ = ["FastConnection", "HttpxConnection", "open_connection", "TRANSPORTS"]

TRANSPORTS = ("fast", "httpx")
_SSL: ssl.SSLContext | None = None
_IDLE, _HEAD, _SIZE, _DATA, _CRLF, _TRAILER, _LENGTH, _CLOSE = range(8)


def _ssl_context() -> ssl.SSLContext:
    global _SSL  # one context for every connection: building one costs milliseconds
    if _SSL is None:
        _SSL = ssl.create_default_context()
    return _SSL


def _hostport(ep: Endpoint) -> str:
    return f"[{ep.host}]:{ep.port}" if ":" in ep.host else f"{ep.host}:{ep.port}"  # IPv6 literals in brackets


def _headers(ep: Endpoint) -> dict[str, str]:
    headers = {"host": _hostport(ep), "content-type": "application/json", "accept": "text/event-stream", "accept-encoding": "identity"}
    if ep.api_key:
        headers["authorization"] = f"Bearer {ep.api_key}"
    return headers


class _H1Protocol(asyncio.Protocol):
    """HTTP/1.1 response framing (chunked, content-length, until-close) for one consumer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.consumer: ResponseConsumer | None = None
        self.buf = bytearray()
        self.state, self.left, self.keep_alive = _IDLE, 0, True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def start(self, consumer: ResponseConsumer) -> None:
        """Route the next response on this connection to ``consumer``."""
        self.consumer, self.state = consumer, _HEAD
        self.buf.clear()

    def data_received(self, data: bytes) -> None:
        """Stamp the read first, then frame it; a malformed response fails the consumer."""
        now = time.monotonic()
        if self.consumer is None:
            return
        try:
            if self.state == _SIZE and not self.buf and self._whole_chunk(data, now):
                return
            self.buf += data
            self._advance(now)
        except (LoadgenError, *MALFORMED) as exc:
            consumer, self.consumer = self.consumer, None
            if consumer is not None:
                consumer.fail(exc if isinstance(exc, LoadgenError) else StreamError(f"malformed response: {exc!r}"))
            cast(asyncio.Transport, self.transport).close()

    def _whole_chunk(self, data: bytes, now: float) -> bool:
        """Fast path for the usual read: exactly one whole chunk (one SSE event)."""
        end = data.find(b"\r\n")
        if end <= 0 or b";" in data[:end]:
            return False
        size = int(data[:end], 16)
        start = end + 2
        if size == 0 or len(data) != start + size + 2 or not data.endswith(b"\r\n"):
            return False
        cast(ResponseConsumer, self.consumer).on_body(data[start : start + size], now)
        return True

    def _advance(self, now: float) -> None:
        # Walks the buffer with an offset and trims it once: a read usually holds one or
        # more whole chunks, and each bytearray deletion would copy the rest.
        buf, pos = self.buf, 0
        try:
            while self.consumer is not None:
                state = self.state
                if state == _SIZE:
                    pos = self._chunks(pos, now)
                    end = buf.find(b"\r\n", pos)
                    if end < 0:
                        return
                    size = int(bytes(buf[pos:end]).split(b";")[0], 16)
                    pos = end + 2
                    self.state, self.left = (_TRAILER, 0) if size == 0 else (_DATA, size)
                elif state == _DATA or state == _LENGTH:
                    take = min(self.left, len(buf) - pos)
                    if take <= 0:
                        return
                    self.consumer.on_body(bytes(buf[pos : pos + take]), now)
                    pos += take
                    self.left -= take
                    if self.left == 0:
                        if state == _DATA:
                            self.state = _CRLF
                        else:
                            self._complete(now)
                elif state == _CRLF:
                    if len(buf) - pos < 2:
                        return
                    pos += 2
                    self.state = _SIZE
                elif state == _HEAD:
                    after = self._head(pos)
                    if after < 0:
                        return
                    pos = after
                elif state == _TRAILER:
                    end = buf.find(b"\r\n", pos)
                    if end < 0:
                        return
                    blank, pos = end == pos, end + 2
                    if blank:
                        self._complete(now)
                else:  # _CLOSE: the body runs until the server closes the connection
                    self.consumer.on_body(bytes(buf[pos:]), now)
                    pos = len(buf)
                    return
        finally:
            if pos:
                del buf[:pos]

    def _chunks(self, pos: int, now: float) -> int:
        """Consume every whole non-empty chunk from ``pos``; returns the offset after them.

        Their payloads go to the consumer in one call: they arrived in the same read, so
        they share a timestamp, and one call per read (not per token) keeps this cheap.
        """
        buf, pieces = self.buf, []
        while True:
            end = buf.find(b"\r\n", pos)
            if end < 0 or end - pos > 8:  # no size line yet, or one with extensions
                break
            size = int(buf[pos:end], 16)
            start = end + 2
            if size == 0 or len(buf) < start + size + 2:
                break
            pieces.append(buf[start : start + size])
            pos = start + size + 2
        if pieces:
            cast(ResponseConsumer, self.consumer).on_body(b"".join(pieces), now)
        return pos

    def _head(self, pos: int) -> int:
        """Parse a response head at ``pos``; returns the offset after it, -1 if incomplete."""
        end = self.buf.find(b"\r\n\r\n", pos)
        if end < 0:
            if len(self.buf) - pos > 65536:
                raise StreamError("response head larger than 64 KiB")
            return -1
        status, headers = parse_response_head(bytes(self.buf[pos:end]))
        if 100 <= status < 200:
            return end + 4  # an interim response: the real one follows
        cast(ResponseConsumer, self.consumer).on_head(status, headers)
        self.keep_alive = headers.get("connection", "").lower() != "close"
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.state = _SIZE
        elif "content-length" in headers:
            self.state, self.left = _LENGTH, int(headers["content-length"])
            if self.left == 0:
                self._complete(time.monotonic())
        else:
            self.state, self.keep_alive = _CLOSE, False
        return end + 4

    def _complete(self, now: float) -> None:
        consumer, self.consumer, self.state = self.consumer, None, _IDLE
        if not self.keep_alive:
            cast(asyncio.Transport, self.transport).close()
        cast(ResponseConsumer, consumer).finish(now)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        consumer, self.consumer = self.consumer, None
        if consumer is None:
            return
        if self.state == _CLOSE:
            consumer.finish(time.monotonic())
        elif self.state == _HEAD and not self.buf:
            consumer.fail(_ClosedBeforeAnswer(self.url, "connection closed before any response"))
        else:
            consumer.fail(ServerUnreachableError(self.url, "connection closed before the response ended"))


class _ClosedBeforeAnswer(ServerUnreachableError):
    """The server closed the connection without a byte of response (e.g. an idle
    keep-alive connection it timed out just as the request went out)."""


class FastConnection:
    """One HTTP/1.1 keep-alive connection on an asyncio Protocol."""

    def __init__(self, endpoint: Endpoint, headers: dict[str, str] | None = None) -> None:
        self.ep = endpoint
        all_headers = {**_headers(endpoint), **(headers or {})}
        head = f"POST {endpoint.path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in all_headers.items())
        self.head = head.encode("latin-1")
        self.protocol: _H1Protocol | None = None
        self.current: ResponseConsumer | None = None  # the latest request (partial if cut off)

    async def _connect(self) -> _H1Protocol:
        ep, loop = self.ep, asyncio.get_running_loop()
        tls = _ssl_context() if ep.scheme == "https" else None
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(lambda: _H1Protocol(ep.url), ep.host, ep.port, ssl=tls, server_hostname=ep.host if tls else None),
                ep.connect_timeout_s,
            )
        except (TimeoutError, OSError) as exc:
            raise ServerUnreachableError(ep.url, f"cannot connect to {ep.host}:{ep.port}: {exc or 'timed out'}") from None
        return protocol

    def _usable(self) -> bool:
        p = self.protocol
        return p is not None and not p.closed and p.transport is not None and not p.transport.is_closing()

    async def connect(self) -> None:
        """Open the connection now (the next request reuses it). Never raises: a failure
        shows up, and is recorded, at the first request."""
        if not self._usable():
            try:
                self.protocol = await self._connect()
            except ServerUnreachableError:
                self.protocol = None

    async def request(self, body: bytes, sink: ItlSink | None = None) -> TurnResult:
        """Send one request and wait for its whole response.

        Raises ServerUnreachableError, HTTPStatusError, StreamError, RequestTimeoutError.
        """
        reused = self._usable()
        try:
            return await self._request(body, sink)
        except _ClosedBeforeAnswer:
            if not reused:
                raise
            return await self._request(body, sink)  # a stale keep-alive connection: once more, fresh

    async def _request(self, body: bytes, sink: ItlSink | None) -> TurnResult:
        self.current = None
        if not self._usable():
            self.protocol = await self._connect()
        protocol, loop = cast(_H1Protocol, self.protocol), asyncio.get_running_loop()
        future = loop.create_future()
        t_send = time.monotonic()
        consumer = self.current = ResponseConsumer(t_send, self.ep.chat, sink, future)
        protocol.start(consumer)
        cast(asyncio.Transport, protocol.transport).write(b"%scontent-length: %d\r\n\r\n%s" % (self.head, len(body), body))
        timer = loop.call_later(self.ep.timeout_s, consumer.fail, RequestTimeoutError(self.ep.timeout_s))
        try:
            return await future
        except BaseException:
            # Timeout, error or cancellation: the connection's state is unknown; drop it.
            self._drop()
            raise
        finally:
            timer.cancel()

    def _drop(self) -> None:
        if self.protocol is not None:
            self.protocol.consumer = None
            if self.protocol.transport is not None:
                self.protocol.transport.abort()
            self.protocol = None

    async def aclose(self) -> None:
        """Close the connection."""
        if self.protocol is not None and self.protocol.transport is not None:
            self.protocol.transport.close()
        self.protocol = None


class HttpxConnection:
    """The same interface on ``httpx.AsyncClient`` (one client with one connection)."""

    def __init__(self, endpoint: Endpoint, headers: dict[str, str] | None = None) -> None:
        import httpx  # imported lazily: only --transport httpx needs it

        self.ep, self.httpx = endpoint, httpx
        timeout = httpx.Timeout(endpoint.timeout_s, connect=endpoint.connect_timeout_s)
        self.client = httpx.AsyncClient(
            verify=_ssl_context(), timeout=timeout, limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)
        )
        self.url = f"{endpoint.scheme}://{_hostport(endpoint)}{endpoint.path}"
        self.headers = {k: v for k, v in {**_headers(endpoint), **(headers or {})}.items() if k != "host"}
        self.current: ResponseConsumer | None = None  # the latest request (partial if cut off)

    async def connect(self) -> None:
        """No-op: httpx opens its connection at the first request."""

    async def request(self, body: bytes, sink: ItlSink | None = None) -> TurnResult:
        """Send one request and wait for its whole response (same errors as FastConnection)."""
        httpx, loop = self.httpx, asyncio.get_running_loop()
        future = loop.create_future()
        consumer = self.current = ResponseConsumer(time.monotonic(), self.ep.chat, sink, future)
        try:
            with _deadline(self.ep.timeout_s):
                async with self.client.stream("POST", self.url, content=body, headers=self.headers) as resp:
                    consumer.on_head(resp.status_code, {k.lower(): v for k, v in resp.headers.items()})
                    async for chunk in resp.aiter_raw():
                        consumer.on_body(chunk, time.monotonic())
            consumer.finish(time.monotonic())
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise ServerUnreachableError(self.ep.url, f"cannot connect: {exc}") from None
        except (TimeoutError, httpx.TimeoutException):
            raise RequestTimeoutError(self.ep.timeout_s) from None
        except httpx.HTTPError as exc:
            raise ServerUnreachableError(self.ep.url, f"{type(exc).__name__}: {exc}") from None
        except MALFORMED as exc:
            raise StreamError(f"malformed response: {exc!r}") from None
        return future.result()

    async def aclose(self) -> None:
        """Close the client."""
        await self.client.aclose()


def _deadline(seconds: float):
    import anyio

    return anyio.fail_after(seconds)


def open_connection(endpoint: Endpoint, transport: str = "fast", headers: dict[str, str] | None = None) -> FastConnection | HttpxConnection:
    """A new (lazily connecting) connection; ``headers`` go on every request (e.g. the agent's
    ``X-Session-ID``). Raises ValueError for an unknown transport."""
    if transport == "fast":
        return FastConnection(endpoint, headers)
    if transport == "httpx":
        return HttpxConnection(endpoint, headers)
    raise ValueError(f"unknown transport {transport!r} (choose from {', '.join(TRANSPORTS)})")
