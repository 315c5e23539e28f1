"""Tenants on a real stack (NATS + one process per service, tiny model) started with a key file:
each tenant's KV cache is its own (another tenant replaying its conversation never hits), a
``cache_salt`` partitions a tenant's cache further, an unknown key is refused everywhere but
``/health``, per-tenant limits answer 429 with Retry-After in each route's error shape,
``/metrics`` labels by tenant, and storage is the owner's alone (0600 files, 0700 directories).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import start_stack
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

KEY_FILE = """\
# KEY         TENANT  [limits]
sk-alice      alice
sk-alice-ci   alice
sk-bob        bob
sk-carol      carol
sk-dave       dave
sk-erin       erin
sk-one        one     max_concurrency=1
sk-tpm        tpm     tokens_per_minute=100
"""
BT = 64  # the stack's KV block tokens
# Agent turns long enough that every prompt spans several full blocks.
TURNS = [
    "Here is the repository layout and the failing test output, please look at it carefully. " * 3,
    "The tool returned: stack trace line 42 in scheduler.py, KeyError 'engine'. What should we try next?",
    "Running the fix produced new output: 3 passed, 1 failed in test_policy. Continue with the plan please.",
]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("tenants")
    keys = base / "keys"
    keys.write_text(KEY_FILE)
    keys.chmod(0o600)
    s = start_stack(tiny_model, base / "storage", base / "run", api_key_file=str(keys))
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def model(stack) -> str:
    return httpx.get(stack.url + "/v1/models", headers=auth("sk-alice"), timeout=30).json()["data"][0]["id"]


def chat(stack, model: str, key: str, messages: list[dict], **extra) -> dict:
    r = httpx.post(
        stack.url + "/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": 12, "temperature": 0, **extra},
        headers=auth(key),
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def converse(stack, model: str, key: str) -> tuple[list[list[dict]], list[int]]:
    """A greedy multi-turn conversation as ``key``'s tenant: the messages each turn sent, and the
    cached tokens each turn reported."""
    messages: list[dict] = [{"role": "system", "content": "You are a coding agent."}]
    sent, cached = [], []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        body = chat(stack, model, key, messages)
        sent.append(list(messages))
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"] or ""})
    return sent, cached


def replay(stack, model: str, key: str, sent: list[list[dict]], **extra) -> list[int]:
    """Send exactly the prompts of a recorded conversation again; the cached tokens of each turn."""
    return [chat(stack, model, key, messages, **extra)["usage"]["prompt_tokens_details"]["cached_tokens"] for messages in sent]


def metric(stack, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (read with a tenant's key)."""
    text = httpx.get(stack.url + "/metrics", headers=auth("sk-alice"), timeout=30).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    return sum(s.value for s in samples if labels.items() <= s.labels.items())


def test_another_tenant_replaying_a_conversation_never_hits_while_its_owners_replay_does(stack, model):
    sent, first = converse(stack, model, "sk-alice")
    assert first[0] == 0 and all(c > 0 for c in first[1:]), first  # alice's turns hit her earlier ones
    # Each turn's exact prompt sent by a tenant with no history of its own: no hit, on any turn,
    # though alice's blocks (and the earlier probers') hold every one of these prefixes.
    probes = [replay(stack, model, key, [messages])[0] for key, messages in zip(("sk-carol", "sk-dave", "sk-erin"), sent)]
    assert probes == [0] * len(TURNS), probes
    # Bob replays the whole conversation: he hits only what his own replay wrote (his earlier
    # turns), exactly what alice got on her first pass, never her blocks.
    bob = replay(stack, model, "sk-bob", sent)
    assert bob == first, (bob, first)
    # Alice's own replay, with her other key (the tenant, not the key, owns the cache), hits
    # every turn, the first one included: more than bob on each.
    again = replay(stack, model, "sk-alice-ci", sent)
    assert again[0] >= BT and all(a > b for a, b in zip(again, bob)), (again, bob)
    assert metric(stack, "dualpath_cached_tokens_total", tenant="alice") >= sum(first) + sum(again)
    assert metric(stack, "dualpath_cached_tokens_total", tenant="bob") == sum(bob)
    assert metric(stack, "dualpath_cached_tokens_total", tenant="carol") == 0
    assert metric(stack, "dualpath_prompt_tokens_total", tenant="carol") > 0
    assert metric(stack, "dualpath_requests_total", tenant="bob") >= len(TURNS)


