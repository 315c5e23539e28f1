"""A link emulator in userspace, for kernels without netem: ``python -m dualpath.cli.launcher.netns_relay``.

``NetnsNetwork.shape`` runs it (in the bridge namespace, as root) when a delay is asked for and
the kernel has no netem qdisc. It takes the host's bridge port ``v-<host>`` off the bridge, reads
and writes that port's frames through an AF_PACKET socket, and puts a TAP device ``t-<host>`` on
the bridge in its place; every frame crossing between the two is held ``--delay-ms`` in the FIFO
of its direction (order kept per direction, as on a wire), a random ``--loss`` percent is
dropped, and with ``--rate-mbit`` each direction is paced to that rate. Both directions are
shaped, as netem on both ends of the link was: a round trip gets twice the delay.

While it runs, the host's ``eth0`` sends without checksum offload (so without TSO): a packet
socket would otherwise read frames whose checksum is not filled in yet and 64 KiB TSO frames
that no 1500-byte link carries. A frame longer than the port's MTU is dropped and counted.
SIGTERM stops it: the TAP goes, ``v-<host>`` is back on the bridge and the offload back on
(``restore``, which the controller also runs after a relay it had to kill).
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import json
import os
import random
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["Direction", "in_netns", "main", "port_name", "restore", "set_tx_checksum", "tap_name"]

READY = "relay ready"  # the line the relay prints once the link runs through it
QUEUE_BYTES = 16 << 20  # per direction; a frame past it is dropped, as by a full qdisc
BURST = 64  # frames read from one end per wake-up before the other end gets its turn

ETH_P_ALL = 0x0003
SOL_PACKET, PACKET_ADD_MEMBERSHIP, PACKET_MR_PROMISC, PACKET_IGNORE_OUTGOING = 263, 1, 1, 23
SO_RCVBUFFORCE = 33
TUNSETIFF, IFF_TAP, IFF_NO_PI = 0x400454CA, 0x0002, 0x1000
SIOCETHTOOL, ETHTOOL_STXCSUM = 0x8946, 0x17
CLONE_NEWNET = 0x40000000


def port_name(host: str) -> str:
    """The host's veth end on the bridge."""
    return f"v-{host}"


def tap_name(host: str) -> str:
    """The TAP device that stands in for ``port_name(host)`` on the bridge while the relay runs."""
    return f"t-{host}"


@dataclass(slots=True)
class Direction:
    """One way across the link: ``offer`` a frame as it arrives, take ``due`` frames to send.

    A random ``loss`` share (0..1) is dropped, as is a frame longer than ``largest`` bytes or one
    that would queue past ``limit`` bytes; the rest are paced at ``rate`` bytes/s (0: not paced)
    and each is released ``delay`` s after it has been paced out. The delay is the same for
    every frame, so release times never decrease and a FIFO is the time-ordered queue.
    """

    delay: float
    loss: float = 0.0
    rate: float = 0.0
    largest: int = 1518
    limit: int = QUEUE_BYTES
    rng: random.Random = field(default_factory=random.Random)
    queue: deque[tuple[float, bytes]] = field(default_factory=deque)  # (release time, frame)
    queued: int = 0  # bytes in queue
    paced_until: float = 0.0  # when the frames offered so far have left at ``rate``
    passed: int = 0
    lost: int = 0
    oversized: int = 0
    overflowed: int = 0

    def offer(self, frame: bytes, now: float) -> None:
        if len(frame) > self.largest:
            self.oversized += 1
        elif self.loss and self.rng.random() < self.loss:
            self.lost += 1
        elif self.queued + len(frame) > self.limit:
            self.overflowed += 1
        else:
            self.paced_until = max(now, self.paced_until) + (len(frame) / self.rate if self.rate else 0.0)
            self.queue.append((self.paced_until + self.delay, frame))
            self.queued += len(frame)

    def next_release(self) -> float | None:
        return self.queue[0][0] if self.queue else None

    def due(self, now: float) -> Iterator[bytes]:
        while self.queue and self.queue[0][0] <= now:
            _, frame = self.queue.popleft()
            self.queued -= len(frame)
            self.passed += 1
            yield frame

    def counts(self) -> str:
        return f"passed {self.passed}, lost {self.lost}, oversized {self.oversized}, overflowed {self.overflowed}"


# ---- namespaces, devices ------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextmanager
def in_netns(name: str) -> Iterator[None]:
    """This thread in network namespace ``name`` (``ip netns``) for the block: a socket made
    in it belongs to that namespace for its whole life. Raises OSError when there is none."""
    back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        there = os.open(f"/run/netns/{name}", os.O_RDONLY)
        try:
            _setns(there)
            try:
                yield
            finally:
                _setns(back)
        finally:
            os.close(there)
    finally:
        os.close(back)


def set_tx_checksum(netns: str, dev: str, on: bool) -> None:
    """Checksum offload (and with it TSO) of ``dev`` in ``netns`` on or off, as
    ``ethtool -K dev tx on|off`` does. Raises OSError."""
    with in_netns(netns):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with s:
        value = ctypes.create_string_buffer(struct.pack("II", ETHTOOL_STXCSUM, int(on)), 8)
        fcntl.ioctl(s, SIOCETHTOOL, struct.pack("16sP16x", dev.encode(), ctypes.addressof(value)))


