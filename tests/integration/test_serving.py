"""End to end on a real stack: nats-server + gateway, scheduler, kv-persistence, traffic
managers and engines as separate processes, serving a tiny checkpoint made on disk."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import openai_client, start_stack

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
    return openai_client(stack.url, 60)


def test_openai_client_completes_without_streaming(stack, tiny_model):
    client = _client(stack)
    model = client.models.list().data[0].id
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello there"}], max_tokens=12, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.completion_tokens == len(out.choices[0].message.content.encode()) or out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens > 0
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # fresh storage


def test_openai_client_streams_the_same_tokens_as_a_plain_request(stack):
    client = _client(stack)
    model = client.models.list().data[0].id
    prompt = "stream me something"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
    chunks = list(
        client.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert len(text) > 0
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert final and final[-1].model_extra["dualpath"]["decode_engine"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


def test_chat_stream_via_openai_client_yields_role_then_content(stack):
    client = _client(stack)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, stream=True
    )
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


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add two small numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["a", "b"],
            },
        },
    },
]


def test_forced_tool_call_comes_back_as_tool_calls_streamed_or_not(stack):
    """The random tiny model never writes a call by itself; tool_choice=required makes it (a grammar)."""
    client = _client(stack)
    model = client.models.list().data[0].id
    ask = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 120,
        "temperature": 0,
    }
    out = client.chat.completions.create(**ask)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name in ("get_weather", "add") and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == ({"city"} if call.function.name == "get_weather" else {"a", "b"})
    chunks = list(client.chat.completions.create(**ask, stream=True, logprobs=True, stream_options={"include_usage": True}))
    streamed_logprobs = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert len(streamed_logprobs) == chunks[-1].usage.completion_tokens, "every token's logprob is streamed, calls or not"
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].index == 0 and deltas[0].id and deltas[0].function.name == call.function.name
    assert {d.index for d in deltas} == {0} and len(deltas) > 2, "the arguments arrive in pieces, as OpenAI streams them"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    named = client.chat.completions.create(**{**ask, "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert named.choices[0].message.tool_calls[0].function.name == "add"


def test_response_format_json_schema_gives_a_valid_object(stack):
    client = _client(stack)
    model = client.models.list().data[0].id
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 5}},
        "required": ["answer", "score"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Is it sunny?"}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}},
    )
    value = json.loads(out.choices[0].message.content)
    assert value["answer"] in ("yes", "no") and 0 <= value["score"] <= 5
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "bogus"}}}},
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "nope", "content": "1"}]},
            "messages[1].tool_call_id",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format.json_schema.schema",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ],
)
def test_bad_tools_and_schemas_are_400s_naming_the_field(stack, body, param):
    model = httpx.get(stack.url + "/v1/models").json()["data"][0]["id"]
    r = httpx.post(stack.url + "/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param and param.split("[")[0].split(".")[0] in r.json()["error"]["message"]


def test_metrics_on_the_api_port_show_latency_histograms_cache_ratio_read_paths_and_queue(stack):
    client = _client(stack)
    model = client.models.list().data[0].id
    client.completions.create(model=model, prompt="count the metrics", max_tokens=4, temperature=0)
    r = httpx.get(stack.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for needle in (
        'dualpath_ttft_seconds_bucket{le="+Inf"}',
        "dualpath_tpot_seconds_count",
        "dualpath_cached_token_ratio",
        "dualpath_requests_total{read_path=",
        "dualpath_queue_length 0",
        "dualpath_scheduler_up 1",
        'dualpath_engines{role="decode"} 1',
    ):
        assert needle in text, needle
    count = next(line for line in text.splitlines() if line.startswith("dualpath_ttft_seconds_count"))
    assert int(count.split()[-1]) >= 1


def test_structured_output_is_served_exactly_as_local_greedy_decoding_under_the_same_grammar(stack, tiny_model):
    """Prefill samples the first token under the grammar, decode replays it and masks the rest: the
    served answer equals one process decoding greedily under the same grammar."""
    import torch

    from dualpath.chat.plan import plan_chat
    from dualpath.chat.tools import FORMATS
    from dualpath.model import Decoder, SamplingParams, Tokenizer, sample
    from dualpath.model.sampling import grammar_constraint
    from dualpath.structured.grammar import vocabulary

    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["city", "n"],
    }
    messages = [{"role": "user", "content": "Give me a city and a number."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}
    client = _client(stack)
    model = client.models.list().data[0].id
    served = client.chat.completions.create(model=model, messages=messages, max_tokens=80, temperature=0, response_format=response_format)

    tok, dec = Tokenizer.from_dir(tiny_model), Decoder.load(tiny_model)
    plan = plan_chat(
        messages,
        template=tok.chat_template,
        tool_format=FORMATS["hermes"],
        vocab=vocabulary(str(tiny_model), 512),
        response_format=response_format,
    )
    params = SamplingParams(temperature=0.0, max_tokens=80, grammar=plan.grammar)
    ids, out, cons = tok.encode(plan.prompt), [], grammar_constraint(params, str(tiny_model))
    with torch.no_grad():
        for _ in range(80):
            seq = ids + out
            hidden, positions = dec.embed(torch.tensor(seq)), torch.arange(len(seq))
            for layer in range(dec.num_layers):
                hidden, _, _ = dec.forward_layer(layer, hidden, positions, [(0, len(seq))], [None])
            t = sample(dec.logits(hidden[-1:]), [params], [None], eos_ids=tok.eos_token_ids, constraints=[cons])[0].token_id
            if t in tok.eos_token_ids:
                break
            out.append(t)
    assert served.choices[0].message.content == tok.decode(out)
    assert json.loads(served.choices[0].message.content)["city"] in ("Paris", "Oslo")
