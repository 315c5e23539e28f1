"""Closing a TLS connection to a NATS server that stopped answering is bounded on any event loop.

nats.py closes the connection to a dead server, and waits for it to be closed, before it tries
another server of the cluster. Over TLS that wait is for the server's close_notify: the event
loop's SSL shutdown timeout, 30 s in asyncio and in uvloop (which uvicorn, and so the gateway,
runs on when it is installed). A server here completes the handshake and then reads nothing,
as a server cut off by the network would."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import nats.aio.client
import pytest
from nats.aio.transport import TcpTransport

from dualpath.bus import client as bus_client
from dualpath.transfer.tls_certs import make_pki

pytestmark = pytest.mark.anyio


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(
            ("asyncio", {"use_uvloop": True}),
            id="uvloop",
            marks=pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed"),
        ),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict]:
    return request.param


@pytest.fixture
def silent_server(tmp_path) -> Iterator[tuple[int, ssl.SSLContext]]:
    """A TLS server that completes each handshake and then never reads again; its port and a
    client context that trusts it."""
    tls = make_pki(tmp_path, ["127.0.0.1"])["127.0.0.1"]
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(tls.cert, tls.key)
    client_ctx = ssl.create_default_context(cafile=tls.ca)
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[ssl.SSLSocket] = []
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(5)
            held.append(server_ctx.wrap_socket(conn, server_side=True))  # the handshake; then silence

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], client_ctx
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()


async def _open(transport: TcpTransport, port: int, ctx: ssl.SSLContext) -> None:
    uri = urlparse(f"tls://127.0.0.1:{port}")
    await transport.connect(uri, 1 << 16, 5)
    await transport.connect_tls(uri, ctx, 1 << 16, 5)


def test_nats_makes_the_bounded_transport() -> None:
    assert nats.aio.client.TcpTransport is bus_client._BoundedCloseTransport


async def test_closing_a_tls_connection_to_a_silent_server_is_bounded(silent_server, monkeypatch) -> None:
    port, ctx = silent_server
    plain = TcpTransport()  # nats.py's own: the wait this bounds
    await _open(plain, port, ctx)
    plain.close()
    with pytest.raises(TimeoutError):  # the server really does not answer the close_notify
        await asyncio.wait_for(plain.wait_closed(), 1.0)
    _abort(plain)

    monkeypatch.setattr(bus_client, "_TLS_SHUTDOWN_S", 0.3)
    bounded = bus_client._BoundedCloseTransport()
    await _open(bounded, port, ctx)
    bounded.close()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="SSL shutdown timed out"):
        await bounded.wait_closed()
    assert time.monotonic() - started < 2.0
    assert bounded._io_writer is not None and bounded._io_writer.transport.is_closing()
    _abort(bounded)
    await asyncio.sleep(0.05)  # the aborted transports' sockets close on the next loop turns


def _abort(transport: TcpTransport) -> None:
    for writer in (transport._io_writer, transport._bare_io_writer):
        if writer is not None:
            writer.transport.abort()
