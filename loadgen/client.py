"""Streaming OpenAI-compatible client: endpoint, per-turn results, and the response consumer.

Two transports (``loadgen.transports``) feed the same ``ResponseConsumer``:

* ``fast`` (default): HTTP/1.1 on an asyncio ``Protocol``. Response bytes are framed,
  SSE-split and JSON-decoded inside ``data_received``, and every token is stamped there:
  the earliest point at which user space sees it, with no task switch per token.
* ``httpx``: the standard ``httpx.AsyncClient`` streaming API (honours proxy settings),
  one client per agent because httpcore's pool does O(connections^2) work per request.
  It costs several times more CPU per request than ``fast`` and adds ~1.5 ms to TTFT on
  a 2-core VM (``dualpath.bench.loadgen`` measures both).

Timings per turn, from the moment the request is handed to the transport: TTFT (first
token), TTST (gap between first and second token), TPOT ((last - first) /
(completion_tokens - 1)), inter-token gaps (fed to ``itl_sink``), end-to-end latency.
``usage`` (prompt, completion and cached tokens) comes from the final SSE event.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Protocol as TypingProtocol
from urllib.parse import urlsplit

from loadgen.errors import HTTPStatusError, LoadgenError, ServerUnreachableError, StreamError

__all__ = ["Endpoint", "TurnResult", "ItlSink", "ResponseConsumer", "parse_response_head", "resolve_model", "MALFORMED"]

_scan = json.JSONDecoder().scan_once  # type: ignore[attr-defined]  # exists at runtime; typeshed omits it
# What decoding an unexpected (but well-framed) response can raise: reported as StreamError.
MALFORMED = (ValueError, TypeError, AttributeError, KeyError, IndexError)
_MAX_BODY = 16 << 20  # non-streamed bodies and error bodies are kept up to this size


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """Where and how to send requests. ``path`` is the completions path on the host."""

    url: str
    scheme: str
    host: str
    port: int
    path: str
    chat: bool
    model: str
    api_key: str | None = None
    timeout_s: float = 300.0
    connect_timeout_s: float = 10.0

    @classmethod
    def parse(
        cls, url: str, *, chat: bool, model: str, api_key: str | None = None, timeout_s: float = 300.0, connect_timeout_s: float = 10.0
    ) -> Endpoint:
        """Build from a base URL (``http://host:port`` or ``.../v1``).

        Raises ValueError for a URL that is not http(s) or has no host.
        """
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url must look like http://host:port, got {url!r}")
        prefix = parts.path.rstrip("/")
        if not prefix.endswith("/v1"):
            prefix += "/v1"
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(
            url=url,
            scheme=parts.scheme,
            host=parts.hostname,
            port=port,
            path=prefix + ("/chat/completions" if chat else "/completions"),
            chat=chat,
            model=model,
            api_key=api_key,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnResult:
    """What one completed request measured. Times are seconds; ``t_send`` is
    ``time.monotonic()`` just before the request was written; the others are durations
    (None when too few tokens arrived to define them)."""

    t_send: float
    ttft: float | None = None
    ttst: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    max_itl: float | None = None
    chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""
    server_timing: str | None = None
    ttft_queue: float | None = None  # the server's own split of TTFT, when it reports one
    ttft_exec: float | None = None


class ItlSink(TypingProtocol):
    """Receives inter-token gaps (seconds), e.g. a histogram."""

    def add(self, value: float) -> None: ...


class ResponseConsumer:
    """Turns one response's head and body bytes into a TurnResult on ``future``.

    Knows nothing about HTTP framing. ``on_body`` raises StreamError (or ValueError for
    bad JSON) on a malformed stream; the transport then calls ``fail``.
    """

    __slots__ = (
        "t_send",
        "chat",
        "sink",
        "future",
        "status",
        "sse",
        "timing",
        "raw",
        "line",
        "data",
        "done",
        "pieces",
        "count",
        "t_first",
        "t_second",
        "t_last",
        "max_itl",
        "usage",
        "extension",
    )

    def __init__(self, t_send: float, chat: bool, sink: ItlSink | None, future: asyncio.Future) -> None:
        self.t_send, self.chat, self.sink, self.future = t_send, chat, sink, future
        self.timing: str | None
        self.data: list[bytes]
        self.pieces: list[str]
        self.usage: dict | None
        self.status, self.sse, self.timing = 0, False, None
        self.raw, self.line, self.data = bytearray(), b"", []
        self.done, self.pieces, self.count = False, [], 0
        self.t_first = self.t_second = self.t_last = 0.0
        self.max_itl, self.usage = 0.0, None
        self.extension: dict = {}  # a DualPath server's "dualpath" object (read path, TTFT split)

    def on_head(self, status: int, headers: dict[str, str]) -> None:
        """Record the status and headers; decides whether the body is an SSE stream."""
        self.status = status
        self.timing = headers.get("server-timing")
        self.sse = status == 200 and headers.get("content-type", "").startswith("text/event-stream")

    def on_body(self, data: bytes, now: float) -> None:
        """Consume body bytes that reached user space at ``now``."""
        if not self.sse:
            if len(self.raw) < _MAX_BODY:
                self.raw += data
            return
        # Events end with a blank line; most reads carry whole events ("data: {...}\n\n").
        buf = self.line + data if self.line else data
        if len(buf) > _MAX_BODY:
            raise StreamError(f"an SSE event larger than {_MAX_BODY} bytes")
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        events = buf.split(b"\n\n")
        self.line = events.pop()
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self.data.append(line[6:] if line[5:6] == b" " else line[5:])
            if self.data:
                payload = self.data[0] if len(self.data) == 1 else b"\n".join(self.data)
                self.data = []
                self._event(payload, now)

    def _event(self, payload: bytes, now: float) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            obj = _scan(payload.decode("utf-8"), 0)[0]  # the C scanner, skipping json.loads' checks
        except StopIteration:  # e.g. leading whitespace: let json.loads decide (ValueError if bad)
            obj = json.loads(payload)
        if "error" in obj:
            raise StreamError(f"server sent an error event: {json.dumps(obj['error'])[:300]}")
        choices = obj.get("choices")
        if choices:
            choice = choices[0]
            if self.chat:
                delta = choice.get("delta") or {}
                text = delta.get("content")
                token = text or delta.get("reasoning_content")
            else:
                token = text = choice.get("text")
            if token:
                self._token(now)
                if text:
                    self.pieces.append(text)
        if obj.get("usage"):
            self.usage = obj["usage"]
        if isinstance(obj.get("dualpath"), dict):
            self.extension = obj["dualpath"]

    def _token(self, now: float) -> None:
        self.count += 1
        if self.count == 1:
            self.t_first = now
        else:
            gap = now - self.t_last
            if self.count == 2:
                self.t_second = now
            if gap > self.max_itl:
                self.max_itl = gap
            if self.sink is not None:
                self.sink.add(gap)
        self.t_last = now

    def finish(self, now: float) -> None:
        """Resolve the future with the result (or the error the response carried)."""
        if self.future.done():
            return
        try:
            self.future.set_result(self._result(now))
        except (LoadgenError, *MALFORMED) as exc:
            self.fail(exc if isinstance(exc, LoadgenError) else StreamError(f"malformed response: {exc!r}"))

    def fail(self, exc: BaseException) -> None:
        """Resolve the future with ``exc`` (no-op once resolved)."""
        if not self.future.done():
            self.future.set_exception(exc)

    def _result(self, now: float) -> TurnResult:
        if not 200 <= self.status < 300:
            raise HTTPStatusError(self.status, self.raw.decode("utf-8", "replace"))
        if not self.sse:
            self._whole_json(now)
        usage = self.usage or {}
        n = usage.get("completion_tokens") or self.count
        details = usage.get("prompt_tokens_details") or {}
        t0 = self.t_send
        return TurnResult(
            t_send=t0,
            e2e=now - t0,
            chunks=self.count,
            text="".join(self.pieces),
            ttft=self.t_first - t0 if self.count else None,
            ttst=self.t_second - self.t_first if self.count >= 2 else None,
            tpot=(self.t_last - self.t_first) / (n - 1) if self.count >= 2 and n >= 2 else None,
            max_itl=self.max_itl if self.count >= 2 else None,
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            cached_tokens=details.get("cached_tokens"),
            server_timing=self.timing,
            ttft_queue=self.extension.get("ttft_queue_s"),
            ttft_exec=self.extension.get("ttft_exec_s"),
        )

    def _whole_json(self, now: float) -> None:
        # A server that ignored "stream": every token arrives at once.
        obj = json.loads(bytes(self.raw))
        choice = (obj.get("choices") or [{}])[0]
        text = (choice.get("message") or {}).get("content") if self.chat else choice.get("text")
        if text:
            self.pieces.append(text)
            self._token(now)
        self.usage = obj.get("usage")
        if isinstance(obj.get("dualpath"), dict):
            self.extension = obj["dualpath"]


def parse_response_head(head: bytes) -> tuple[int, dict[str, str]]:
    """Status and lower-cased headers of a response head. Raises StreamError if malformed."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        raise StreamError(f"not an HTTP response: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


def resolve_model(url: str, *, model: str | None, api_key: str | None, trust_env: bool = False, timeout_s: float = 10.0) -> str:
    """Check that the server answers, and pick the model: ``model``, else the first listed.

    Asks ``GET <base>/v1/models``. Raises ServerUnreachableError when nothing answers
    within ``timeout_s``, HTTPStatusError when the listing fails and no ``model`` was
    given, StreamError when the listing is malformed or empty.
    """
    import httpx  # a one-off request: the standard client is fast enough here

    base = url.rstrip("/")
    target = base + ("/models" if base.endswith("/v1") else "/v1/models")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(target, headers=headers, timeout=timeout_s, trust_env=trust_env)
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(url, f"{type(exc).__name__}: {exc}") from None
    if model:
        return model
    if resp.status_code != 200:
        raise HTTPStatusError(resp.status_code, f"GET {target} failed (pass --model to skip it): {resp.text}")
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise StreamError(f"GET {target} did not list a model (pass --model): {resp.text[:200]}") from None
