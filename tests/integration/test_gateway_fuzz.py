"""Hostile input at the gateway: schemathesis, driven by the gateway's own OpenAPI document
(``/openapi.json``: the OpenAI routes, Anthropic's ``/v1/messages`` with its own error shape, and
the Responses routes), fuzzes a real stack (NATS + one process per service, tiny model) with an
API key set, running every schemathesis check.

The document pins each request's ``model`` to the served model, so generated bodies pass the
model check and reach prefill and decode (long and odd prompts, stop lists, extreme max_tokens,
logprobs, streaming); negative cases (wrong types, wrong model, missing fields, bad methods,
no key) must be refused with a declared 4xx. No service may die (the supervisor records no
exit) and the stack must still serve afterwards.

One check is configured: ``positive_data_acceptance`` also accepts 400 for schema-valid bodies,
because some rules span fields and cannot be written in JSON Schema (prompt tokens plus
max_tokens within the context window, a tool result answering an earlier call, a tool or
response_format schema that compiles); OpenAI answers these with 400 too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import start_stack

pytestmark = pytest.mark.slow

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_EXAMPLES = int(os.environ.get("DUALPATH_FUZZ_EXAMPLES", "10"))  # per operation in the fuzzing phase
CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "401", "403", "404", "409", "429", "5xx"]
"""


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    s = start_stack(tiny_model, base / "storage", base / "run", api_key=KEY)
    try:
        yield s
    finally:
        s.stop()


def _st() -> list[str]:
    exe = Path(sys.executable).with_name("st")
    return [str(exe)] if exe.exists() else [shutil.which("st") or "st"]


def test_every_route_but_health_refuses_a_request_without_the_key(stack):
    assert httpx.get(stack.url + "/health", timeout=30).status_code == 200
    for method, path in [
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/messages"),  # Anthropic's error shape: {"type": "error", "error": {"type": ...}}
        ("POST", "/v1/messages/count_tokens"),
        ("POST", "/v1/responses"),
        ("GET", "/v1/responses/resp_1"),
        ("DELETE", "/v1/responses/resp_1"),
        ("GET", "/no/such/route"),
    ]:
        r = httpx.request(method, stack.url + path, json={}, timeout=30)
        assert r.status_code == 401, (method, path, r.status_code)
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(stack.url + "/metrics", headers=AUTH, timeout=30).status_code == 200


def test_the_openapi_document_pins_the_model_and_declares_the_error_answers(stack):
    doc = httpx.get(stack.url + "/openapi.json", headers=AUTH, timeout=30).json()
    served = httpx.get(stack.url + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "MessagesRequest", "CountTokensRequest", "ResponsesRequest"):
        assert doc["components"]["schemas"][name]["properties"]["model"]["enum"] == [served]
    post = doc["paths"]["/v1/completions"]["post"]
    assert {"400", "401", "404", "422", "429", "503"} <= set(post["responses"])
    assert "text/event-stream" in post["responses"]["200"]["content"]
    assert post["security"] == [{"bearer": []}] and "security" not in doc["paths"]["/health"]["get"]
    assert {"400", "401", "404"} <= set(doc["paths"]["/v1/messages"]["post"]["responses"])
    r = httpx.put(stack.url + "/v1/models", headers=AUTH, timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "GET"
    r = httpx.put(stack.url + "/v1/responses/resp_1", headers=AUTH, timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET"  # every method of the path, not the first route's


def _served_requests(stack) -> int:
    page = httpx.get(stack.url + "/metrics", headers=AUTH, timeout=30).text
    return int(float(next(line.split()[1] for line in page.splitlines() if line.startswith("dualpath_ttft_seconds_count"))))


def test_schemathesis_runs_every_check_against_the_live_stack_and_none_fails(stack, tmp_path):
    (tmp_path / "schemathesis.toml").write_text(CONFIG)
    served_before = _served_requests(stack)
    cmd = [
        *_st(),
        "--config-file",
        str(tmp_path / "schemathesis.toml"),
        "run",
        stack.url + "/openapi.json",
        "--checks",
        "all",
        "--mode",
        "all",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        "15",
        "--workers",
        "1",  # CPython 3.11.7's ast.parse is not thread-safe under hypothesis' lambda descriptions
        "--request-timeout",
        "60",
        "--max-response-time",
        "60",
        "--header",
        f"Authorization: Bearer {KEY}",
        "--output-truncate",
        "false",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env={**os.environ, "NO_COLOR": "1"})
    out = proc.stdout + proc.stderr
    print(out)
    assert proc.returncode == 0, out[-6000:]
    counts = re.search(r"(\d+) generated, (\d+) passed", out)
    assert counts and counts[1] == counts[2], out[-3000:]  # every generated case passed every check
    assert stack.events == [], stack.events  # no service died (and was restarted) under the fuzzing
    assert _served_requests(stack) - served_before >= 20  # generated requests reached prefill and decode
    # the stack still serves after the fuzzing: a plain greedy completion goes through
    model = httpx.get(stack.url + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"]
    r = httpx.post(
        stack.url + "/v1/completions", headers=AUTH, json={"model": model, "prompt": "still there?", "max_tokens": 4}, timeout=60
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(stack.url + "/health", timeout=30).json()["status"] == "ok"