def test_a_different_cache_salt_misses_and_the_same_salt_hits_on_every_generation_route(stack, model):
    prompt = "Summarise the tool output below for the next step of the agent. " * 6
    messages = [{"role": "user", "content": prompt}]

    def completion(salt: str) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "cache_salt": salt}
        r = httpx.post(stack.url + "/v1/completions", json=body, headers=auth("sk-alice"), timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def message(salt: str) -> int:
        body = {"model": model, "max_tokens": 4, "temperature": 0, "messages": messages, "cache_salt": salt}
        r = httpx.post(stack.url + "/v1/messages", json=body, headers={"x-api-key": "sk-alice"}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["cache_read_input_tokens"]

    def response(salt: str) -> int:
        body = {"model": model, "input": prompt, "max_output_tokens": 4, "temperature": 0, "store": False, "cache_salt": salt}
        r = httpx.post(stack.url + "/v1/responses", json=body, headers=auth("sk-alice"), timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens_details"]["cached_tokens"]

    def chat_cached(salt: str) -> int:
        return chat(stack, model, "sk-alice", messages, cache_salt=salt)["usage"]["prompt_tokens_details"]["cached_tokens"]

    for route, send in (("completions", completion), ("messages", message), ("responses", response), ("chat", chat_cached)):
        assert send(f"{route}-a") == 0, route  # a salt of its own: nothing of the others' (nor the unsalted prompt's)
        assert send(f"{route}-a") >= BT, route  # the same salt again: its own blocks hit
        assert send(f"{route}-b") == 0, route  # the same tenant and prompt, another salt: a miss
    assert chat(stack, model, "sk-alice", messages)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # unsalted: no salted block
    r = httpx.post(
        stack.url + "/v1/chat/completions", json={"model": model, "messages": messages, "cache_salt": ""}, headers=auth("sk-alice")
    )
    assert r.status_code == 422 and r.json()["error"]["param"] == "cache_salt"  # as vLLM: a salt, if given, is not empty


def test_the_blocks_generated_after_a_prompt_shorter_than_a_block_are_its_tenants_own(stack, model):
    """Such a chain starts in the decode engine, from the root that travelled with the request:
    the tenant's next turn hits the answer's blocks, another tenant's does not."""
    messages = [{"role": "user", "content": "Hi there."}]
    body = chat(stack, model, "sk-alice", messages, max_tokens=3 * BT, ignore_eos=True)
    assert body["usage"]["prompt_tokens"] < BT  # no full block of prompt: the answer's blocks carry the chain
    messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]}, {"role": "user", "content": "Go on."}]
    assert chat(stack, model, "sk-bob", messages)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert chat(stack, model, "sk-alice", messages)["usage"]["prompt_tokens_details"]["cached_tokens"] >= BT


ROUTES = [
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/resp_1"),
    ("DELETE", "/v1/responses/resp_1"),
    ("GET", "/v1/responses/resp_1/input_items"),
    ("GET", "/no/such/route"),
]


def test_an_unknown_or_missing_key_is_refused_on_every_route_but_health(stack):
    assert httpx.get(stack.url + "/health", timeout=30).status_code == 200
    for headers in ({}, auth("sk-nobody"), {"x-api-key": "sk-nobody"}, auth("sk-alic"), {"Authorization": "sk-alice"}):
        for method, path in ROUTES:
            r = httpx.request(method, stack.url + path, json={}, headers=headers, timeout=30)
            assert r.status_code == 401, (headers, method, path, r.status_code)
            error = r.json()["error"]
            assert error["type"] == "authentication_error" and error["message"] == "invalid or missing API key"
    for headers in (auth("sk-bob"), {"x-api-key": "sk-bob"}, {"Authorization": "bearer sk-bob"}):
        assert httpx.get(stack.url + "/v1/models", headers=headers, timeout=30).status_code == 200


def test_a_stored_response_is_found_only_by_its_tenant(stack, model):
    body = {"model": model, "input": "Remember this answer for later.", "max_output_tokens": 4, "temperature": 0}
    r = httpx.post(stack.url + "/v1/responses", json=body, headers=auth("sk-alice"), timeout=120)
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    url = f"{stack.url}/v1/responses/{rid}"
    assert httpx.get(url, headers=auth("sk-bob"), timeout=30).status_code == 404
    assert httpx.get(url + "/input_items", headers=auth("sk-bob"), timeout=30).status_code == 404
    follow = {**body, "previous_response_id": rid}
    assert httpx.post(stack.url + "/v1/responses", json=follow, headers=auth("sk-bob"), timeout=60).status_code == 404
    assert httpx.delete(url, headers=auth("sk-bob"), timeout=30).status_code == 404
    assert httpx.get(url, headers=auth("sk-alice-ci"), timeout=30).json()["id"] == rid  # still there, for its tenant


