"""The gateway's tenancy wiring (``services.gateway.tenancy``): which keys a request presents,
the tenant they name, and the scheduler's view of a tenant's sessions."""

from __future__ import annotations

import pytest

from dualpath.config import GatewayConfig
from dualpath.tenant import KeyFileError
from services.gateway.tenancy import Tenancy, presented_keys, scoped_session


@pytest.mark.parametrize(
    ("headers", "keys"),
    [
        ({"authorization": "Bearer sk-a"}, ["sk-a"]),
        ({"authorization": "bearer  sk-a "}, ["sk-a"]),
        ({"authorization": "Basic c2stYQ=="}, []),
        ({"authorization": "Bearer"}, []),
        ({"x-api-key": "sk-b"}, ["sk-b"]),
        ({"authorization": "Bearer sk-a", "x-api-key": "sk-b"}, ["sk-a", "sk-b"]),
        ({}, []),
    ],
)
def test_a_request_presents_its_bearer_token_and_its_x_api_key(headers, keys):
    assert presented_keys(headers) == keys


def test_an_open_gateway_has_the_empty_tenant_and_a_keyed_one_refuses_strangers(tmp_path):
    assert Tenancy.from_config(GatewayConfig()).authenticate({}) == ""
    path = tmp_path / "keys"
    path.write_text("sk-a alice max_concurrency=3\n")
    tenancy = Tenancy.from_config(GatewayConfig(api_key="solo", api_key_file=str(path), tenant_tokens_per_minute=50))
    assert tenancy.secured
    assert tenancy.authenticate({"x-api-key": "sk-a"}) == "alice"
    assert tenancy.authenticate({"authorization": "Bearer solo"}) == "default"
    assert tenancy.authenticate({"authorization": "Bearer wrong", "x-api-key": "sk-a"}) == "alice"
    assert tenancy.authenticate({"authorization": "Bearer wrong"}) is None and tenancy.authenticate({}) is None
    assert tenancy.limiter.limits_of("alice").max_concurrency == 3 and tenancy.limiter.limits_of("alice").tokens_per_minute == 50


def test_a_bad_key_file_stops_the_gateway_naming_the_line(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-a alice\nsk-a alice\n")
    with pytest.raises(KeyFileError, match="line 2: duplicate key"):
        Tenancy.from_config(GatewayConfig(api_key_file=str(path)))


def test_sessions_are_scoped_by_tenant_and_untouched_without_one():
    assert scoped_session("alice", "s1") == "alice/s1" != scoped_session("bob", "s1")
    assert scoped_session("", "s1") == "s1" and scoped_session("alice", "") == ""
