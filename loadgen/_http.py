"""Small HTTP helpers shared by the instant server and the overhead benchmark.

``parse_request_head`` is the instant server's HTTP/1.1 request framing;
``ServerProcess`` runs a ``python -m`` server in a subprocess and learns its URL from the
``listening on URL`` line it prints.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass

__all__ = ["RequestHead", "parse_request_head", "ServerProcess"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestHead:
    """A framed request: method, path and where its body lies in the buffer.

    ``error`` is an HTTP status (400 malformed, 413 too large) when framing failed.
    """

    method: str = ""
    path: str = ""
    body_start: int = 0
    body_end: int = 0
    error: int = 0


def parse_request_head(buf: bytearray, max_body: int) -> RequestHead | None:
    """Frame the first request in ``buf``; None while its head or body is incomplete.

    Only ``content-length`` bodies are supported (what every HTTP client sends for a JSON
    body). Never raises: malformed input yields ``RequestHead(error=400)``.
    """
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return RequestHead(error=431) if len(buf) > 65536 else None
    lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        return RequestHead(error=400)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            try:
                length = int(value.strip())
            except ValueError:
                return RequestHead(error=400)
    if length < 0:
        return RequestHead(error=400)
    if length > max_body:
        return RequestHead(error=413)
    body_start = end + 4
    if len(buf) < body_start + length:
        return None
    path = parts[1].split("?", 1)[0]
    return RequestHead(method=parts[0], path=path, body_start=body_start, body_end=body_start + length)


class ServerProcess:
    """A server module run as ``python -m MODULE --host 127.0.0.1 --port 0 ARGS``.

    A context manager: entering waits for the URL, leaving terminates the process.
    """

    def __init__(self, proc: subprocess.Popen, url: str, drain: threading.Thread | None = None) -> None:
        self.proc = proc
        self.url = url
        self._drain = drain  # reads the output until the process ends

    @classmethod
    def start(cls, module: str, args: list[str], timeout_s: float = 20.0) -> ServerProcess:
        """Start the subprocess and wait for its ``listening on URL`` line.

        Raises RuntimeError (with the process's output) when no URL comes in time.
        """
        cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", "0", *args]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        stdout = proc.stdout
        assert stdout is not None  # stdout=PIPE
        first: list[str] = []
        reader = threading.Thread(target=lambda: first.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        line = first[0].strip() if first else ""
        if not line.startswith("listening on "):
            proc.kill()
            out = proc.communicate()[0]
            raise RuntimeError(f"{module} did not start: {line} {out}".strip())
        # Drain later output so a chatty server never blocks on a full pipe.
        drain = threading.Thread(target=stdout.read, daemon=True)
        drain.start()
        return cls(proc, line.removeprefix("listening on "), drain)

    def stop(self) -> None:
        """Terminate the process (kill after 5 s), wait for it and close its output pipe."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._drain is not None:
            self._drain.join(5)  # EOF once the process is gone
        if self.proc.stdout is not None and (self._drain is None or not self._drain.is_alive()):
            self.proc.stdout.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