def test_a_tenant_at_its_concurrency_gets_429_with_retry_after_until_its_request_ends(stack, model):
    body = {"model": model, "prompt": "Count slowly.", "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", stack.url + "/v1/completions", json=body, headers=auth("sk-one")) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # held open: a dropped iterator would close the connection
            next(lines)  # its answer is under way: the tenant's one request is in flight
            second = client.post(stack.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2}, headers=auth("sk-one"))
            assert second.status_code == 429 and second.headers["retry-after"] == "1"
            error = second.json()["error"]
            assert error["type"] == "rate_limit_exceeded" and "max_concurrency" in error["message"] and error["code"] == 429
            anthropic = client.post(
                stack.url + "/v1/messages",
                json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                headers={"x-api-key": "sk-one"},
            )
            assert anthropic.status_code == 429 and anthropic.headers["retry-after"] == "1"
            assert anthropic.json()["type"] == "error" and anthropic.json()["error"]["type"] == "rate_limit_error"
            others = client.post(stack.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2}, headers=auth("sk-bob"))
            assert others.status_code == 200  # another tenant's limit is its own
            assert next(line for line in lines if line).startswith("data: ")  # the first answer is still streaming
        deadline = time.monotonic() + 30  # the stream is closed: the gateway ends the request and its lease
        while True:
            again = client.post(stack.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2}, headers=auth("sk-one"))
            if again.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert again.status_code == 200, again.text
    assert metric(stack, "dualpath_rate_limited_total", tenant="one", limit="max_concurrency") >= 2


def test_a_tenant_over_its_tokens_per_minute_gets_429_in_each_routes_error_shape(stack, model):
    long = "Read the whole log file and report every failing test by name. " * 12  # more than the tenant's 100 tokens
    r = httpx.post(
        stack.url + "/v1/completions", json={"model": model, "prompt": long, "max_tokens": 4}, headers=auth("sk-tpm"), timeout=120
    )
    assert r.status_code == 200, r.text  # a full bucket admits a prompt larger than the budget; the debt follows
    assert r.json()["usage"]["prompt_tokens"] > 100
    short = [{"role": "user", "content": "hi"}]
    for path, body, shape in (
        ("/v1/chat/completions", {"model": model, "messages": short, "max_tokens": 2}, "openai"),
        ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2}, "openai"),
        ("/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 2}, "openai"),
        ("/v1/messages", {"model": model, "messages": short, "max_tokens": 2}, "anthropic"),
    ):
        refused = httpx.post(stack.url + path, json=body, headers=auth("sk-tpm"), timeout=60)
        assert refused.status_code == 429, (path, refused.text)
        assert int(refused.headers["retry-after"]) >= 5, path  # the debt refills at 100 tokens a minute
        if shape == "anthropic":
            assert refused.json()["error"]["type"] == "rate_limit_error"
        else:
            assert refused.json()["error"]["type"] == "rate_limit_exceeded" and "tokens_per_minute" in refused.json()["error"]["message"]
    assert metric(stack, "dualpath_rate_limited_total", tenant="tpm", limit="tokens_per_minute") >= 4


def test_block_files_are_0600_under_0700_directories_named_by_hashes_only(stack, model):
    chat(stack, model, "sk-bob", [{"role": "user", "content": "Persist this long prompt, block by block. " * 8}])
    storage = Path(stack.cfg.storage)
    assert storage.stat().st_mode & 0o777 == 0o700
    blocks = dirs = 0
    for root, subdirs, files in os.walk(storage):
        for d in subdirs:
            assert (Path(root) / d).stat().st_mode & 0o777 == 0o700, (root, d)
            dirs += 1
        for f in files:
            assert (Path(root) / f).stat().st_mode & 0o777 == 0o600, (root, f)
            blocks += f.endswith(".kvb")
        for name in (*subdirs, *files):
            assert not any(t in name for t in ("alice", "bob", "carol", "one", "tpm")), name  # paths are hashes only
    assert blocks > 0 and dirs > 0
    assert (storage / "index.log").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("sk-a alice\nsk-b\n", 2, "found one field"),
        ("# keys\nsk-a alice\nsk-a bob\n", 3, "duplicate key (already on line 2)"),
        ("sk-a alice max_concurrency=lots\n", 1, "max_concurrency must be a whole number"),
    ],
)
def test_a_malformed_key_file_stops_dualpath_up_and_the_gateway_naming_the_line(tmp_path, tiny_model, text, line, words):
    keys = tmp_path / "keys"
    keys.write_text(text)
    up = subprocess.run(
        [
            sys.executable,
            "-m",
            "dualpath.cli",
            "up",
            "--api-key-file",
            str(keys),
            "--run-dir",
            str(tmp_path / "run"),
            "--model",
            str(tiny_model),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert up.returncode == 2 and f"API key file {keys}, line {line}: " in up.stderr and words in up.stderr, up.stderr
    assert not (tmp_path / "run" / "logs").exists()  # refused before anything started
    gateway = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.gateway",
            "--model",
            str(tiny_model),
            "--api-key-file",
            str(keys),
            "--nats-url",
            "nats://127.0.0.1:1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    said = gateway.stdout + gateway.stderr
    assert gateway.returncode == 1 and f"API key file {keys}, line {line}: " in said and words in said, said
