"""The bus on a real nats-server: replies, bad messages, the per-subscription handler bound, shutdown."""

from __future__ import annotations

import asyncio
import time

import anyio
import pytest

from dualpath.bus import BUSY, Bus, BusOverflowError, BusTimeoutError, HandlerError, Respond
from dualpath.config import BusConfig
from dualpath.protocol import RemoteError, decode, encode
from dualpath.protocol import messages as m
from dualpath.protocol.messages import ErrorReply
from dualpath.runtime import run_service

pytestmark = pytest.mark.anyio


async def test_a_handler_answers_and_a_garbage_message_gets_a_400_while_serving_goes_on(nats_server) -> None:
    async with Bus.open(nats_server.url, "t") as bus:

        async def lookup(req: m.LookupRequest) -> m.LookupReply:
            return m.LookupReply(hit_blocks=len(req.hashes))

        await bus.serve("t.lookup", lookup, m.LookupRequest)
        reply = await bus.request("t.lookup", m.LookupRequest(model_digest=1, hashes=[1, 2, 3]), m.LookupReply, timeout=2.0)
        assert reply.hit_blocks == 3
        raw = await bus.nc.request("t.lookup", b"\xc1 not msgpack", timeout=2.0)
        assert decode(raw.data, ErrorReply).code == 400
        with pytest.raises(RemoteError) as err:
            await bus.request("t.lookup", m.StateRequest(), m.LookupReply, timeout=2.0)
        assert err.value.code == 400
        assert (await bus.request("t.lookup", m.LookupRequest(model_digest=1, hashes=[1]), m.LookupReply, timeout=2.0)).hit_blocks == 1


async def test_a_handler_error_becomes_an_error_reply_with_its_code(nats_server) -> None:
    async with Bus.open(nats_server.url, "t") as bus:

        async def refuse(_req: m.FreeRequest) -> m.Ok:
            raise HandlerError(409, "already there")

        await bus.serve("t.free", refuse, m.FreeRequest)
        with pytest.raises(RemoteError) as err:
            await bus.request("t.free", m.FreeRequest(request_id="r"), m.Ok, timeout=2.0)
        assert (err.value.code, err.value.message) == (409, "already there")


async def test_an_inline_handler_answers_now_or_later_in_order_and_garbage_gets_a_400(nats_server) -> None:
    """Inline: no task per message, messages handled in arrival order, a reply returned or
    published later through ``respond``; errors become error replies as in task mode."""
    seen: list[int] = []
    later: list[Respond] = []
    async with Bus.open(nats_server.url, "t") as bus:

        async def handle(req: m.LookupRequest, respond: Respond) -> m.LookupReply | bytes | None:
            seen.append(req.model_digest)
            if req.model_digest == 0:
                later.append(respond)  # answered once the third request arrived
                return None
            if req.model_digest == 2:
                raise HandlerError(BUSY, "full")
            for r in later:
                await r(m.LookupReply(hit_blocks=99))
            return encode(m.LookupReply(hit_blocks=len(req.hashes)))  # an encoded reply goes out as it is

        await bus.serve("t.inline", handle, m.LookupRequest, inline=True)
        ask = [bus.request("t.inline", m.LookupRequest(model_digest=d, hashes=[1, 2]), m.LookupReply, timeout=5.0) for d in (0, 2, 1)]
        first = asyncio.ensure_future(ask[0])
        await asyncio.sleep(0.2)  # the first is held before the others are sent
        with pytest.raises(RemoteError) as err:
            await ask[1]
        assert err.value.code == BUSY
        assert (await ask[2]).hit_blocks == 2
        assert (await first).hit_blocks == 99
        assert seen == [0, 2, 1]
        raw = await bus.nc.request("t.inline", b"\xc1 not msgpack", timeout=2.0)
        assert decode(raw.data, ErrorReply).code == 400
        await bus.stop_serving()
        with pytest.raises(BusTimeoutError):
            await bus.request("t.inline", m.LookupRequest(model_digest=1, hashes=[1]), m.LookupReply, timeout=1.0)


