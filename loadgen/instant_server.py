"""A minimal OpenAI-compatible streaming server that answers instantly.

It exists to measure the load generator itself (``dualpath.bench.loadgen``) and to test it
without a model: ``python -m loadgen.instant_server --port 8000``. It speaks HTTP/1.1
(keep-alive, chunked SSE) on a raw asyncio ``Protocol``, so one request costs a few tens
of microseconds of server CPU and the server is never what a benchmark measures.

Served: ``GET /v1/models``, ``GET /health``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (streaming or not). Every answer has exactly ``max_tokens``
tokens (default 16); one token is the text ``" t"``. Prompt tokens are counted as
``ceil(chars / 4)``; ``cached_tokens`` is the previous prompt+answer of the conversation
whose first 64 characters match (a fake prefix cache, enough to exercise clients).

Every response carries a ``Server-Timing`` header:
``proc;dur=<ms>, recv;desc="<ns>", sent;desc="<ns>"`` where ``recv`` is the
``CLOCK_MONOTONIC`` time at which the request's last bytes reached the server,
``sent`` the time just before the first token's bytes were handed to the kernel, and
``proc`` their difference. A client on the same host subtracts ``proc`` from its own TTFT
to get the latency that the network stack and the client added.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import time
from collections import deque
from dataclasses import dataclass
from http import HTTPStatus

from loadgen._http import ServerProcess, parse_request_head

__all__ = ["InstantServerConfig", "open_server", "start_instant_server", "main"]

_TOKEN = " t"
_CACHE_LIMIT = 100_000  # conversations remembered by the fake prefix cache
_MAX_BODY = 64 << 20  # refuse request bodies above 64 MiB (HTTP 413)
_EARLY_S = 1e-6  # asyncio may run a timer this much before its time: writes due within it are due


@dataclass(frozen=True, slots=True, kw_only=True)
class InstantServerConfig:
    """How the instant server behaves.

    ttft_s: delay before the first token; tpot_s: delay between later tokens (0 sends the
    whole answer in one write); fail_status: when non-zero, every completion request is
    answered with this HTTP status and a JSON error body; model: the id it serves.
    """

    host: str = "127.0.0.1"
    port: int = 0
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    fail_status: int = 0
    model: str = "instant"


class _State:
    """Shared across connections: configuration, the fake prefix cache and the pacer."""

    def __init__(self, config: InstantServerConfig) -> None:
        self.config = config
        self.cache: dict[str, int] = {}
        self.events: dict[tuple, bytes] = {}
        self.pacer = _Pacer()

    def cached_tokens(self, key: str, prompt_tokens: int, total_tokens: int) -> int:
        """Return the hit for ``key`` and remember this conversation's new length."""
        hit = min(self.cache.pop(key, 0), prompt_tokens)
        self.cache[key] = total_tokens
        if len(self.cache) > _CACHE_LIMIT:
            del self.cache[next(iter(self.cache))]
        return hit


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:  # --fail-status accepts any code
        return "Error"


def _json_response(status: int, body: object, extra: str = "") -> bytes:
    payload = json.dumps(body).encode()
    head = f"HTTP/1.1 {status} {_phrase(status)}\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n{extra}\r\n"
    return head.encode() + payload


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _sse(obj: object) -> bytes:
    return _chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")


