"""The protocols agents speak, through their official SDKs, against a real stack: Anthropic's
Messages API (``anthropic``) and OpenAI's Responses API (``openai``), streaming and not, tool
round trips, structured output, stored conversations shared by two gateway replicas (one of
them restarted), the sessions the scheduler sees, and reasoning output on a gateway run with
``--reasoning-parser deepseek_r1``.

The tiny random model never writes a tool call or ``</think>`` by itself: tool calls are forced
(``tool_choice``: a grammar), and on the reasoning gateway the whole answer is reasoning (R1
answers start inside the reasoning), which is what shows where it goes in each protocol."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import SubmitTap, anthropic_client, openai_client, prefetch_counters, start_stack

from dualpath.bus.auth import Identity
from dualpath.bus.embedded import free_port
from dualpath.protocol.subjects import Role

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

QWEN_TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "chat_templates" / "qwen2.5-instruct.jinja"
MODEL = "tiny-qwen-template"
REPLICA = Identity(Role.GATEWAY, "gw-replica")  # the second gateway's NATS identity
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]},
}
SYSTEM = "You are a coding agent. Use the tools you are given. " * 8


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("protocols")
    model = base / MODEL
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN_TEMPLATE.read_text(encoding="utf-8")
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    # agent-aware prefetch on; a second gateway (a replica) joins with an identity of its own
    s = start_stack(model, base / "storage", base / "run", prefetch_mb=16, extra_identities=(REPLICA,))
    s.model_dir = model
    try:
        yield s
    finally:
        s.stop()


class Gateway:
    """A second gateway process on the stack's NATS (a replica), with its own flags."""

    def __init__(self, stack, log: Path, *flags: str) -> None:
        self.port, self.log, self.stack = free_port(), log, stack
        self.cmd = [sys.executable, "-m", "services.gateway", "--model", str(stack.model_dir), "--nats-url", stack.nats_url]
        self.cmd += ["--namespace", stack.namespace, "--port", str(self.port), "--gateway-id", "gw-replica", *flags]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Gateway:
        with self.log.open("a") as out:
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.stack.nats_env(REPLICA)}
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(self.log.read_text()[-3000:])

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
            self.proc = None


@pytest.fixture(scope="module")
def replica(stack, tmp_path_factory):
    gw = Gateway(stack, tmp_path_factory.mktemp("replica") / "gateway.log", "--reasoning-parser", "deepseek_r1").start()
    try:
        yield gw
    finally:
        gw.stop()


# ---- Anthropic Messages ----------------------------------------------------------------------------
def test_anthropic_sdk_second_turn_reads_the_first_turns_kv_as_cache_read_tokens(stack):
    client = anthropic_client(stack.url)
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": "Read main.py and list its functions."}]}]
    first = client.messages.create(model=MODEL, max_tokens=8, system=system, messages=messages, extra_body={"temperature": 0})
    assert first.type == "message" and first.role == "assistant" and first.stop_reason == "max_tokens"
    assert [b.type for b in first.content] == ["text"] and len(first.content[0].text) == 8
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=messages).input_tokens
    u = first.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == counted and u.output_tokens == 8
    assert u.cache_creation_input_tokens > 0  # the prompt's full blocks are persisted by this turn

    messages += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "Now the tests, please."}]
    with client.messages.stream(model=MODEL, max_tokens=8, system=system, messages=messages, extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
        second = stream.get_final_message()
    assert second.content[0].text == streamed and len(streamed) == 8
    prompt = second.usage.input_tokens + second.usage.cache_read_input_tokens + second.usage.cache_creation_input_tokens
    assert prompt == client.messages.count_tokens(model=MODEL, system=system, messages=messages).input_tokens
    assert second.usage.cache_read_input_tokens >= u.cache_creation_input_tokens  # the whole first prompt's blocks are hits
    assert second.usage.cache_read_input_tokens >= 0.7 * prompt


def test_anthropic_sdk_tool_use_round_trip_streamed_and_not(stack):
    client = anthropic_client(stack.url)
    messages: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = client.messages.create(
        model=MODEL, max_tokens=120, messages=messages, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}
    )
    assert forced.stop_reason == "tool_use"
    (call,) = [b for b in forced.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "Oslo") and call.id.startswith("toolu_")

    with client.messages.stream(
        model=MODEL, max_tokens=120, messages=messages, tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True}
    ) as stream:
        kinds = [ev.type for ev in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "input_json" in kinds
    assert streamed.stop_reason == "tool_use" and [b.type for b in streamed.content] == ["tool_use"]
    assert streamed.content[0].input["city"] in ("Paris", "Oslo")

    messages += [
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Checking."}, *[b.model_dump() for b in forced.content if b.type == "tool_use"]],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "21C, clear"}], "is_error": False},
                {"type": "text", "text": "Thanks, summarise."},
            ],
        },
    ]
    answer = client.messages.create(model=MODEL, max_tokens=6, messages=messages, tools=[WEATHER], stop_sequences=["\x00never"])
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"


