"""Hostile NATS clients against a real nats-server configured as ``dualpath up`` configures it.

The server's configuration is the one the launcher writes (``nats_servers`` with a
``ClusterAuth`` and, for the TLS case, a ``ClusterTls``); the clients are nats.py connections.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import nats
import pytest
from conftest import spawn_nats
from nats.errors import Error as NatsError

from dualpath.bus import Bus
from dualpath.bus.auth import OPERATOR, ClusterAuth, ClusterTls, Identity
from dualpath.ha.natscluster import nats_servers
from dualpath.protocol import encode
from dualpath.protocol import messages as m
from dualpath.protocol.subjects import Role, Subjects

# nats.py leaves the socket of a refused connection for the garbage collector to close, which
# Python reports as an unraisable ResourceWarning; conftest collects them when this module ends.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

NS = "dp"
S = Subjects(NS)
SCHEDULER = Identity(Role.SCHEDULER, "s0")
PREFILL = Identity(Role.PREFILL, "p0e0", "p0")
GATEWAY = Identity(Role.GATEWAY, "gw0")
KVP = Identity(Role.KV_PERSISTENCE, "r0")
OPS = Identity(OPERATOR, "launcher")


class Server:
    def __init__(self, root: Path, *, tls: bool = False) -> None:
        self.auth = ClusterAuth(NS)
        self.auth.add_all([SCHEDULER, PREFILL, GATEWAY, KVP, OPS])
        self.tls = ClusterTls(root / "tls", hosts=["127.0.0.1"]) if tls else None
        spec = nats_servers(1, root, auth=self.auth, tls=self.tls)[0]
        self.url, self.log = spec.url, root / "nats.log"
        self.proc = spawn_nats(spec.cmd, spec.url, self.log)

    def options(self, identity: Identity) -> dict:
        out = self.auth.connect_options(identity)
        if self.tls is not None:
            out["tls"] = self.tls.ssl_context(identity.user)
        return out

    def violations(self) -> list[str]:
        return [ln for ln in self.log.read_text().splitlines() if " Violation - " in ln]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(5)


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path)
    yield s
    s.stop()


async def _connect(server: Server, identity: Identity, errors: list[str] | None = None):
    async def on_error(exc: Exception) -> None:
        if errors is not None:
            errors.append(str(exc))

    return await nats.connect(server.url, allow_reconnect=False, connect_timeout=3, error_cb=on_error, **server.options(identity))


def test_a_client_without_credentials_or_with_wrong_ones_is_refused(server):
    async def go() -> list[str]:
        refused = []
        for options in ({}, {"user": PREFILL.user, "password": "guess"}, {"user": "nobody", "password": "x"}):
            with pytest.raises(NatsError) as exc:
                await nats.connect(server.url, allow_reconnect=False, connect_timeout=3, **options)
            refused.append(str(exc.value))
        return refused

    refused = asyncio.run(go())
    assert all("Authorization Violation" in r for r in refused), refused


def test_an_engine_cannot_command_forge_reports_or_read_streams(server):
    """What a compromised prefill engine tries, and what reaches the scheduler and the gateway."""

    async def go():
        errors: list[str] = []
        got: list[str] = []
        scheduler = await _connect(server, SCHEDULER)
        gateway = await _connect(server, GATEWAY)
        engine = await _connect(server, PREFILL, errors)

        async def on(msg) -> None:
            got.append(msg.subject)

        for subject in (S.submit, S.engine_reports, S.task_failures):
            await scheduler.subscribe(subject, cb=on)
        await gateway.subscribe(S.tokens_wildcard("gw0"), cb=on)
        await scheduler.flush()
        await gateway.flush()
        await engine.publish(S.submit, b"a forged request")  # scheduler commands
        await engine.publish(S.prefill("p0e1"), b"x")
        await engine.publish(S.engine_report("p0e1"), b"another engine's report")
        await engine.publish(S.task_failed("p0e1"), b"another engine's failure")
        await engine.publish(S.engine_report("p0e0"), b"its own report")
        await engine.subscribe(S.tokens_wildcard("gw0"))  # someone else's token stream
        await engine.subscribe(f"{NS}.out.>")
        await engine.subscribe("_INBOX.>")  # everyone's replies
        await engine.subscribe(S.kv_log)
        await engine.flush()
        js_refused = False
        try:
            await engine.jetstream().stream_info(S.kv_index, timeout=1)
        except Exception:  # noqa: BLE001 - refused: the request never reaches JetStream
            js_refused = True
        await asyncio.sleep(0.3)
        for c in (scheduler, gateway, engine):
            await c.close()
        return errors, got, js_refused

    errors, got, js_refused = asyncio.run(go())
    assert got == [S.engine_report("p0e0")], got  # only its own report arrives anywhere
    assert js_refused
    for subject in (S.submit, S.prefill("p0e1"), S.engine_report("p0e1"), S.task_failed("p0e1")):
        assert any(f'publish to "{subject}"'.lower() in e.lower() for e in errors), (subject, errors)
    for subject in (S.tokens_wildcard("gw0"), f"{NS}.out.>", "_INBOX.>", S.kv_log):
        assert any(f'subscription to "{subject}"'.lower() in e.lower() for e in errors), (subject, errors)  # nats.py lowercases
    logged = server.violations()  # the server logs each refusal with the user
    assert len(logged) >= 8 and all("user:prefill-p0e0" in ln for ln in logged), logged


def test_services_still_talk_request_reply_and_jetstream_under_their_identities(server):
    """The permitted paths work: a gateway asks the scheduler (its reply comes back through the
    gateway's own inbox), kv-persistence writes and reads its stream, a gateway its bucket."""

    async def go():
        async with (
            Bus.open(server.url, "sched", **server.options(SCHEDULER)) as sched,
            Bus.open(server.url, "gw", **server.options(GATEWAY)) as gw,
        ):

            async def state(_req: m.StateRequest) -> m.StateReply:
                return m.StateReply(prefill_engines=3, decode_engines=0, nodes=1, queued=0, running=0, policy="dualpath")

            await sched.serve(S.sched_state, state, m.StateRequest)
            reply = await gw.request(S.sched_state, m.StateRequest(), m.StateReply, timeout=3)
            kv = await gw.nc.jetstream().create_key_value(bucket=S.responses)
            await kv.put("resp1", b"stored")
            stored = (await kv.get("resp1")).value
        kvp = await _connect(server, KVP)
        js = kvp.jetstream()
        await js.add_stream(name=S.kv_index, subjects=[S.kv_log])
        await js.publish(S.kv_log, msgpack.packb([1]))
        sub = await js.subscribe(S.kv_log, stream=S.kv_index, ordered_consumer=True)
        record = (await sub.next_msg(3)).data
        await kvp.close()
        return reply.prefill_engines, stored, record

    assert asyncio.run(go()) == (3, b"stored", msgpack.packb([1]))
    assert server.violations() == []


def test_a_forged_report_that_gets_past_the_server_is_dropped_by_the_subscriber(server):
    """Defence in depth: the report's own id must match the subject's (the operator may publish anywhere)."""

    async def go():
        seen: list[str] = []
        async with Bus.open(server.url, "sched", **server.options(SCHEDULER)) as sched:

            async def on_report(r: m.EngineReport) -> None:
                seen.append(r.engine_id)

            await sched.serve(S.engine_reports, on_report, m.EngineReport, sender=lambda r: r.engine_id)
            ops = await _connect(server, OPS)
            for subject_id, claimed in (("p0e0", "p0e1"), ("p0e0", "p0e0")):
                report = m.EngineReport(engine_id=claimed, role=0, node_id="p0", seq=0, tok=0, free_hbm_tokens=0, capacity_tokens=1)
                await ops.publish(S.engine_report(subject_id), encode(report))
            await ops.flush()
            await asyncio.sleep(0.3)
            await ops.close()
        return seen

    assert asyncio.run(go()) == ["p0e0"]


def test_mutual_tls_needs_a_client_certificate_of_the_authority(tmp_path):
    server = Server(tmp_path, tls=True)
    try:
        assert server.url.startswith("tls://")

        async def go():
            ok = await _connect(server, GATEWAY)
            await ok.publish(S.submit, b"")
            await ok.flush()
            await ok.close()
            import ssl

            no_cert = ssl.create_default_context(cafile=server.tls.ca_file)  # right CA, no client certificate
            with pytest.raises(Exception):  # noqa: B017, PT011 - the handshake fails (how nats.py reports it varies)
                await nats.connect(
                    server.url, allow_reconnect=False, connect_timeout=3, tls=no_cert, **server.auth.connect_options(GATEWAY)
                )

        asyncio.run(go())
        assert "TLS handshake error" in server.log.read_text()
    finally:
        server.stop()