async def test_an_inline_handler_runs_in_the_caller_s_trace_context_from_the_headers(nats_server) -> None:
    from opentelemetry import trace

    trace_id, span_id = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
    seen: list[int] = []
    async with Bus.open(nats_server.url, "t") as bus:

        async def handle(_req: m.LookupRequest, _respond: Respond) -> m.LookupReply:
            seen.append(trace.get_current_span().get_span_context().trace_id)
            return m.LookupReply(hit_blocks=0)

        await bus.serve("t.traced", handle, m.LookupRequest, inline=True)
        data = encode(m.LookupRequest(model_digest=1, hashes=[1]))
        await bus.nc.request("t.traced", data, timeout=2.0, headers={"traceparent": f"00-{trace_id:032x}-{span_id:016x}-01"})
        await bus.nc.request("t.traced", data, timeout=2.0)  # no headers: no context, and none left over from the first
    assert seen == [trace_id, 0]


async def test_a_request_to_a_subject_nobody_serves_is_a_bus_timeout_error_at_once(nats_server) -> None:
    async with Bus.open(nats_server.url, "t") as bus:
        t0 = time.monotonic()
        with pytest.raises(BusTimeoutError) as err:
            await bus.request("t.nobody", m.FreeRequest(request_id="r"), m.Ok, timeout=30.0)
        assert err.value.no_responders and time.monotonic() - t0 < 10.0  # at once, not after the 30 s timeout


async def test_a_request_past_the_handler_bound_is_answered_busy_at_once_and_reported_as_overflow(nats_server) -> None:
    reported: list[Exception] = []
    release = anyio.Event()
    started = 0

    async def slow(_req: m.FreeRequest) -> m.Ok:
        nonlocal started
        started += 1
        await release.wait()
        return m.Ok()

    async def on_error(exc: Exception) -> None:
        reported.append(exc)

    async with Bus.open(nats_server.url, "server") as server, Bus.open(nats_server.url, "client") as client:
        server._error_cb = on_error
        await server.serve("t.slow", slow, m.FreeRequest, max_in_flight=2)
        answers: list[object] = []

        async def ask(i: int) -> None:
            try:
                answers.append(await client.request("t.slow", m.FreeRequest(request_id=f"r{i}"), m.Ok, timeout=30.0))
            except RemoteError as exc:
                answers.append(exc)

        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(ask, i)
            while started < 2:
                await anyio.sleep(0.01)
            t0 = time.monotonic()
            await ask(2)  # the third, while two handlers run
            busy_after = time.monotonic() - t0
            release.set()
        busy = [a for a in answers if isinstance(a, RemoteError)]
        assert len(busy) == 1 and busy[0].code == BUSY and "busy" in busy[0].message
        assert busy_after < 10.0  # answered at once, not left to its 30 s timeout
        assert sum(isinstance(a, m.Ok) for a in answers) == 2
        assert server.refused == 1
        assert len(reported) == 1 and isinstance(reported[0], BusOverflowError) and reported[0].subject == "t.slow"
        # Room again once the handlers ended.
        assert isinstance(await client.request("t.slow", m.FreeRequest(request_id="again"), m.Ok, timeout=5.0), m.Ok)


async def test_publishes_past_the_handler_bound_are_dropped_and_counted(nats_server) -> None:
    release = anyio.Event()
    handled = 0

    async def slow(_rep: m.EngineReport) -> None:
        nonlocal handled
        await release.wait()
        handled += 1

    async with Bus.open(nats_server.url, "server") as server:
        server._error_cb = _ignore
        await server.serve("t.report", slow, m.EngineReport, max_in_flight=3)
        for i in range(10):
            await server.publish(  # its own connection: no race with the SUB
                "t.report",
                m.EngineReport(
                    engine_id=f"e{i}", role=int(m.Role.PREFILL), node_id="n", seq=0, tok=0, free_hbm_tokens=0, capacity_tokens=0
                ),
            )
        await server.nc.flush()
        await _until(lambda: server.refused >= 7, lambda: f"refused {server.refused} of 10 (3 should run)")
        release.set()
        await _until(lambda: handled >= 3, lambda: f"handled {handled} of 3 after release")
        assert (handled, server.refused) == (3, 7)