def test_anthropic_stop_sequence_ends_the_answer_and_is_named(stack):
    client = anthropic_client(stack.url)
    ask = {"model": MODEL, "max_tokens": 12, "messages": [{"role": "user", "content": "Count."}], "extra_body": {"temperature": 0}}
    text = client.messages.create(**ask).content[0].text
    stop = next(text[i : i + 2] for i in range(3, 10) if text.find(text[i : i + 2]) == i)  # first seen at i
    cut = client.messages.create(**ask, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop and cut.content[0].text == text[: text.find(stop)]
    with client.messages.stream(**ask, stop_sequences=[stop]) as s:
        assert "".join(s.text_stream) == cut.content[0].text and s.get_final_message().stop_reason == "stop_sequence"


def test_anthropic_errors_use_anthropics_shape_and_status(stack):
    client = anthropic_client(stack.url)
    with pytest.raises(anthropic.NotFoundError) as nf:
        client.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert nf.value.body["type"] == "error" and nf.value.body["error"]["type"] == "not_found_error"
    url = stack.url + "/v1/messages"
    cases = [
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),  # required
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "web_search_20250305", "name": "w"}],
            },
            "server tools",
        ),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.5}, "temperature"),
        (
            {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "tool"}},
            "tool_choice",
        ),
    ]
    for body, says in cases:
        r = httpx.post(url, json=body, headers={"anthropic-version": "2023-06-01"}, timeout=30)
        assert r.status_code == 400, (body, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error" and says in err["error"]["message"], err
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_metadata_user_id_is_the_session_the_scheduler_sees(stack):
    client = anthropic_client(stack.url)
    with SubmitTap(stack) as tap:
        r = client.messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}], metadata={"user_id": "agent-42"}
        )
    assert tap.sessions[r.id] == "agent-42"


def test_sessions_from_the_protocols_are_prefetched_between_turns_without_a_session_header(stack):
    """A Messages conversation with ``metadata.user_id`` and a Responses chain: when a turn ends,
    the scheduler hints the session's blocks to the prefill node; one without a session gets none."""
    client, responses = anthropic_client(stack.url), openai_client(stack.url)

    def two_turns(text: str, **session) -> None:
        messages: list[dict] = [{"role": "user", "content": text * 8}]
        first = client.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, messages=messages, **session)
        time.sleep(1.5)  # the tool runs
        messages += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "Tool result: 3 failed."}]
        assert client.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, messages=messages, **session).usage.cache_read_input_tokens

    with SubmitTap(stack) as tap:
        two_turns("No session here. ")
        none = list(tap.prefetched)
        two_turns("Read the failing test and explain it. ", metadata={"user_id": "agent-pf"})
        turn = responses.responses.create(model=MODEL, instructions=SYSTEM, input="Explain the stack trace. " * 8, max_output_tokens=8)
        time.sleep(1.5)
        later = responses.responses.create(
            model=MODEL, instructions=SYSTEM, input="Tool result: fixed.", previous_response_id=turn.id, max_output_tokens=8
        )
    assert none == [] and tap.prefetched.count("agent-pf") == 2 and tap.prefetched.count(turn.id) == 2, tap.prefetched
    assert later.usage.input_tokens_details.cached_tokens > 0
    used = sum(c.get("prefetch_used_bytes", 0) for c in prefetch_counters(stack).values())
    assert used > 0  # later turns loaded blocks from the prefetch cache


# ---- OpenAI Responses ------------------------------------------------------------------------------
def test_responses_previous_response_id_continues_a_stored_conversation_from_the_cache(stack):
    client = openai_client(stack.url)
    with SubmitTap(stack) as tap:
        first = client.responses.create(model=MODEL, instructions=SYSTEM, input="List the files.", max_output_tokens=8, temperature=0)
        second = client.responses.create(
            model=MODEL, instructions=SYSTEM, input="Open the first one.", previous_response_id=first.id, max_output_tokens=8, temperature=0
        )
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens" and len(first.output_text) == 8
    assert second.usage.input_tokens > first.usage.input_tokens + 8  # the first turn is in the second's prompt
    assert second.usage.input_tokens_details.cached_tokens >= 0.7 * second.usage.input_tokens
    assert tap.sessions[first.id] == tap.sessions[second.id] == first.id  # one conversation, one session

    assert client.responses.retrieve(second.id).output_text == second.output_text
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [i.type for i in items] == ["message", "message", "message"]  # turn 1's input and answer, turn 2's input
    assert items[1].content[0].text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="more", previous_response_id=second.id, max_output_tokens=2)  # its chain is gone


