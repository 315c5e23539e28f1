"""Response parsing and timing of the streaming client, fed bytes directly."""

from __future__ import annotations

import asyncio
import json

import pytest

from loadgen.client import Endpoint, ResponseConsumer
from loadgen.errors import HTTPStatusError, ServerUnreachableError, StreamError
from loadgen.report import LogHistogram
from loadgen.transports import _H1Protocol


class _Transport:
    closed = False

    def close(self) -> None:
        self.closed = True


def _event(obj: object, sep: bytes = b"\n\n") -> bytes:
    return b"data: " + json.dumps(obj).encode() + sep


def _tokens(texts: list[str], usage: dict | None = None, sep: bytes = b"\n\n") -> bytes:
    body = b"".join(_event({"choices": [{"index": 0, "text": t}]}, sep) for t in texts)
    if usage is not None:
        body += _event({"choices": [], "usage": usage}, sep)
    return body + b"data: [DONE]" + sep


def _chunked(body: bytes, size: int = 37) -> bytes:
    chunks = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nserver-timing: proc;dur=1\r\n\r\n"
_USAGE = {"prompt_tokens": 9, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}


@pytest.fixture()
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _feed(loop, pieces: list[bytes], *, chat: bool = False, lose: bool = False):
    future = loop.create_future()
    protocol = _H1Protocol("http://x")
    protocol.transport = _Transport()
    protocol.start(ResponseConsumer(0.0, chat, None, future))
    for piece in pieces:
        protocol.data_received(piece)
    if lose:
        protocol.connection_lost(None)
    assert future.done()
    return future.result()


def test_a_chunked_sse_stream_split_at_every_byte_boundary_gives_the_same_result(loop) -> None:
    wire = _HEAD + _chunked(_tokens([" a", " b", " c"], _USAGE))
    whole = _feed(loop, [wire])
    assert (whole.text, whole.chunks, whole.completion_tokens) == (" a b c", 3, 3)
    assert (whole.prompt_tokens, whole.cached_tokens, whole.server_timing) == (9, 4, "proc;dur=1")
    for cut in range(1, len(wire)):
        split = _feed(loop, [wire[:cut], wire[cut:]])
        assert (split.text, split.chunks, split.cached_tokens) == (" a b c", 3, 4), cut


def test_crlf_separated_events_and_one_byte_reads_are_parsed(loop) -> None:
    wire = _HEAD + _chunked(_tokens([" x", " y"], _USAGE, sep=b"\r\n\r\n"), size=5)
    result = _feed(loop, [wire[i : i + 1] for i in range(len(wire))])
    assert result.text == " x y" and result.completion_tokens == 3


def test_chat_deltas_count_content_and_ignore_the_role_only_chunk(loop) -> None:
    events = [
        {"choices": [{"delta": {"role": "assistant"}}]},
        {"choices": [{"delta": {"content": "hi"}}]},
        {"choices": [{"delta": {"content": " there"}}]},
    ]
    body = b"".join(_event(e) for e in events) + b"data: [DONE]\n\n"
    result = _feed(loop, [_HEAD + _chunked(body)], chat=True)
    assert result.text == "hi there" and result.chunks == 2


def test_a_non_streamed_json_answer_counts_as_one_token_event(loop) -> None:
    body = json.dumps({"choices": [{"text": "whole"}], "usage": _USAGE}).encode()
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    result = _feed(loop, [head + body])
    assert result.text == "whole" and result.chunks == 1 and result.completion_tokens == 3


def test_an_error_status_raises_with_the_status_and_body(loop) -> None:
    body = b'{"error": "overloaded"}'
    wire = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    with pytest.raises(HTTPStatusError) as info:
        _feed(loop, [wire])
    assert info.value.status == 503 and "overloaded" in info.value.body


@pytest.mark.parametrize(
    "wire",
    [
        _HEAD + _chunked(_event({"error": {"message": "boom"}})),
        _HEAD + b"zz\r\nxx\r\n",
        _HEAD + _chunked(b"data: {not json\n\n"),
        b"SMTP nonsense\r\n\r\n",
    ],
)
def test_malformed_or_error_streams_raise_stream_error(loop, wire: bytes) -> None:
    with pytest.raises(StreamError):
        _feed(loop, [wire])