async def _until(done, state, timeout: float = 20.0) -> None:
    """Poll ``done()`` (a busy 2-core CI host can be slow); fail with ``state()`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, state()
        await anyio.sleep(0.01)


async def _ignore(_exc: Exception) -> None:
    pass


async def test_closing_the_bus_cancels_a_handler_that_outlives_the_grace(nats_server) -> None:
    started, cancelled = anyio.Event(), anyio.Event()

    async def stuck(_req: m.FreeRequest) -> m.Ok:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()
        return m.Ok()

    async with anyio.create_task_group() as handlers:
        server = await Bus.connect(nats_server.url, "server", tasks=handlers)
        try:
            await server.serve("t.stuck", stuck, m.FreeRequest)
            await server.publish("t.stuck", m.FreeRequest(request_id="r"))  # same connection: no race with the SUB
            with anyio.fail_after(10):
                await started.wait()
            t0 = time.monotonic()
            await server.close(grace=0.2)
        finally:
            if not server.nc.is_closed:
                await server.nc.close()
    assert cancelled.is_set() and time.monotonic() - t0 < 5.0
    assert server.nc.is_closed


@pytest.fixture()
def in_process_runner(monkeypatch):
    """``run_service`` in this process, without configuring its logging, tracing and metrics:
    those are process-wide and would outlive the test (a log stream bound to a captured stderr)."""
    import dualpath.runtime as runtime

    for name in ("configure_logging", "configure_tracing", "shutdown_tracing", "shutdown_metrics"):
        monkeypatch.setattr(runtime, name, lambda *a, **k: None)
    monkeypatch.setattr(runtime, "configure_metrics", lambda *a, **k: False)
    return runtime


def test_the_service_runner_hands_main_a_task_group_and_ends_its_tasks_after_main_returns(
    nats_server, in_process_runner, monkeypatch
) -> None:
    """A background task still running when ``main`` returns is cancelled after the grace; the service exits 0."""
    monkeypatch.setattr(in_process_runner, "_GRACE_S", 0.2)
    seen: dict[str, object] = {}

    async def main(bus: Bus, stop: asyncio.Event, tasks) -> None:
        async def forever() -> None:
            try:
                await anyio.sleep_forever()
            finally:
                seen["background_cancelled"] = True

        async def echo(req: m.FreeRequest) -> m.Ok:
            return m.Ok(detail=req.request_id)

        tasks.start_soon(forever)
        await bus.serve("svc.echo", echo, m.FreeRequest)
        seen["echo"] = (await bus.request("svc.echo", m.FreeRequest(request_id="x"), m.Ok, timeout=2.0)).detail

    t0 = time.monotonic()
    assert run_service("test-svc", BusConfig(nats_url=nats_server.url), main) == 0
    assert seen == {"echo": "x", "background_cancelled": True}
    assert time.monotonic() - t0 < 10.0


def test_a_service_whose_main_fails_exits_1_with_a_one_line_message(nats_server, in_process_runner, capsys) -> None:
    async def main(_bus: Bus, _stop: asyncio.Event) -> None:
        raise RuntimeError("the index is corrupt")

    assert run_service("test-svc", BusConfig(nats_url=nats_server.url), main) == 1
    assert "test-svc: fatal: the index is corrupt" in capsys.readouterr().err


def test_an_embedded_server_never_hands_out_another_servers_port(nats_server) -> None:
    """On a shared host the chosen port may be taken meanwhile: a client must reach its own server."""
    from dualpath.bus.embedded import EmbeddedNats

    with pytest.raises(RuntimeError, match="taken"):
        EmbeddedNats(port=nats_server.port).start()  # a port given by the caller is not changed
    mine = EmbeddedNats()
    mine.port = nats_server.port  # as if free_port's port had been taken before the bind
    try:
        mine.start()
        assert mine.port != nats_server.port
    finally:
        mine.stop()
