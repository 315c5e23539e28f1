"""TLS for the tcp transport (``--data-tls``): mutual TLS 1.3, for links that leave a trusted
fabric.

``TlsConfig`` names three PEM files: the CA bundle that signs every data-plane host, this
host's certificate and its key. Both ends present their certificate: the server requires the
client's to chain to the CA, and the client checks the server's against the CA and against the
host it dialed (the address in the region's descriptor), so a peer needs a certificate from
the deployment's CA to read or write anything, on top of each region's key.

``TlsStream`` gives an ``ssl.SSLSocket`` the few socket methods the tcp transport's I/O calls,
so its server and connection state machines run unchanged over TLS. An ssl socket has no
scatter/gather (``sendmsg``/``recvmsg_into`` raise ``NotImplementedError``), so the stream
moves one buffer per ``SSL_write``/``SSL_read`` (and at most one 16 KiB record per read);
"would block" (``SSLWantReadError``/``SSLWantWriteError``) is raised as ``BlockingIOError``,
as a plain non-blocking socket does. Two differences the callers heed:

- ``SSL_write`` is all or nothing, and after "would block" must be called again with the
  same bytes: ``sendmsg`` writes ``_SEND_CHUNK`` bytes of a buffer at a time, reports only
  whole chunks sent, so the caller's next call starts with the chunk that blocked.
- decrypted bytes may wait inside the stream while the kernel reports nothing to read:
  readers keep reading until the stream would block instead of waiting for epoll
  (``tcp_server``'s ``buffered``).

TLS 1.3 only (no renegotiation: a read never needs to write); no session tickets (each
connection lives long and a ticket is one more write).
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import ssl
from dataclasses import dataclass
from typing import Any

from dualpath.transfer.tcp_wire import wait_fd

__all__ = ["TlsConfig", "TlsStream", "tls_accept", "tls_connect"]

_SEND_CHUNK = 256 << 10  # bytes per SSL_write: progress is reported chunk by chunk


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsConfig:
    """The PEM files of one data-plane host: the deployment's CA, this host's certificate
    (its address in the subject alternative names) and private key."""

    ca: str
    cert: str
    key: str

    def check(self) -> None:
        """Load both contexts now, so a bad file fails at start-up rather than at the first
        connection.

        Raises:
            FileNotFoundError: a file does not exist.
            ssl.SSLError: a file is not a usable certificate, key or CA bundle.
        """
        for path in (self.ca, self.cert, self.key):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"data-plane TLS file {path!r} does not exist")
        self.server_context()
        self.client_context()

    def server_context(self) -> ssl.SSLContext:
        """The context a tcp server wraps accepted connections in (client certificate required)."""
        return _context(self, server=True)

    def client_context(self) -> ssl.SSLContext:
        """The context an initiator wraps its connections in (server certificate and host checked)."""
        return _context(self, server=False)


@functools.lru_cache(maxsize=16)
def _context(cfg: TlsConfig, *, server: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cfg.cert, cfg.key)
    ctx.load_verify_locations(cafile=cfg.ca)
    ctx.verify_mode = ssl.CERT_REQUIRED  # the client's default; for the server: mutual TLS
    if server:
        ctx.num_tickets = 0
    return ctx


class TlsStream:
    """A non-blocking ``ssl.SSLSocket`` past its handshake, with the socket methods the tcp
    transport uses (see the module docstring for how they differ from a plain socket's)."""

    __slots__ = ("_ssl",)

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self._ssl = sock

    def fileno(self) -> int:
        return self._ssl.fileno()

    def getsockname(self) -> Any:
        return self._ssl.getsockname()

    def getpeername(self) -> Any:
        return self._ssl.getpeername()

    def version(self) -> str | None:
        """The negotiated protocol (``"TLSv1.3"``)."""
        return self._ssl.version()

    def shutdown(self, how: int) -> None:
        # The TCP socket's shutdown: ``SSLSocket.shutdown`` would also drop the TLS state, and
        # a reader woken by it would then read ciphertext as if it were plain bytes.
        socket.socket.shutdown(self._ssl, how)

    def close(self) -> None:
        self._ssl.close()

    def recv_into(self, buf: Any, nbytes: int = 0) -> int:
        """Decrypted bytes into ``buf`` (0 at the end of the stream).

        Raises:
            BlockingIOError: nothing to read yet.
        """
        try:
            return self._ssl.recv_into(buf, nbytes)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError from None

    def recvmsg_into(self, bufs: list[memoryview]) -> tuple[int, list[Any], int, Any]:
        """Fill ``bufs`` in order as far as decrypted bytes go; ``(bytes, [], 0, None)`` like
        ``socket.recvmsg_into`` (0 bytes: the end of the stream).

        Raises:
            BlockingIOError: nothing to read yet.
        """
        total = 0
        ssl_sock = self._ssl
        for buf in bufs:
            view = buf
            while view.nbytes:
                try:
                    got = ssl_sock.recv_into(view)
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    if total:
                        return total, [], 0, None
                    raise BlockingIOError from None
                if not got:
                    return total, [], 0, None
                total += got
                view = view[got:]
        return total, [], 0, None

    def send(self, buf: Any) -> int:
        """Send what the socket takes of ``buf``, in whole chunks (see ``sendmsg``).

        Raises:
            BlockingIOError: the socket took nothing; call again with the same bytes.
        """
        return self.sendmsg([memoryview(buf).cast("B")])

    def sendmsg(self, bufs: list[memoryview]) -> int:
        """Send ``bufs`` in order, ``_SEND_CHUNK`` bytes per ``SSL_write``; the bytes of the
        chunks sent whole (a chunk that would block is sent again by the next call, which
        must start with it).

        Raises:
            BlockingIOError: the socket took no chunk.
        """
        total = 0
        ssl_sock = self._ssl
        for buf in bufs:
            at = 0
            while at < buf.nbytes:
                chunk = buf[at : at + _SEND_CHUNK]
                try:
                    sent = ssl_sock.send(chunk)
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    if total:
                        return total
                    raise BlockingIOError from None
                total += sent
                at += sent
        return total


async def tls_connect(sock: socket.socket, cfg: TlsConfig, host: str) -> TlsStream:
    """Run the client handshake on the connected, non-blocking ``sock``, checking that the
    server's certificate is the CA's and names ``host``; the caller bounds the time.

    Raises:
        ssl.SSLError: the handshake failed (e.g. ``SSLCertVerificationError``).
        OSError: the connection broke.
    """
    ssl_sock = cfg.client_context().wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
    try:
        await _handshake(ssl_sock)
    except BaseException:
        ssl_sock.close()
        raise
    return TlsStream(ssl_sock)


async def tls_accept(sock: socket.socket, cfg: TlsConfig) -> TlsStream:
    """Run the server handshake on the accepted, non-blocking ``sock`` (the client must
    present a certificate of the CA); the caller bounds the time.

    Raises:
        ssl.SSLError: the handshake failed (no certificate, another CA...).
        OSError: the connection broke.
    """
    ssl_sock = cfg.server_context().wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
    try:
        await _handshake(ssl_sock)
    except BaseException:
        ssl_sock.close()
        raise
    return TlsStream(ssl_sock)


async def _handshake(ssl_sock: ssl.SSLSocket) -> None:
    loop = asyncio.get_running_loop()
    while True:
        try:
            ssl_sock.do_handshake()
            return
        except ssl.SSLWantReadError:
            await wait_fd(loop, ssl_sock.fileno(), write=False)
        except ssl.SSLWantWriteError:
            await wait_fd(loop, ssl_sock.fileno(), write=True)
