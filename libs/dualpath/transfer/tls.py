"""TLS for the tcp transport (``--data-tls``): mutual TLS 1.3, for links that leave a trusted
fabric.

``TlsConfig`` names three PEM files: the CA bundle that signs every data-plane host, this
host's certificate and its key. Both ends present their certificate: the server requires the
client's to chain to the CA, and the client checks the server's against the CA and against the
host it dialed (the address in the region's descriptor), so a peer needs a certificate from
the deployment's CA to read or write anything, on top of each region's key.

``TlsStream`` gives a TLS connection the few socket methods the tcp transport's I/O calls
(``recv_into``, ``recvmsg_into``, ``send``, ``sendmsg``...), so its server and connection
state machines run unchanged over TLS; "would block" is raised as ``BlockingIOError``, as a
plain non-blocking socket does. An ``ssl.SSLSocket`` has no scatter/gather and makes two
``recv`` syscalls per 16 KiB record (header, then body) and one ``send`` per record, so the
stream is an ``ssl.SSLObject`` between two ``MemoryBIO``s instead: ciphertext moves between
the socket and the BIOs ``_IO_BYTES`` at a time (one syscall), and records are sealed and
opened in memory. Two differences the callers heed:

- ``sendmsg`` reports plaintext as sent only once its ciphertext is in the kernel: a chunk
  whose ciphertext the socket did not take whole is kept and finished by the next call,
  which must start with the same (unreported) bytes, as it does. Buffers smaller than
  ``_COALESCE_BYTES`` are copied together into one chunk, so a batch of many small blocks is
  not one record each.
- ciphertext (and decrypted bytes) may wait inside the stream while the kernel reports
  nothing to read: a reader keeps reading until the stream would block instead of waiting
  for epoll (``tcp_server``'s ``buffered``).

TLS 1.3 only (no renegotiation: a read never has to wait for a write), no session tickets
(connections live long; a ticket is one more flight).
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import ssl
from dataclasses import dataclass
from typing import Any, cast

from dualpath.transfer.tcp_wire import wait_fd

__all__ = ["TlsConfig", "TlsStream", "tls_accept", "tls_connect"]

_SEND_CHUNK = 256 << 10  # plaintext sealed per step at most: progress is reported chunk by chunk
_COALESCE_BYTES = 64 << 10  # smaller buffers are copied together into one chunk
_IO_BYTES = 256 << 10  # ciphertext received per syscall at most


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
    """One TLS connection past its handshake: a non-blocking socket and an ``ssl.SSLObject``
    between two memory BIOs, with the socket methods the tcp transport uses (see the module
    docstring for how they differ from a plain socket's)."""

    __slots__ = ("_sock", "_tls", "_in", "_out", "_rbuf", "_cipher", "_staged_len")

    def __init__(self, sock: socket.socket, tls: ssl.SSLObject, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO) -> None:
        self._sock, self._tls, self._in, self._out = sock, tls, incoming, outgoing
        self._rbuf = memoryview(bytearray(_IO_BYTES))
        self._cipher = memoryview(b"")  # sealed bytes the socket has not taken yet
        self._staged_len = 0  # plaintext bytes ``_cipher`` finishes (not yet reported as sent)

    def fileno(self) -> int:
        return self._sock.fileno()

    def getsockname(self) -> Any:
        return self._sock.getsockname()

    def getpeername(self) -> Any:
        return self._sock.getpeername()

    def version(self) -> str | None:
        """The negotiated protocol (``"TLSv1.3"``)."""
        return self._tls.version()

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._cipher = memoryview(b"")
        self._sock.close()

    # ---- receiving -----------------------------------------------------------------------
    def recv_into(self, buf: Any, nbytes: int = 0) -> int:
        """Decrypted bytes into ``buf`` (its first ``nbytes``; all of it when 0), as many as
        have come, record after record (0 at the end of the stream).

        Raises:
            BlockingIOError: nothing to read yet.
            ssl.SSLError: the peer sent something that is not a valid record (an OSError).
        """
        view = memoryview(buf).cast("B")
        return self.recvmsg_into([view[:nbytes] if nbytes else view])[0]

    def recvmsg_into(self, bufs: list[memoryview]) -> tuple[int, list[Any], int, Any]:
        """Fill ``bufs`` in order as far as decrypted bytes go; ``(bytes, [], 0, None)`` like
        ``socket.recvmsg_into`` (0 bytes: the end of the stream).

        Raises:
            BlockingIOError: nothing to read yet.
            ssl.SSLError: the peer sent something that is not a valid record.
        """
        total = 0
        for buf in bufs:
            view = buf
            while view.nbytes:
                got = self._read(view)
                if got is None:  # nothing more yet
                    if total:
                        return total, [], 0, None
                    raise BlockingIOError
                if not got:
                    return total, [], 0, None
                total += got
                view = view[got:]
        return total, [], 0, None

    def _read(self, view: memoryview) -> int | None:
        """One record's decrypted bytes (at most) into ``view``; None when none has come whole
        yet, 0 at the end of the stream."""
        while True:
            try:
                return cast(int, self._tls.read(view.nbytes, view))  # with a buffer: the byte count
            except ssl.SSLWantReadError:
                if not self._fill():
                    return None
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0

    def _fill(self) -> bool:
        """Move what ciphertext the socket has into the incoming BIO; False when it has none.
        The end of the stream is passed on as the BIO's EOF (the next read reports it)."""
        try:
            got = self._sock.recv_into(self._rbuf)
        except (BlockingIOError, InterruptedError):
            return False
        if got:
            self._in.write(self._rbuf[:got])
        else:
            self._in.write_eof()
        return True

    # ---- sending -------------------------------------------------------------------------
    def send(self, buf: Any) -> int:
        """Send what the socket takes of ``buf``, in whole chunks (see ``sendmsg``).

        Raises:
            BlockingIOError: the socket took nothing; call again with the same bytes.
        """
        return self.sendmsg([memoryview(buf).cast("B")])

    def sendmsg(self, bufs: list[memoryview]) -> int:
        """Seal ``bufs`` in order, up to ``_SEND_CHUNK`` bytes per chunk, and send the
        ciphertext; return the plaintext bytes of the chunks the socket took whole. A chunk it
        took part of is finished by the next call, which must start with the same bytes.

        Raises:
            BlockingIOError: the socket took no chunk.
            OSError: the connection broke.
        """
        total = 0
        i = at = 0  # where the unsent plaintext starts: byte ``at`` of ``bufs[i]``
        while True:
            if self._staged_len:  # a chunk sealed already (by this call or an earlier one)
                if not self._flush():
                    if total:
                        return total
                    raise BlockingIOError
                n, self._staged_len = self._staged_len, 0
                total += n
                while n:  # step past the chunk's plaintext
                    take = min(n, bufs[i].nbytes - at)
                    n -= take
                    at += take
                    if n:
                        i, at = i + 1, 0
            while i < len(bufs) and at >= bufs[i].nbytes:
                i, at = i + 1, 0
            if i == len(bufs):
                return total
            chunk = _chunk(bufs, i, at)
            self._tls.write(chunk)  # into the outgoing BIO: never blocks
            self._cipher = memoryview(self._out.read())
            self._staged_len = chunk.nbytes

    def _flush(self) -> bool:
        """Send the sealed bytes still here; True once the socket has taken all of them.

        Raises:
            OSError: the connection broke.
        """
        while self._cipher.nbytes:
            try:
                sent = self._sock.send(self._cipher)
            except (BlockingIOError, InterruptedError):
                return False
            self._cipher = self._cipher[sent:]
        return True


def _chunk(bufs: list[memoryview], i: int, at: int) -> memoryview:
    """The next chunk to seal, from byte ``at`` of ``bufs[i]`` on: a view of a large buffer
    (no copy), or one copy of the small buffers that follow each other there."""
    first = bufs[i][at:]
    if first.nbytes >= _COALESCE_BYTES or i + 1 == len(bufs):
        return first[:_SEND_CHUNK]
    staging = bytearray(first)
    j = i + 1
    while len(staging) < _SEND_CHUNK and j < len(bufs) and bufs[j].nbytes < _COALESCE_BYTES:  # a large one: a view of its own
        staging += bufs[j][: _SEND_CHUNK - len(staging)]
        j += 1
    return memoryview(staging)


async def tls_connect(sock: socket.socket, cfg: TlsConfig, host: str) -> TlsStream:
    """Run the client handshake on the connected, non-blocking ``sock``, checking that the
    server's certificate is the CA's and names ``host``; the caller bounds the time and
    closes ``sock`` on failure.

    Raises:
        ssl.SSLError: the handshake failed (e.g. ``SSLCertVerificationError``).
        OSError: the connection broke.
    """
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = cfg.client_context().wrap_bio(incoming, outgoing, server_side=False, server_hostname=host)
    return await _handshake(TlsStream(sock, tls, incoming, outgoing))


async def tls_accept(sock: socket.socket, cfg: TlsConfig) -> TlsStream:
    """Run the server handshake on the accepted, non-blocking ``sock`` (the client must
    present a certificate of the CA); the caller bounds the time and closes ``sock`` on
    failure.

    Raises:
        ssl.SSLError: the handshake failed (no certificate, another CA...).
        OSError: the connection broke.
    """
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = cfg.server_context().wrap_bio(incoming, outgoing, server_side=True)
    return await _handshake(TlsStream(sock, tls, incoming, outgoing))


async def _handshake(stream: TlsStream) -> TlsStream:
    """Drive ``stream``'s handshake: each flight out through the socket, the peer's in
    through the incoming BIO (bytes that came with the last flight stay there for the first
    read)."""
    loop = asyncio.get_running_loop()
    fd = stream.fileno()
    while True:
        try:
            stream._tls.do_handshake()
            done = True
        except ssl.SSLWantReadError:
            done = False
        stream._cipher = memoryview(stream._out.read())
        while not stream._flush():
            await wait_fd(loop, fd, write=True)
        if done:
            return stream
        while not stream._fill():
            await wait_fd(loop, fd, write=False)
        if stream._in.eof:
            raise ConnectionResetError("connection closed during the TLS handshake")
