"""End to end on a real stack: nats-server + gateway, scheduler, kv-persistence, traffic
managers and engines as separate processes, serving a tiny checkpoint made on disk."""

from __future__ import annotations

import httpx
import openai
import pytest

from conftest import start_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("serving")
    s = start_stack(tiny_model, base / "storage", base / "run")
    try:
        yield s
    finally:
        s.stop()


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_client_completes_without_streaming(stack, tiny_model):
    client = _client(stack)
    model = client.models.list().data[0].id
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello there"}],
                                         max_tokens=12, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.completion_tokens == len(out.choices[0].message.content.encode()) or out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens > 0
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # fresh storage


def test_openai_client_streams_the_same_tokens_as_a_plain_request(stack):
    client = _client(stack)
    model = client.models.list().data[0].id
    prompt = "stream me something"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert len(text) > 0
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert final and final[-1].model_extra["dualpath"]["decode_engine"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


def test_chat_stream_via_openai_client_yields_role_then_content(stack):
    client = _client(stack)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_models_and_health_endpoints(stack):
    assert httpx.get(stack.url + "/health").json()["status"] == "ok"
    models = httpx.get(stack.url + "/v1/models").json()
    assert models["data"][0]["object"] == "model"


def test_malformed_json_is_a_400(stack):
    r = httpx.post(stack.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]


def test_unknown_model_is_a_404(stack):
    r = httpx.post(stack.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404
    assert "nope" in r.json()["error"]["message"]


def test_missing_field_is_named(stack):
    r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "tiny"})
    assert r.status_code in (400, 422)
    assert "messages" in r.json()["error"]["message"]


def test_prompt_longer_than_context_is_a_400_that_says_so(stack):
    model = httpx.get(stack.url + "/v1/models").json()["data"][0]
    r = httpx.post(stack.url + "/v1/completions", json={"model": model["id"], "prompt": "a" * (model["max_model_len"] + 10)})
    assert r.status_code == 400
    assert "maximum context length" in r.json()["error"]["message"]