def test_responses_stream_emits_the_semantic_events_and_stores_the_result(stack):
    client = openai_client(stack.url)
    events = list(client.responses.create(model=MODEL, input="Say something.", max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.incomplete" and "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_responses_function_call_round_trip_and_json_schema_output(stack):
    client = openai_client(stack.url)
    tools = [{"type": "function", "name": "get_weather", "description": "The weather.", "parameters": WEATHER["input_schema"]}]
    hosted = [{"type": "web_search"}]  # sent by Codex; not run here, left out of the prompt
    call = client.responses.create(
        model=MODEL, input="Weather in Oslo?", tools=tools + hosted, tool_choice="required", max_output_tokens=120
    )
    (fc,) = [o for o in call.output if o.type == "function_call"]
    assert fc.name == "get_weather" and json.loads(fc.arguments)["city"] in ("Paris", "Oslo")

    events = list(
        client.responses.create(
            model=MODEL,
            input="Weather in Paris?",
            tools=tools,
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=120,
            stream=True,
            store=False,
        )
    )
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert done[-1].type == "function_call" and json.loads(args) == json.loads(done[-1].arguments)
    assert events[-1].type == "response.completed"

    back = client.responses.create(
        model=MODEL,
        previous_response_id=call.id,
        input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "12C, rain"}],
        tools=tools,
        max_output_tokens=4,
    )
    assert back.output[0].type == "message" and back.usage.input_tokens_details.cached_tokens > 0

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    structured = client.responses.create(
        model=MODEL,
        input="Answer in JSON.",
        text={"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}},
        max_output_tokens=30,
    )
    assert isinstance(json.loads(structured.output_text)["ok"], bool)


def test_responses_errors_name_the_field(stack):
    client = openai_client(stack.url)
    with pytest.raises(openai.BadRequestError, match="input_image"):
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model=MODEL, input="hi", background=True)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_nothere")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("../etc")


# ---- replicas, restart, reasoning ---------------------------------------------------------------------
def test_a_stored_response_is_read_by_another_gateway_replica_and_survives_its_restart(stack, replica):
    first = openai_client(stack.url).responses.create(model=MODEL, input="Remember this.", max_output_tokens=4)
    assert openai_client(replica.url).responses.retrieve(first.id).output_text == first.output_text
    replica.stop()
    replica.start()
    later = openai_client(replica.url).responses.create(model=MODEL, input="And now?", previous_response_id=first.id, max_output_tokens=4)
    assert later.usage.input_tokens_details.cached_tokens > 0
    assert openai_client(stack.url).responses.retrieve(later.id).previous_response_id == first.id


def test_reasoning_parser_moves_an_r1_answer_into_reasoning_in_every_protocol(replica):
    chat = openai_client(replica.url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Think."}], max_tokens=8, temperature=0
    )
    message = chat.choices[0].message
    assert len(message.model_extra["reasoning_content"]) == 8 and not message.content  # never closed: all reasoning

    chunks = list(
        openai_client(replica.url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Think."}], max_tokens=8, stream=True, temperature=0
        )
    )
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices)
    assert streamed == message.model_extra["reasoning_content"]

    msg = anthropic_client(replica.url).messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Think."}], extra_body={"temperature": 0}
    )
    assert [b.type for b in msg.content] == ["thinking"] and msg.content[0].thinking == streamed  # no text after it
    with anthropic_client(replica.url).messages.stream(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Think."}], extra_body={"temperature": 0}
    ) as s:
        thinking = "".join(ev.delta.thinking for ev in s if ev.type == "content_block_delta" and ev.delta.type == "thinking_delta")
    assert thinking == streamed

    resp = openai_client(replica.url).responses.create(model=MODEL, input="Think.", max_output_tokens=8, temperature=0)
    assert resp.output[0].type == "reasoning" and resp.output[0].content[0].text == streamed
    assert resp.usage.output_tokens_details.reasoning_tokens == 8