class _Completion:
    """One completion request: builds its SSE events and (if paced) sends them on timers."""

    def __init__(self, state: _State, chat: bool, body: dict, recv_ns: int) -> None:
        self.chat = chat
        self.model = str(body.get("model") or state.config.model)
        n = body.get("max_tokens", body.get("max_completion_tokens"))
        self.n = 16 if n is None else max(0, int(n))
        self.stream = bool(body.get("stream"))
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        text = _prompt_text(body, chat)
        prompt_tokens = math.ceil(len(text) / 4)
        cached = state.cached_tokens(text[:64], prompt_tokens, prompt_tokens + self.n)
        self.usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": self.n,
            "total_tokens": prompt_tokens + self.n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        self.recv_ns = recv_ns
        self.sent = 0
        self.events = state.events

    def timing_header(self) -> str:
        """Stamp ``sent`` now and return the Server-Timing header line."""
        sent_ns = time.monotonic_ns()
        dur_ms = (sent_ns - self.recv_ns) / 1e6
        return f'server-timing: proc;dur={dur_ms:.6f}, recv;desc="{self.recv_ns}", sent;desc="{sent_ns}"\r\n'

    def full_response(self) -> bytes:
        """The whole non-streaming JSON response."""
        text = _TOKEN * self.n
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}} if self.chat else {"index": 0, "text": text, "logprobs": None}
        )
        choice["finish_reason"] = "length"
        obj = "chat.completion" if self.chat else "text_completion"
        body = {"id": "x", "object": obj, "created": 0, "model": self.model, "choices": [choice], "usage": self.usage}
        return _json_response(200, body, self.timing_header())

    def stream_head(self) -> bytes:
        """Status line and headers of the SSE response (stamps ``sent``)."""
        return (f"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n{self.timing_header()}\r\n").encode()

    def token_event(self) -> bytes:
        """The next token's SSE event (the last one carries finish_reason)."""
        self.sent += 1
        kind = 2 if self.sent == self.n else (0 if self.sent == 1 and self.chat else 1)
        key = (self.chat, self.model, kind)
        event = self.events.get(key)
        if event is None:  # built once per (api, model, position): tokens are all alike
            event = self.events[key] = _token_event(self.chat, self.model, kind)
        return event

    def tail(self) -> bytes:
        """Usage event (if asked for), ``[DONE]`` and the chunked terminator."""
        usage = b""
        if self.include_usage:
            usage = _sse(
                {
                    "id": "x",
                    "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": 0,
                    "model": self.model,
                    "choices": [],
                    "usage": self.usage,
                }
            )
        return usage + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


def _token_event(chat: bool, model: str, kind: int) -> bytes:
    """kind 0: a chat stream's first token (carries the role); 1: any other; 2: the last."""
    finish = "length" if kind == 2 else None
    if chat:
        delta = {"role": "assistant", "content": _TOKEN} if kind == 0 else {"content": _TOKEN}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": _TOKEN, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return _sse({"id": "x", "object": obj, "created": 0, "model": model, "choices": [choice]})


def _prompt_text(body: dict, chat: bool) -> str:
    if chat:
        messages = body.get("messages") or []
        return "".join(str(m.get("content") or "") for m in messages if isinstance(m, dict))
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