def test_a_connection_closed_mid_stream_is_reported_as_unreachable(loop) -> None:
    wire = _HEAD + _chunked(_tokens([" a"]))[:40]
    with pytest.raises(ServerUnreachableError, match="closed before the response ended"):
        _feed(loop, [wire], lose=True)


def test_timings_are_measured_from_the_send_time(loop) -> None:
    future = loop.create_future()
    sink = LogHistogram()
    c = ResponseConsumer(10.0, False, sink, future)
    c.on_head(200, {"content-type": "text/event-stream"})
    c.on_body(_event({"choices": [{"text": "a"}]}), 10.5)
    c.on_body(_event({"choices": [{"text": "b"}]}), 10.6)
    c.on_body(_event({"choices": [{"text": "c"}]}) + _event({"choices": [], "usage": {"completion_tokens": 3}}), 10.8)
    c.finish(10.9)
    r = future.result()
    assert r.ttft == pytest.approx(0.5) and r.ttst == pytest.approx(0.1)
    assert r.tpot == pytest.approx(0.15) and r.max_itl == pytest.approx(0.2) and r.e2e == pytest.approx(0.9)
    assert int(sink.counts.sum()) == 2 and sink.percentile(100) == pytest.approx(0.2, rel=0.01)


def test_endpoint_accepts_urls_with_or_without_v1() -> None:
    assert Endpoint.parse("http://h:8000", chat=False, model="m").path == "/v1/completions"
    assert Endpoint.parse("http://h:8000/v1/", chat=True, model="m").path == "/v1/chat/completions"
    e = Endpoint.parse("https://h/api", chat=False, model="m")
    assert (e.port, e.path) == (443, "/api/v1/completions")
    with pytest.raises(ValueError):
        Endpoint.parse("ftp://h", chat=False, model="m")


async def _serve(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


_ANSWER = _HEAD + _chunked(_tokens([" ok"], {"completion_tokens": 1}))


async def _read_request(reader) -> bool:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    await reader.readexactly(length)
    return True


@pytest.mark.anyio
async def test_a_keep_alive_connection_the_server_dropped_is_retried_once_on_a_fresh_one() -> None:
    from loadgen.transports import FastConnection

    async def handler(reader, writer):  # answers the first request of a connection, drops the second
        try:
            await _read_request(reader)
            writer.write(_ANSWER)
            await _read_request(reader)
        except asyncio.IncompleteReadError:
            pass  # the client closed this connection first
        finally:
            writer.close()
            await writer.wait_closed()

    server, url = await _serve(handler)
    async with server:
        conn = FastConnection(Endpoint.parse(url, chat=False, model="m"))
        assert (await conn.request(b"{}")).text == " ok"
        assert (await conn.request(b"{}")).text == " ok"  # stale connection: retried, not failed
        await conn.aclose()


@pytest.mark.anyio
async def test_a_fresh_connection_closed_without_an_answer_is_an_error() -> None:
    from loadgen.transports import FastConnection

    async def handler(reader, writer):
        await _read_request(reader)
        writer.close()
        await writer.wait_closed()

    server, url = await _serve(handler)
    async with server:
        conn = FastConnection(Endpoint.parse(url, chat=False, model="m"))
        with pytest.raises(ServerUnreachableError, match="closed before any response"):
            await conn.request(b"{}")
        await conn.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("transport", ["fast", "httpx"])
async def test_each_agents_connection_sends_its_own_session_header(transport: str) -> None:
    from loadgen.runner import LoadSpec, session_headers
    from loadgen.transports import open_connection

    seen: list[bytes] = []

    async def handler(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head.lower())
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(_ANSWER)
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    server, url = await _serve(handler)
    ep = Endpoint.parse(url, chat=False, model="m")
    spec = LoadSpec(endpoint=ep, trajectories=(), arrivals=(), offline=True, text_seed=7)
    async with server:
        for index in (0, 1):
            conn = open_connection(ep, transport, session_headers(spec, index))
            assert (await conn.request(b"{}")).text == " ok"
            await conn.aclose()
    assert [h.split(b"x-session-id: ")[1].split(b"\r\n")[0] for h in seen] == [b"agent-7-0", b"agent-7-1"]
    off = LoadSpec(endpoint=ep, trajectories=(), arrivals=(), offline=True, session_header=False)
    assert session_headers(off, 0) == {}
