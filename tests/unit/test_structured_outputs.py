"""Constrained decoding (``dualpath.structured`` through ``dualpath.model.sampling``): the tiny model,
greedy, produces schema-valid JSON and well-formed forced tool calls; a grammar replayed from
the first token (the decode engine's view) continues exactly as one unbroken grammar."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from dualpath.chat.tools import FORMATS
from dualpath.model import Decoder, SamplingParams, Tokenizer, make_tiny_model, sample
from dualpath.model.sampling import grammar_constraint
from dualpath.structured.grammar import (
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["city", "days", "tags", "ok"],
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), vocab=400)


@pytest.fixture(scope="module")
def dec(tiny):
    torch.set_num_threads(1)
    return Decoder.load(tiny)


@pytest.fixture(scope="module")
def tok(tiny):
    return Tokenizer.from_dir(tiny)


@torch.no_grad()
def _logits(dec: Decoder, ids: list[int]) -> torch.Tensor:
    hidden = dec.embed(torch.tensor(ids))
    positions = torch.arange(len(ids))
    for layer in range(dec.num_layers):
        hidden, _, _ = dec.forward_layer(layer, hidden, positions, [(0, len(ids))], [None])
    return dec.logits(hidden[-1:])  # [1, V]


def _generate(dec, tok, tiny, prompt: str, grammar: str, max_tokens: int = 80, split_after: int | None = None) -> list[int]:
    """Greedy generation under ``grammar``; with ``split_after`` a fresh constraint takes over
    after that many tokens, replaying them (what the decode engine does after the prefill engine)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, grammar=grammar)
    ids = tok.encode(prompt)
    out: list[int] = []
    cons = grammar_constraint(params, str(tiny))
    for step in range(max_tokens):
        if split_after is not None and step == split_after:
            cons = grammar_constraint(params, str(tiny), prefix=out)
        t = sample(_logits(dec, ids + out), [params], [None], eos_ids=tok.eos_token_ids, constraints=[cons])[0].token_id
        out.append(t)
        if t in tok.eos_token_ids:
            break
    return out


def test_unconstrained_tiny_model_does_not_write_json_but_a_schema_grammar_makes_it(dec, tok, tiny):
    prompt = "<|im_start|>user\nGive me JSON<|im_end|>\n<|im_start|>assistant\n"
    free = _generate(dec, tok, tiny, prompt, grammar="", max_tokens=20)
    assert not tok.decode(free).startswith("{")
    ids = _generate(dec, tok, tiny, prompt, json_schema_grammar(SCHEMA))
    assert ids[-1] in tok.eos_token_ids, "a complete value ends in EOS"
    value = json.loads(tok.decode(ids))
    jsonschema.validate(value, SCHEMA)
    assert tok.decode(ids) == json.dumps(value)  # compact, json.dumps separators


@pytest.mark.parametrize("split_after", [1, 5])
def test_replaying_the_first_tokens_into_a_fresh_grammar_continues_exactly(dec, tok, tiny, split_after):
    prompt = "<|im_start|>user\nplan a trip<|im_end|>\n<|im_start|>assistant\n"
    grammar = json_schema_grammar(SCHEMA)
    assert _generate(dec, tok, tiny, prompt, grammar, split_after=split_after) == _generate(dec, tok, tiny, prompt, grammar)


def test_forced_hermes_tool_call_is_well_formed_and_parses(dec, tok, tiny):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]},
            },
        },
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"]},
            },
        },
    ]
    grammar = lark_grammar(FORMATS["hermes"].grammar(tools, parallel=False))
    ids = _generate(dec, tok, tiny, "<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n", grammar)
    content, calls = FORMATS["hermes"].parse(tok.decode(ids))
    assert content is None and len(calls) == 1 and calls[0].name in ("get_weather", "add")


def test_forced_llama3_json_tool_call_parses_with_its_parameters(dec, tok, tiny):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "parameters": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["id"]},
            },
        }
    ]
    grammar = lark_grammar(FORMATS["llama3_json"].grammar(tools, parallel=False))
    ids = _generate(dec, tok, tiny, "<|im_start|>user\nfind it<|im_end|>\n<|im_start|>assistant\n", grammar)
    content, calls = FORMATS["llama3_json"].parse(tok.decode(ids))
    assert content is None and [c.name for c in calls] == ["lookup"] and 0 <= json.loads(calls[0].arguments)["id"] <= 9


def test_json_object_grammar_opens_an_object(dec, tok, tiny):
    ids = _generate(dec, tok, tiny, "x", json_object_grammar(), max_tokens=12)
    assert tok.decode(ids).startswith("{")


def test_a_finished_grammar_lets_eos_through_even_under_min_tokens(tiny, tok):
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, grammar=json_schema_grammar({"enum": [1]}))
    cons = grammar_constraint(params, str(tiny), prefix=tok.encode("1"))
    logits = torch.zeros(1, 400)
    logits[0, 65] = 50.0  # the model wants "A"
    token = sample(logits, [params], [None], suppress_eos=[True], eos_ids=tok.eos_token_ids, constraints=[cons])[0]
    assert token.token_id in tok.eos_token_ids


def test_sampling_with_temperature_stays_inside_the_grammar(tiny, tok):
    params = SamplingParams(temperature=1.0, max_tokens=30, grammar=json_schema_grammar({"enum": ["yes", "no"]}))
    gen = torch.Generator().manual_seed(0)
    cons = grammar_constraint(params, str(tiny))
    out = []
    for _ in range(10):
        t = sample(torch.randn(1, 400, generator=gen), [params], [gen], eos_ids=tok.eos_token_ids, constraints=[cons])[0].token_id
        if t in tok.eos_token_ids:
            break
        out.append(t)
    assert tok.decode(out) in ('"yes"', '"no"')


def test_logprobs_under_a_grammar_are_the_raw_model_logprobs(tiny, tok):
    params = SamplingParams(temperature=0.0, grammar=json_schema_grammar({"enum": [7]}))
    logits = torch.randn(1, 400, generator=torch.Generator().manual_seed(1))
    got = sample(logits, [params], [None], eos_ids=tok.eos_token_ids, constraints=[grammar_constraint(params, str(tiny))])[0]
    assert got.token_id == ord("7")
    assert got.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[ord("7")]))


def test_auto_tool_choice_with_a_response_format_answers_either_a_call_or_that_json(dec, tok, tiny):
    """What an agent with tools and a typed final output sends: the answer may call a tool or give the
    typed object, and nothing else."""
    from dualpath.chat.plan import plan_chat
    from dualpath.chat.template import ChatTemplate
    from dualpath.structured.grammar import vocabulary

    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "parameters": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["id"]},
            },
        }
    ]
    schema = {"type": "object", "properties": {"done": {"type": "boolean"}}, "required": ["done"]}
    plan = plan_chat(
        [{"role": "user", "content": "go"}],
        template=ChatTemplate.from_dir(tiny),
        tool_format=FORMATS["hermes"],
        vocab=vocabulary(str(tiny), 400),
        tools=tools,
        tool_choice="auto",
        parallel_tool_calls=False,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
    )
    assert not plan.forced and plan.grammar
    for prompt in ("<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n", "abc", "Z9"):
        text = tok.decode(_generate(dec, tok, tiny, prompt, plan.grammar, max_tokens=100))
        content, calls = FORMATS["hermes"].parse(text)
        if calls:
            assert content is None and calls[0].name == "lookup"
        else:
            jsonschema.validate(json.loads(text), schema)
