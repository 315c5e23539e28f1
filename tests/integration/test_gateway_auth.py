"""The gateway's API key (off by default): /v1/* needs 'Authorization: Bearer KEY' when set."""

from __future__ import annotations

from fastapi.testclient import TestClient

from dualpath.config import BusConfig, GatewayConfig, ModelConfigSpec
from services.gateway.app import build_app
from services.gateway.core import Gateway


def test_api_key_is_required_on_v1_routes_when_configured(nats_server, tiny_model):
    gw = Gateway(GatewayConfig(api_key="s3cret"), BusConfig(nats_url=nats_server.url), ModelConfigSpec(model=str(tiny_model)))
    with TestClient(build_app(gw)) as client:
        denied = client.get("/v1/models")
        assert denied.status_code == 401
        assert denied.json()["error"]["type"] == "authentication_error"
        assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == tiny_model.resolve().name
        assert client.get("/health").status_code == 503  # open route; no engines on this bare bus


def test_without_a_key_the_api_is_open(nats_server, tiny_model):
    gw = Gateway(GatewayConfig(), BusConfig(nats_url=nats_server.url), ModelConfigSpec(model=str(tiny_model)))
    with TestClient(build_app(gw)) as client:
        assert client.get("/v1/models").status_code == 200


def test_anthropic_clients_authenticate_with_x_api_key_and_get_anthropics_error_shape(nats_server, tiny_model):
    gw = Gateway(GatewayConfig(api_key="s3cret"), BusConfig(nats_url=nats_server.url), ModelConfigSpec(model=str(tiny_model)))
    body = {"model": "other", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(build_app(gw)) as client:
        denied = client.post("/v1/messages", json=body, headers={"x-api-key": "wrong", "anthropic-version": "2023-06-01"})
        assert denied.status_code == 401
        assert denied.json() == {"type": "error", "error": {"type": "authentication_error", "message": "invalid or missing API key"}}
        for headers in ({"x-api-key": "s3cret"}, {"Authorization": "Bearer s3cret"}):
            past = client.post("/v1/messages", json=body, headers={**headers, "anthropic-version": "2023-06-01"})
            assert past.status_code == 404 and past.json()["error"]["type"] == "not_found_error"  # past the key: the model is unknown
        assert client.get("/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200