def _ip(netns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", "-n", netns, *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise OSError(f"ip -n {netns} {' '.join(args)}: {r.stderr.strip()}")
    return r


def restore(bridge_ns: str, host_ns: str, host: str) -> None:
    """The host's link as it was without a relay: no TAP, ``v-<host>`` on the bridge, checksum
    offload on (a veth's default). Idempotent; a namespace already removed is no error."""
    _ip(bridge_ns, "link", "del", "dev", tap_name(host), check=False)
    _ip(bridge_ns, "link", "set", "dev", port_name(host), "master", "br0", check=False)
    try:
        set_tx_checksum(host_ns, "eth0", True)
    except OSError:
        pass


def _open_port(dev: str) -> socket.socket:
    """Every frame arriving on ``dev`` (promiscuous; our own sends are not read back)."""
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 4 << 20)
    s.bind((dev, ETH_P_ALL))
    s.setsockopt(SOL_PACKET, PACKET_ADD_MEMBERSHIP, struct.pack("iHH8s", socket.if_nametoindex(dev), PACKET_MR_PROMISC, 0, b""))
    s.setblocking(False)
    return s


def _open_tap(name: str) -> int:
    """A TAP device ``name`` (gone when the descriptor closes): frames written are received on it."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


# ---- the relay ------------------------------------------------------------------------------------


class _Stop(Exception):
    """SIGTERM or SIGINT: leave the loop (the link is restored on the way out)."""


def _raise_stop(*_: object) -> None:
    raise _Stop


def _relay(port: socket.socket, tap: int, up: Direction, down: Direction) -> None:
    """Frames from the host (read on the port) go ``up`` to the TAP; the bridge's frames (read
    on the TAP) go ``down`` to the port. Sleeps in epoll until a frame arrives or one is due;
    returns never (raises _Stop, or OSError when an end goes away)."""
    sel = selectors.DefaultSelector()
    sel.register(port, selectors.EVENT_READ, (lambda: port.recv(65536), up))
    sel.register(tap, selectors.EVENT_READ, (lambda: os.read(tap, 65536), down))
    sends = ((up, lambda f: os.write(tap, f)), (down, port.send))
    while True:
        wake = [t for t in (up.next_release(), down.next_release()) if t is not None]
        for key, _ in sel.select(max(0.0, min(wake) - time.monotonic()) if wake else None):
            read, way = key.data
            now = time.monotonic()
            for _ in range(BURST):
                try:
                    way.offer(read(), now)
                except BlockingIOError:
                    break
        now = time.monotonic()
        for way, send in sends:
            for frame in way.due(now):
                try:
                    send(frame)
                except (BlockingIOError, OSError) as exc:
                    if isinstance(exc, BlockingIOError) or exc.errno == errno.ENOBUFS:  # dropped, as by a full queue
                        way.overflowed += 1
                    else:
                        raise


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dualpath.cli.launcher.netns_relay", description=__doc__)
    p.add_argument("--bridge-netns", required=True, help="the namespace of the bridge br0 (this process runs in it)")
    p.add_argument("--host-netns", required=True, help="the host's namespace (its eth0 sends without checksum offload)")
    p.add_argument("--host", required=True, help="host name: the link is v-<host> on the bridge")
    p.add_argument("--delay-ms", type=float, default=0.0, help="added to each direction")
    p.add_argument("--loss", type=float, default=0.0, help="percent of frames dropped, each direction")
    p.add_argument("--rate-mbit", type=float, default=0.0, help="each direction paced to this rate (0: not paced)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    port, tap = port_name(a.host), tap_name(a.host)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_stop)
    link = json.loads(_ip(a.bridge_netns, "-j", "link", "show", "dev", port).stdout)[0]
    way = {"delay": a.delay_ms / 1000.0, "loss": a.loss / 100.0, "rate": a.rate_mbit * 1e6 / 8, "largest": link["mtu"] + 18}
    up, down = Direction(**way), Direction(**way)  # 18: the Ethernet header and a VLAN tag
    sock, fd = None, -1
    try:
        set_tx_checksum(a.host_netns, "eth0", False)
        sock, fd = _open_port(port), _open_tap(tap)
        _ip(a.bridge_netns, "link", "set", "dev", tap, "mtu", str(link["mtu"]))
        _ip(a.bridge_netns, "link", "set", "dev", port, "nomaster")
        while True:  # frames read while the port was still bridged have been delivered already
            try:
                sock.recv(65536)
            except BlockingIOError:
                break
        _ip(a.bridge_netns, "link", "set", "dev", tap, "master", "br0", "up")
        rate = f"{a.rate_mbit:g} Mbit/s" if a.rate_mbit else "not paced"
        print(f"{READY}: {port} <-> {tap}, each way {a.delay_ms:g} ms, {a.loss:g}% loss, {rate}", flush=True)
        _relay(sock, fd, up, down)
    except _Stop:
        pass
    except OSError as exc:
        print(f"relay {a.host}: {exc}", flush=True)
        return 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the restore short
        if fd >= 0:
            os.close(fd)
        if sock is not None:
            sock.close()
        restore(a.bridge_netns, a.host_netns, a.host)
        print(f"relay {a.host} stopped; from the host: {up.counts()}; to the host: {down.counts()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
