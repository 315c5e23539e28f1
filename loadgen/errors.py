"""Errors raised by the load generator.

Hierarchy::

    LoadgenError
    ├── InputError                 bad user input (CLI exit code 2)
    │   ├── TrajectoryFormatError  a trajectory file line is malformed
    │   └── TokenizerError         --tokenizer cannot be loaded
    └── ServerError                the server misbehaved (CLI exit code 3)
        ├── ServerUnreachableError cannot connect / connection dropped
        ├── HTTPStatusError        the server answered with a non-2xx status
        └── StreamError            the response could not be parsed
            └── RequestTimeoutError no complete response within the request timeout
"""

from __future__ import annotations

__all__ = [
    "LoadgenError",
    "InputError",
    "TrajectoryFormatError",
    "TokenizerError",
    "ServerError",
    "ServerUnreachableError",
    "HTTPStatusError",
    "StreamError",
    "RequestTimeoutError",
]


class LoadgenError(Exception):
    """Base of every error the load generator raises on purpose."""


class InputError(LoadgenError):
    """Raised for invalid user input: options, dataset names, files."""


class TrajectoryFormatError(InputError):
    """Raised when a trajectory JSONL file has a malformed line.

    ``line`` is 1-based; ``field`` names the offending field (``""`` for the whole line).
    """

    def __init__(self, path: str, line: int, field: str, reason: str) -> None:
        self.path, self.line, self.field, self.reason = path, line, field, reason
        where = f"field '{field}': " if field else ""
        super().__init__(f"{path} line {line}: {where}{reason}")


class TokenizerError(InputError):
    """Raised when ``--tokenizer`` does not name a loadable ``tokenizer.json``."""

    def __init__(self, path: str, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"cannot load tokenizer from {path}: {reason}")


class ServerError(LoadgenError):
    """Base of errors caused by the server under test (or the way to it)."""


class ServerUnreachableError(ServerError):
    """Raised when a connection to ``url`` cannot be made or is lost mid-request."""

    def __init__(self, url: str, reason: str) -> None:
        self.url, self.reason = url, reason
        super().__init__(f"server {url} unreachable: {reason}")


class HTTPStatusError(ServerError):
    """Raised when the server answers a request with a non-2xx HTTP status."""

    def __init__(self, status: int, body: str) -> None:
        self.status, self.body = status, body
        super().__init__(f"HTTP {status}: {body[:300]}")


class StreamError(ServerError):
    """Raised when a response is malformed (bad framing, SSE or JSON) or times out."""


class RequestTimeoutError(StreamError):
    """Raised when a response does not complete within the request timeout."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        super().__init__(f"no complete response within {timeout_s:g} s")
