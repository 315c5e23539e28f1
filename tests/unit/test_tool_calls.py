"""Tool calls (``dualpath.chat.tools`` and ``dualpath.chat.plan``): parsing the Hermes and Llama 3
JSON formats whole and streamed, choosing the format from the template, and the 400s of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dualpath.chat.errors import ChatTemplateError, GrammarError, ToolSpecError
from dualpath.chat.plan import plan_chat
from dualpath.chat.stream import StreamingToolParser
from dualpath.chat.template import ChatTemplate
from dualpath.chat.tools import FORMATS, format_for_template, tool_format
from dualpath.model import make_tiny_model
from dualpath.structured.grammar import vocabulary

HERMES, LLAMA = FORMATS["hermes"], FORMATS["llama3_json"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
        },
    },
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), vocab=300)


def test_hermes_answer_with_text_and_two_calls_parses_into_content_and_calls():
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    content, calls = HERMES.parse(text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_hermes_malformed_call_leaves_the_text_alone_and_a_cut_last_call_is_dropped():
    assert HERMES.parse("<tool_call>\n{not json}\n</tool_call>") == ("<tool_call>\n{not json}\n</tool_call>", [])
    _, calls = HERMES.parse('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n{"na')
    assert [c.name for c in calls] == ["add"]
    assert HERMES.parse("plain answer") == ("plain answer", [])


def test_llama3_json_answer_is_a_call_with_parameters_and_plain_text_is_content():
    _, calls = LLAMA.parse('{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]
    assert LLAMA.parse("The answer is 3.") == ("The answer is 3.", [])
    assert LLAMA.parse('{"not": "a call"}') == ('{"not": "a call"}', [])


def _assemble(deltas: list[dict]) -> tuple[str, list[dict]]:
    """What a client (the openai SDK, the Agents SDK) rebuilds from stream deltas."""
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = tc.get("id", call["id"])
            call["name"] = tc.get("function", {}).get("name", call["name"])
            call["arguments"] += tc.get("function", {}).get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


HERMES_TWO_CALLS = (
    'Checking <tool_c stuff.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, {"c": 3}]}}\n</tool_call>'
)


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_streamed_hermes_deltas_rebuild_the_same_content_and_calls(chunk):
    parser = StreamingToolParser(HERMES)
    deltas = []
    for i in range(0, len(HERMES_TWO_CALLS), chunk):
        deltas += parser.feed(HERMES_TWO_CALLS[i : i + chunk])
    deltas += parser.finish()
    content, calls = _assemble(deltas)
    assert content == "Checking <tool_c stuff."
    whole_content, whole = HERMES.parse(HERMES_TWO_CALLS)
    assert content == whole_content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [(w.name, json.loads(w.arguments)) for w in whole]
    assert [c["arguments"] for c in calls] == [w.arguments for w in whole]
    assert all(c["id"].startswith("call_") for c in calls)


def test_a_call_streams_a_header_then_pieces_of_its_arguments_as_openai_does():
    parser = StreamingToolParser(HERMES)
    out = parser.feed('<tool_call>\n{"name": "add", "arguments": ') + parser.feed('{"a": 1,') + parser.feed(' "b": 2}')
    out += parser.feed("}\n</tool_call>") + parser.finish()
    first = out[0]["tool_calls"][0]
    assert first["index"] == 0 and first["type"] == "function" and first["function"] == {"name": "add", "arguments": ""}
    pieces = [d["tool_calls"][0]["function"]["arguments"] for d in out[1:]]
    assert len(pieces) >= 2 and "".join(pieces) == '{"a": 1, "b": 2}'
    assert all("id" not in d["tool_calls"][0] for d in out[1:])


def test_a_call_with_its_keys_reordered_is_sent_whole_when_it_closes():
    parser = StreamingToolParser(HERMES)
    out = parser.feed('<tool_call>\n{"arguments": {"a": 1}, "name": "add"}\n</tool_call>') + parser.finish()
    _, calls = _assemble(out)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("add", {"a": 1})]


def test_streamed_text_without_calls_is_all_content_and_llama_json_streams_its_calls():
    parser = StreamingToolParser(HERMES)
    out = parser.feed("no calls here <tool") + parser.feed("s> at all") + parser.finish()
    assert "".join(d["content"] for d in out) == "no calls here <tools> at all"
    parser = StreamingToolParser(LLAMA)
    out = parser.feed("The ") + parser.feed("answer") + parser.feed(" is 3.") + parser.finish()
    assert "".join(d["content"] for d in out) == "The answer is 3."
    parser = StreamingToolParser(LLAMA)
    text = '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    out = [d for ch in text for d in parser.feed(ch)] + parser.finish()
    content, calls = _assemble(out)
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("add", {"a": 1, "b": 2}),
        ("get_weather", {"city": "Oslo"}),
    ]


def test_published_templates_choose_their_own_tool_format():
    data = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
    assert format_for_template((data / "qwen2.5-instruct.jinja").read_text()) is HERMES
    assert format_for_template((data / "llama-3.1-instruct.jinja").read_text()) is LLAMA


def test_format_follows_the_template_unless_named():
    assert format_for_template("... <tool_call> ...") is HERMES
    assert format_for_template("{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}") is LLAMA
    assert tool_format("llama3_json") is LLAMA
    with pytest.raises(ValueError, match="hermes"):
        tool_format("mistral")


def _plan(tiny, messages=None, **kw):
    return plan_chat(
        messages or [{"role": "user", "content": "hi"}],
        template=ChatTemplate.from_dir(tiny),
        tool_format=HERMES,
        vocab=vocabulary(str(tiny), 300),
        **kw,
    )


def test_required_and_named_tool_choice_force_a_grammar_and_auto_does_not(tiny):
    assert _plan(tiny, tools=TOOLS, tool_choice="auto").grammar is None
    forced = _plan(tiny, tools=TOOLS, tool_choice="required")
    assert forced.forced and "get_weather" in forced.grammar and "add" in forced.grammar
    named = _plan(tiny, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    assert named.forced and '"const": "add"' in named.grammar and "get_weather" not in named.grammar
    assert _plan(tiny, tools=TOOLS, tool_choice="none").tool_format is None


def test_invalid_tool_schema_is_refused_naming_the_field(tiny):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "bogus"}}}}}]
    with pytest.raises(GrammarError) as err:
        _plan(tiny, tools=bad)
    assert err.value.param == "tools[0].function.parameters"
    with pytest.raises(ToolSpecError) as err:
        _plan(tiny, tools=[{"type": "function", "function": {"name": "has space"}}])
    assert err.value.param == "tools[0].function.name"


def test_tool_choice_naming_no_tool_is_refused(tiny):
    with pytest.raises(ToolSpecError) as err:
        _plan(tiny, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.param == "tool_choice"


def test_tool_message_without_a_matching_call_is_refused_naming_it(tiny):
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c9", "content": "?"},
    ]
    with pytest.raises(ToolSpecError) as err:
        _plan(tiny, messages, tools=TOOLS)
    assert err.value.param == "messages[3].tool_call_id"
    ok = _plan(tiny, messages[:3], tools=TOOLS)
    assert ok.prompt.endswith("<|im_start|>assistant\n")


def test_uncompilable_json_schema_is_refused_naming_the_field(tiny):
    with pytest.raises(GrammarError) as err:
        _plan(tiny, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert err.value.param == "response_format.json_schema.schema"
    with pytest.raises(GrammarError) as err:
        _plan(tiny, response_format={"type": "yaml"})
    assert err.value.param == "response_format.type"


def test_tool_call_arguments_that_are_not_json_are_refused(tiny):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{a: 1"}}]},
    ]
    with pytest.raises(ToolSpecError) as err:
        _plan(tiny, messages, tools=TOOLS)
    assert err.value.param == "messages[1].tool_calls[0].function.arguments"


def test_image_content_is_refused_naming_the_message(tiny):
    with pytest.raises(ChatTemplateError) as err:
        _plan(tiny, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert err.value.param == "messages[0].content"


_names = st.sampled_from(["add", "get_weather", "x_1"])
_args = st.dictionaries(st.sampled_from(["a", "city", "q"]), st.one_of(st.integers(-5, 99), st.text('ab"}{<> ', max_size=6)), max_size=3)


@settings(max_examples=60, deadline=None)
@given(
    content=st.text("abc <tol_>\n{}", max_size=12).filter(lambda t: not t[:1].isspace()),
    calls=st.lists(st.tuples(_names, _args), max_size=3),
    fmt=st.sampled_from(["hermes", "llama3_json"]),
    cuts=st.lists(st.integers(1, 9), min_size=1, max_size=40),
)
# Content that opens a call which never parses: the whole answer is text, and streaming once
# dropped it (it sent nothing at all).
@example(content="<tool_call>", calls=[("add", {})], fmt="hermes", cuts=[1])
@example(content="ab \n<tool_call>", calls=[], fmt="hermes", cuts=[3])
def test_any_chunking_of_an_answer_streams_what_the_whole_answer_parses_to(content, calls, fmt, cuts):
    f = FORMATS[fmt]
    if fmt == "hermes":
        text = content + "".join(f'\n<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>' for n, a in calls)
    else:
        text = "; ".join(f'{{"name": "{n}", "parameters": {json.dumps(a)}}}' for n, a in calls) if calls else content
    parser = StreamingToolParser(f)
    deltas, pos, i = [], 0, 0
    while pos < len(text):
        step = cuts[i % len(cuts)]
        deltas += parser.feed(text[pos : pos + step])
        pos, i = pos + step, i + 1
    deltas += parser.finish()
    streamed_content, streamed_calls = _assemble(deltas)
    whole_content, whole_calls = f.parse(text)
    assert streamed_content == (whole_content or "")
    assert [(c["name"], c["arguments"]) for c in streamed_calls] == [(c.name, c.arguments) for c in whole_calls]
    if FORMATS["hermes"].start not in content:  # else the content itself opens a (malformed) call
        assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == [(n, a) for n, a in calls]
