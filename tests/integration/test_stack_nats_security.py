"""A whole stack on a locked-down NATS (``dualpath up --nats-tls``): every service connects as its
own identity over mutual TLS, two turns of a conversation are answered (the second from
storage), no service was refused anything, and hostile clients on the same host get nothing."""

from __future__ import annotations

import asyncio
import ssl

import nats
import pytest
from conftest import openai_client, start_stack

from dualpath.protocol.subjects import Role, Subjects

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("nats-tls")
    s = start_stack(tiny_model, base / "storage", base / "run", nats_tls=True)
    try:
        yield s
    finally:
        s.stop()


def test_every_service_runs_as_its_own_identity_over_mutual_tls(stack):
    assert stack.nats_url.startswith("tls://")
    client = openai_client(stack.url, 60)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "tell me about the two paths " * 12}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "and then?"}]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # turn 1's KV came back from storage
    stack.check_alive()
    assert stack.nats_violations() == []
    logs = {p.stem: p.read_text() for p in stack.logs.glob("*.log")}
    users = {f"{identity.user}" for identity in stack.identities().values()}
    nats_log = "".join(v for k, v in logs.items() if k.startswith("nats-"))
    assert "TLS" in nats_log
    assert users  # the identities the launcher made are the ones its children were given
    assert all(name in stack.identities() for name in ("gateway", "scheduler", "kv-persistence"))


def test_clients_without_a_certificate_or_a_password_get_nothing(stack):
    host_url = stack.nats_url.split(",")[0]
    good = stack.nats_options(Role.OBSERVER)

    async def go() -> list[str]:
        refused = []
        attempts = [
            {},  # nothing at all: the TLS handshake needs a client certificate
            {"tls": ssl.create_default_context(cafile=stack.tls.ca_file)},  # no certificate
            {"tls": good["tls"]},  # a certificate, no password
            {"tls": good["tls"], "user": good["user"], "password": "guess"},
        ]
        for options in attempts:
            try:
                nc = await nats.connect(host_url, allow_reconnect=False, connect_timeout=3, **options)
            except Exception as exc:  # noqa: BLE001 - how each refusal surfaces differs
                refused.append(type(exc).__name__)
                continue
            await nc.close()
        return refused

    assert len(asyncio.run(go())) == 4


def test_the_observer_reads_reports_but_cannot_submit_or_read_token_streams(stack):
    s = Subjects(stack.namespace)

    async def go():
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc).lower())

        nc = await nats.connect(stack.nats_url.split(","), error_cb=on_error, **stack.nats_options(Role.OBSERVER))
        reports = await nc.subscribe(s.engine_reports)
        report = await reports.next_msg(timeout=10)  # engines report every few hundred ms
        await nc.publish(s.submit, b"x")
        await nc.subscribe(s.tokens_wildcard("gw0"))
        await nc.flush()
        await asyncio.sleep(0.2)
        await nc.close()
        return report.subject, errors

    stack.violations_expected = True  # this test provokes them
    subject, errors = asyncio.run(go())
    assert subject.startswith(f"{stack.namespace}.sched.engine_report.")
    assert any("publish to" in e and "sched.submit" in e for e in errors), errors
    assert any("subscription to" in e and ".out.gw0" in e for e in errors), errors