class _Pacer:
    """The paced streams' next writes, on one event-loop timer.

    With thousands of streams, a ``call_later`` per token keeps as many handles in asyncio's
    timer heap, each pushed and popped through Python-level comparisons: that was most of
    the server's CPU, and a saturated server delays the very requests a benchmark times.
    Every stream waits the same ``ttft_s`` for its first token and ``tpot_s`` between the
    others, so each delay's writes fall due in the order they were scheduled: a FIFO per
    delay keeps them sorted, and one timer is armed for the earliest head.
    """

    def __init__(self) -> None:
        self.queues: dict[float, deque[tuple[float, _Protocol, _Completion, bool]]] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.armed_at = math.inf

    def add(self, delay: float, proto: _Protocol, completion: _Completion, first: bool) -> None:
        """Call ``proto._paced(completion, first)`` ``delay`` seconds from now."""
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        queue = self.queues.get(delay)
        if queue is None:
            queue = self.queues[delay] = deque()
        queue.append((due, proto, completion, first))
        if due < self.armed_at:
            self._arm(loop, due)

    def _arm(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.armed_at = due
        self.timer = loop.call_at(due, self._fire)

    def _fire(self) -> None:
        self.timer, self.armed_at = None, math.inf
        loop = asyncio.get_running_loop()
        now = loop.time() + _EARLY_S
        for queue in list(self.queues.values()):
            while queue and queue[0][0] <= now:
                _, proto, completion, first = queue.popleft()
                if proto.transport is not None and proto.completion is completion:  # not closed meanwhile
                    proto._paced(completion, first)
        head = min((q[0][0] for q in self.queues.values() if q), default=math.inf)
        if head < self.armed_at:
            self._arm(loop, head)


class _Protocol(asyncio.Protocol):
    """One HTTP/1.1 keep-alive connection; requests are answered in arrival order."""

    def __init__(self, state: _State) -> None:
        self.state = state
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.completion: _Completion | None = None  # the paced answer in progress
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None  # its paced writes still queued are dropped when they fall due
        self.completion = None

    def data_received(self, data: bytes) -> None:
        recv_ns = time.monotonic_ns()
        self.buf += data
        while not self.busy and self.transport is not None:
            head = parse_request_head(self.buf, _MAX_BODY)
            if head is None:
                return
            if head.error:
                self.transport.write(_json_response(head.error, {"error": {"message": "bad request"}}))
                self.transport.close()
                return
            body = bytes(self.buf[head.body_start : head.body_end])
            del self.buf[: head.body_end]
            self._handle(head.method, head.path, body, recv_ns)

    def _handle(self, method: str, path: str, body: bytes, recv_ns: int) -> None:
        assert self.transport is not None
        cfg = self.state.config
        if method == "GET" and path in ("/v1/models", "/models"):
            models = {"object": "list", "data": [{"id": cfg.model, "object": "model"}]}
            self.transport.write(_json_response(200, models))
            return
        if method == "GET" and path == "/health":
            self.transport.write(_json_response(200, {"status": "ok"}))
            return
        chat = path.endswith("/chat/completions")
        if method != "POST" or not (chat or path.endswith("/completions")):
            self.transport.write(_json_response(404, {"error": {"message": f"no route {path}"}}))
            return
        if cfg.fail_status:
            err = {"error": {"message": "instant server configured to fail", "code": cfg.fail_status}}
            self.transport.write(_json_response(cfg.fail_status, err))
            return
        try:
            request = json.loads(body)
            completion = _Completion(self.state, chat, request, recv_ns)
        except (ValueError, TypeError, AttributeError) as exc:
            self.transport.write(_json_response(400, {"error": {"message": f"bad body: {exc}"}}))
            return
        if not completion.stream:
            self.transport.write(completion.full_response())
        elif cfg.ttft_s <= 0 and cfg.tpot_s <= 0:
            events = [completion.token_event() for _ in range(completion.n)]
            self.transport.write(completion.stream_head() + b"".join(events) + completion.tail())
        else:
            self.busy = True
            self.completion = completion
            self.state.pacer.add(cfg.ttft_s, self, completion, True)

    def _paced(self, completion: _Completion, first: bool) -> None:
        """Send the next token (with the tail after the last one); re-arm the timer."""
        if self.transport is None:
            return
        out = completion.stream_head() if first else b""
        if completion.sent < completion.n:
            out += completion.token_event()
        if completion.sent < completion.n:
            self.transport.write(out)
            self.state.pacer.add(self.state.config.tpot_s, self, completion, False)
            return
        self.transport.write(out + completion.tail())
        self.busy, self.completion = False, None
        if self.buf:  # a pipelined request waited for this one
            self.data_received(b"")


async def open_server(config: InstantServerConfig) -> tuple[asyncio.Server, int]:
    """Bind and start serving on the running loop; returns the server and its port.

    Close the server to stop. Raises OSError when the address cannot be bound.
    """
    state = _State(config)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Protocol(state), config.host, config.port, backlog=4096, reuse_address=True)
    return server, server.sockets[0].getsockname()[1]


def start_instant_server(**options: object) -> ServerProcess:
    """Start ``python -m loadgen.instant_server`` in a subprocess on a free port.

    Keyword options are ``InstantServerConfig`` fields except host/port. Use the result as
    a context manager; its ``url`` is the server's base URL. Raises RuntimeError when the
    server does not report its port within 20 s.
    """
    args = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if key in ("ttft_s", "tpot_s"):
            flag, value = flag[:-2] + "-ms", float(value) * 1000  # type: ignore[arg-type]
        args += [flag, str(value)]
    return ServerProcess.start("loadgen.instant_server", args)


def main(argv: list[str] | None = None) -> int:
    """Run the server in the foreground; prints ``listening on URL`` once bound."""
    p = argparse.ArgumentParser(prog="python -m loadgen.instant_server", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0 picks a free one)")
    p.add_argument("--ttft-ms", type=float, default=0.0, help="delay before the first token")
    p.add_argument("--tpot-ms", type=float, default=0.0, help="delay between later tokens")
    p.add_argument("--fail-status", type=int, default=0, help="answer every completion with this HTTP status")
    p.add_argument("--model", default="instant", help="model id to serve")
    a = p.parse_args(argv)
    config = InstantServerConfig(
        host=a.host, port=a.port, ttft_s=a.ttft_ms / 1000, tpot_s=a.tpot_ms / 1000, fail_status=a.fail_status, model=a.model
    )

    async def run() -> None:
        server, port = await open_server(config)
        print(f"listening on http://{config.host}:{port}", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        async with server:
            await stop.wait()

    try:
        asyncio.run(run())
    except OSError as exc:
        print(f"instant server: cannot bind {config.host}:{config.port}: {exc}", flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
