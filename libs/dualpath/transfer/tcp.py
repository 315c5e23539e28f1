"""The tcp transport: one-sided batched read/write over TCP, one round trip per batch.

Each transport listens on ``host:port`` and serves its registered regions
(``tcp_server``). As an initiator it keeps one connection per peer and pipelines batches on
it: a batch is one request frame (with a write's payload) and one reply frame (with a read's
payload), matched by batch id. A reader task per connection receives replies straight into
the local region. A peer that disappears fails every batch in flight with
``PeerLostError``; one that stops answering fails them after ``timeout_s``.

Every request names, beside each region id, the key the region's descriptor handed out
(``MemoryRegion.key``); the server refuses a wrong or missing one before any byte moves
(``AccessDeniedError``). With ``tls`` (``--data-tls``) every connection is mutual TLS 1.3
(``tls``): the server accepts only clients with a certificate of the deployment's CA, and the
client checks the server's certificate against the host it dialed.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import ssl
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio

from dualpath.telemetry.logs import get_logger
from dualpath.transfer._tasks import TaskSet
from dualpath.transfer.base import Transport, check_entries
from dualpath.transfer.busy_poll import busy_poll_default
from dualpath.transfer.errors import PeerLostError, TransferTimeoutError
from dualpath.transfer.nic import DuplexNic, EmulatedNic
from dualpath.transfer.region import MemoryRegion
from dualpath.transfer.tcp_conn import PeerConnection
from dualpath.transfer.tcp_server import serve_connection
from dualpath.transfer.tcp_wire import Op
from dualpath.transfer.tls import TlsConfig, TlsStream, tls_accept, tls_connect
from dualpath.transfer.types import RegionDescriptor, TrafficClass, TransferEntry

__all__ = ["CONGESTION_ENV", "DEFAULT_CONGESTION", "SOCKET_BUFFER_BYTES", "TcpTransport", "congestion_default", "set_congestion"]

_log = get_logger("transfer.tcp")

SOCKET_BUFFER_BYTES = 8 << 20  # SO_SNDBUF and SO_RCVBUF unless told otherwise

# TCP congestion control of the data plane's connections. BBR (the default of many hosts)
# paces every send with the kernel's internal timer once it leaves its startup phase: on a
# loopback pull of a 256 KiB block that added ~18 us (55 -> 73 us) for good, and cut a 64 MiB
# batch from 6.8 to 3.9-4.7 GB/s. Cubic (or Reno, which every process may set) sends a batch
# as fast as the window allows.
CONGESTION_ENV = "DUALPATH_TCP_CONGESTION"
DEFAULT_CONGESTION = "cubic,reno"  # the first the kernel accepts
_refused_congestion: set[str] = set()  # preferences this process could set none of (logged once each)


def congestion_default() -> str:
    """The congestion control the data plane asks for, as a comma-separated preference list:
    ``$DUALPATH_TCP_CONGESTION`` when set (empty: the host's default), else
    ``DEFAULT_CONGESTION``."""
    return os.environ.get(CONGESTION_ENV, DEFAULT_CONGESTION).strip()


def set_congestion(sock: socket.socket, names: str) -> str:
    """Set the first congestion control of ``names`` (comma-separated) that the kernel has and
    allows this process (``net.ipv4.tcp_allowed_congestion_control``, or CAP_NET_ADMIN) on
    ``sock`` (a listener's accepted sockets inherit it); returns it, or "" when none was
    (the host's default stays, with one warning per process). "" asks for nothing."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    if not wanted or not hasattr(socket, "TCP_CONGESTION"):
        return ""
    errors = []
    for name in wanted:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
        except OSError as exc:
            errors.append(f"{name}: {exc.strerror or exc}")
            continue
        return name
    if names not in _refused_congestion:
        _refused_congestion.add(names)
        _log.warning("tcp_congestion_refused", wanted=names, errors="; ".join(errors), hint=f"{CONGESTION_ENV}='' keeps the host's")
    return ""


# The two ends of every connection this process dialed, as (host, port) of each socket: a
# connection between two transports of one process (tests, a single-process stack) shares
# one event loop, so one side's spin would only keep the other from answering.
_IN_PROCESS: set[tuple[str, int]] = set()
_TRANSPORTS: weakref.WeakSet[TcpTransport] = weakref.WeakSet()  # this process's started transports


@dataclass(slots=True)
class _Group:
    """The entries of one batch that go to one peer."""

    peer: tuple[str, int]
    entries: list[TransferEntry] = field(default_factory=list)


class TcpTransport(Transport):
    """One-sided transfers over TCP; the default where there is no RDMA device."""

    name = "tcp"

    def __init__(
        self,
        *,
        node_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        nic: DuplexNic | EmulatedNic | None = None,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        socket_buffer_bytes: int | None = SOCKET_BUFFER_BYTES,
        busy_poll_us: float | None = None,
        tls: TlsConfig | None = None,
        congestion: str | None = None,
    ) -> None:
        """``timeout_s`` bounds a whole batch; ``socket_buffer_bytes`` sets SO_SNDBUF and
        SO_RCVBUF (the kernel caps them at net.core.wmem_max/rmem_max; ``None`` keeps
        autotuning): large buffers mean fewer wake-ups per megabyte. ``busy_poll_us`` is the
        longest adaptive poll for a reply (initiator) or the next request (server) before
        sleeping in the event loop (``busy_poll``; 0 turns it off; default
        ``DUALPATH_TCP_BUSY_POLL_US`` or 250 us). ``tls``: run every connection, served and
        dialed, over mutual TLS with these files (``connect_timeout_s`` bounds the handshake);
        both ends of a link must agree. ``congestion``: the TCP congestion control of every
        connection, served and dialed: the first of a comma-separated list the kernel accepts
        (default ``DUALPATH_TCP_CONGESTION`` or "cubic,reno"; "" keeps the host's, as does a
        list the kernel refuses whole, with a warning)."""
        super().__init__(node_id=node_id, nic=nic)
        self.tls = tls
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.socket_buffer_bytes = socket_buffer_bytes
        self.congestion = congestion_default() if congestion is None else congestion
        self.busy_poll_us = busy_poll_default() if busy_poll_us is None else busy_poll_us
        if self.busy_poll_us < 0:
            raise ValueError(f"busy_poll_us must be >= 0, got {self.busy_poll_us}")
        self._listener: socket.socket | None = None
        self._tasks = TaskSet(f"tcp-transport-{node_id}")
        self._peers: dict[tuple[str, int], PeerConnection] = {}
        self._dialing: dict[tuple[str, int], asyncio.Lock] = {}
        self._batch_ids = itertools.count(1)
        self._peer_of: dict[str, tuple[str, int]] = {}  # remote region id -> (host, port)
        self._keys: dict[str, bytes] = {}  # remote region id -> its key, from its descriptor
        self._open: set[PeerConnection] = set()  # connections whose socket is not closed yet

    async def start(self) -> None:
        """Listen on ``host:port`` (port 0 picks a free one; ``self.port`` then holds it).

        Raises:
            OSError: the address cannot be bound.
            FileNotFoundError, ssl.SSLError: a TLS file is missing or unusable.
        """
        if self._listener is not None:
            return
        if self.tls is not None:
            self.tls.check()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # Accepted sockets inherit the buffers, and the window scale is fixed at SYN time.
            _tune(listener, self.socket_buffer_bytes, self.congestion)
            listener.bind((self.host, self.port))
            listener.listen(128)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self.port = listener.getsockname()[1]
        _TRANSPORTS.add(self)
        self._tasks.spawn(self._accept_loop(listener), name="accept")

    async def close(self) -> None:
        """Fail batches in flight, drop every connection and stop listening (idempotent)."""
        for conn in list(self._peers.values()):
            conn.abort(PeerLostError(conn.peer, "transport closed"))
        await self._tasks.aclose()
        self._tasks = TaskSet(f"tcp-transport-{self.node_id}")  # start() may run again
        for conn in list(self._open):  # readers cancelled before they ran close nothing
            conn.close_socket()
        self._peers.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def connect(self, remote: RegionDescriptor) -> None:
        """Learn a remote region (its peer's address); see ``Transport.connect``."""
        await super().connect(remote)
        self._peer_of[remote.region_id] = (str(remote.address["host"]), int(remote.address["port"]))
        self._keys[remote.region_id] = remote.key

    def register(self, region: MemoryRegion) -> RegionDescriptor:
        """Serve ``region``; its descriptor carries this transport's listening address and
        the region's key.

        Raises:
            ValueError: another region with the same id is registered.
            RuntimeError: the transport is not started.
        """
        if self._listener is None:
            raise RuntimeError("start() the tcp transport before registering regions")
        self._add_local(region)
        return RegionDescriptor(
            region_id=region.region_id,
            node_id=self.node_id,
            size=region.size,
            transport=self.name,
            address={"host": self.host, "port": self.port},
            key=region.key,
        )

    async def _transfer(
        self,
        local: MemoryRegion,
        entries: Sequence[TransferEntry],
        cls: TrafficClass,
        *,
        read: bool,
        links: tuple[EmulatedNic, ...] = (),
    ) -> int:
        """One request frame per peer; see ``Transport.read``/``write``."""
        op = Op.READ if read else Op.WRITE
        total = check_entries(self, local, entries)
        if total == 0:
            return 0
        peer_of = self._peer_of
        first = peer_of[entries[0].remote_region]
        if all(peer_of[region] == first for region in {e.remote_region for e in entries}):  # the usual batch: one peer
            groups = {first: _Group(first, list(entries))}
        else:
            groups = {}
            for entry in entries:
                key = peer_of[entry.remote_region]
                groups.setdefault(key, _Group(key)).entries.append(entry)
        if not links and len(groups) == 1:
            conn = self._peers.get(first)
            if conn is not None and conn.alive:  # the usual batch: one live connection, no emulated link
                future = await conn.submit(op, cls, next(self._batch_ids), local, groups[first].entries, self._keys)
                conn.spin(future)
                if future.done():  # completed while polling: no timer, no task switch
                    future.result()  # the batch's error, if any
                    return total
                await self._wait([conn], [future], groups)
                return total
        conns: list[PeerConnection] = []
        futures: list[asyncio.Future[int]] = []

        async def move() -> None:
            try:
                for group in groups.values():
                    conn = await self._connection(group.peer)
                    conns.append(conn)
                    futures.append(await conn.submit(op, cls, next(self._batch_ids), local, group.entries, self._keys))
            except BaseException:
                for fut in futures:
                    fut.cancel()  # sent already: its reply drains into scratch
                raise
            if len(futures) == 1:
                conns[0].spin(futures[0])
            await self._wait(conns, futures, groups)

        if links:
            await self._paced(links, total, cls, move())
        else:
            await move()
        return total

    async def _wait(self, conns: list[PeerConnection], futures: list[asyncio.Future[int]], groups: dict[tuple[str, int], _Group]) -> None:
        """Await a batch's replies (one future per peer) within ``timeout_s``.

        Raises:
            TransferTimeoutError: the replies took longer (the connections are dropped, so
                late bytes of this batch never land).
            PeerLostError, TransferError: a peer went away, or answered with an error.
        """
        # A timer, not a cancel scope: it costs nothing per batch until it fires, and when it
        # fires the connection is dropped, so late bytes of this batch never land.
        expired: list[bool] = []

        def expire() -> None:
            expired.append(True)
            for conn in conns:
                conn.abort(TransferTimeoutError(conn.peer, self.timeout_s))

        timer = asyncio.get_running_loop().call_later(self.timeout_s, expire)
        try:
            if len(futures) == 1:
                await futures[0]
            else:
                await asyncio.gather(*futures)
        except PeerLostError as exc:
            if not expired:
                raise
            raise TransferTimeoutError(_peers_of(groups), self.timeout_s) from exc
        except BaseException:
            for fut in futures:
                fut.cancel()  # a read whose caller gave up drains its reply into scratch
            raise
        finally:
            timer.cancel()

    async def _connection(self, peer: tuple[str, int]) -> PeerConnection:
        conn = self._peers.get(peer)
        if conn is not None and conn.alive:
            return conn
        lock = self._dialing.setdefault(peer, asyncio.Lock())
        async with lock:
            conn = self._peers.get(peer)
            if conn is not None and conn.alive:
                return conn
            name = f"{peer[0]}:{peer[1]}"
            try:
                with anyio.fail_after(self.connect_timeout_s):
                    raw = await _dial(peer, self.socket_buffer_bytes, self.congestion)
                    sock: socket.socket | TlsStream = raw
                    if self.tls is not None:
                        try:
                            sock = await tls_connect(raw, self.tls, peer[0])
                        except BaseException:
                            raw.close()
                            raise
            except ssl.SSLError as exc:  # an OSError too: say it was TLS
                raise PeerLostError(name, f"TLS handshake failed: {exc!r}") from exc
            except (OSError, TimeoutError) as exc:
                raise PeerLostError(name, f"cannot connect: {exc!r}") from exc
            in_process = _address(peer) in self._listening()
            conn = PeerConnection(sock, name, 0.0 if in_process else self.busy_poll_us)
            self._track(conn)
            self._peers[peer] = conn
            self._tasks.spawn(conn.read_replies(), name=f"replies-{name}")
            return conn

    def _track(self, conn: PeerConnection) -> None:
        """Keep ``conn`` among the open connections (and its local address among this
        process's) until its socket is closed."""
        try:
            here: tuple[str, int] | None = _address(conn.sock.getsockname())
        except OSError:  # already reset: the connection's reader reports it
            here = None
        if here is not None:
            _IN_PROCESS.add(here)
        self._open.add(conn)

        def closed() -> None:
            self._open.discard(conn)
            if here is not None:
                _IN_PROCESS.discard(here)

        conn.on_close = closed

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, address = await loop.sock_accept(listener)
            sock.setblocking(False)
            _no_delay(sock)
            poll_us = 0.0 if _address(address) in _IN_PROCESS else self.busy_poll_us
            host, port = _address(address)
            peer = f"{host}:{port}"
            if self.tls is None:
                self._tasks.spawn(serve_connection(sock, self._lookup, self.node_id, poll_us, peer=peer), name="serve-connection")
            else:  # the handshake in the connection's own task: a slow client holds up no other
                self._tasks.spawn(self._serve_tls(sock, poll_us, peer), name="serve-tls-connection")

    async def _serve_tls(self, sock: socket.socket, poll_us: float, peer: str) -> None:
        """Serve one accepted connection once its TLS handshake has succeeded; a client
        without a certificate of the CA (or too slow to show one) is logged and dropped."""
        assert self.tls is not None
        try:
            with anyio.fail_after(self.connect_timeout_s):
                stream = await tls_accept(sock, self.tls)
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            sock.close()
            _log.warning("tcp_tls_refused", node=self.node_id, peer=peer, reason=repr(exc))
            return
        _log.info("tcp_tls_connection", node=self.node_id, peer=peer, version=stream.version())  # once per peer: connections live long
        await serve_connection(stream, self._lookup, self.node_id, poll_us, peer=peer)

    @staticmethod
    def _listening() -> set[tuple[str, int]]:
        return {_address(t._listener.getsockname()) for t in _TRANSPORTS if t._listener is not None}

    def _lookup(self, region_id: str) -> MemoryRegion | None:
        region = self._local.get(region_id)
        return None if region is None or region.closed else region


async def _dial(peer: tuple[str, int], buffer_bytes: int | None, congestion: str) -> socket.socket:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(peer[0], peer[1], type=socket.SOCK_STREAM)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        _tune(sock, buffer_bytes, congestion)
        await loop.sock_connect(sock, address)
    except BaseException:
        sock.close()
        raise
    _no_delay(sock)
    return sock


def _address(addr: tuple) -> tuple[str, int]:  # v4 or v6 socket address
    return (str(addr[0]), int(addr[1]))


def _no_delay(sock: socket.socket) -> None:
    # A batch's request and reply are single frames: Nagle would only hold them back.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _tune(sock: socket.socket, buffer_bytes: int | None, congestion: str) -> None:
    sock.setblocking(False)
    set_congestion(sock, congestion)
    if buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


def _peers_of(groups: dict[tuple[str, int], _Group]) -> str:
    return ", ".join(f"{h}:{p}" for h, p in groups)
