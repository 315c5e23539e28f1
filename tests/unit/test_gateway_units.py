"""Gateway pieces that need no stack: incremental detokenization with stop strings, token
stream re-ordering, configuration from flags and environment, topology strings."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from dualpath.cli.launcher.topology import parse_topology
from dualpath.config import GatewayConfig, add_arguments, from_args
from dualpath.protocol import encode
from dualpath.protocol.messages import TokenEvent
from services.gateway.detok import Detokenizer
from services.gateway.streams import TokenStreams


class CharTok:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_detokenizer_holds_back_a_possible_stop_string_and_cuts_at_it():
    d = Detokenizer(CharTok(), ["STOP"])
    out = [d.add([ord(c)]) for c in "abST"]
    assert "".join(out) == "ab"  # "ST" may become "STOP"
    assert d.add([ord("O")]) == ""
    assert d.add([ord("P")]) == "" and d.stopped
    assert d.emitted == "ab"


def test_detokenizer_releases_held_text_when_it_was_not_a_stop():
    d = Detokenizer(CharTok(), ["STOP"])
    assert d.add([ord(c) for c in "xST"]) == "x"
    assert d.add([ord("x")]) == "STx"
    assert d.flush() == ""


class Raw:
    def __init__(self, ev):
        self.data = encode(ev)


def test_token_streams_reorder_events_from_two_publishers():
    async def go():
        s = TokenStreams()
        s.open("r")
        await s.on_message(Raw(TokenEvent(request_id="r", index=1, token_ids=[11])))
        await s.on_message(Raw(TokenEvent(request_id="r", index=2, token_ids=[], finish_reason="length")))
        await s.on_message(Raw(TokenEvent(request_id="r", index=0, token_ids=[10])))
        await s.on_message(Raw(TokenEvent(request_id="r", index=0, token_ids=[10])))  # a duplicate after a retry
        return [(e.index, e.token_ids, e.finish_reason) async for e in s.events("r", timeout=2)]

    assert asyncio.run(go()) == [(0, [10], None), (1, [11], None), (2, [], "length")]


def test_config_precedence_is_flag_then_environment_then_default(monkeypatch):
    p = argparse.ArgumentParser()
    add_arguments(p, GatewayConfig)
    monkeypatch.setenv("DUALPATH_PORT", "9100")
    monkeypatch.setenv("DUALPATH_PREFIX_CACHE", "false")
    assert from_args(GatewayConfig, p.parse_args([])).port == 9100
    assert from_args(GatewayConfig, p.parse_args([])).prefix_cache is False
    assert from_args(GatewayConfig, p.parse_args(["--port", "9200"])).port == 9200
    monkeypatch.setenv("DUALPATH_PORT", "eighty")
    with pytest.raises(ValueError, match="DUALPATH_PORT"):
        from_args(GatewayConfig, p.parse_args([]))


@pytest.mark.parametrize("text,expected", [("1P1D", (1, 1)), ("2p4d", (2, 4)), (" 48P96D ", (48, 96))])
def test_topology_strings_parse(text, expected):
    t = parse_topology(text, 2)
    assert (t.prefill_nodes, t.decode_nodes) == expected
    assert len(t.engines()) == 2 * sum(expected)


@pytest.mark.parametrize("text", ["1P", "0P1D", "PD", "1P0D", "x"])
def test_bad_topology_strings_are_refused(text):
    with pytest.raises(ValueError, match="1P1D"):
        parse_topology(text)


def test_incremental_detokenization_equals_a_full_decode_with_multibyte_text(tiny_model):
    from dualpath.model import Tokenizer

    tok = Tokenizer.from_dir(tiny_model)
    text = "naïve café — 日本語 ok " * 20
    ids = tok.encode(text)
    d = Detokenizer(tok, [])
    out = "".join(d.add([i]) for i in ids) + d.flush()
    assert out == tok.decode(ids) == text
    assert "\ufffd" not in "".join(Detokenizer(tok, []).add([i]) for i in ids[:7])  # half a character is held back


def test_a_stream_whose_consumer_falls_behind_ends_with_an_overflow_error_not_a_hang(monkeypatch):
    import services.gateway.streams as streams

    monkeypatch.setattr(streams, "_MAX_PENDING", 2)

    async def go():
        s = TokenStreams()
        s.open("r")
        for i in range(4):  # nobody reads: the third event overflows
            await s.on_message(Raw(TokenEvent(request_id="r", index=i, token_ids=[i])))
        got = []
        with pytest.raises(streams.StreamOverflowError):
            async for e in s.events("r", timeout=5):
                got.append(e.index)
        return got

    assert asyncio.run(go()) == [0, 1]


def _gateway(tiny_model, tmp_path, template: str | None, **cfg):
    import json
    import shutil

    from dualpath.config import BusConfig, ModelConfigSpec
    from services.gateway.core import Gateway

    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    if template is not None:
        config = json.loads((model / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (model / "tokenizer_config.json").write_text(json.dumps(config))
    return Gateway(GatewayConfig(**cfg), BusConfig(), ModelConfigSpec(model=str(model)))


def test_tool_parser_follows_the_checkpoint_template_unless_the_flag_names_one(tiny_model, tmp_path):
    llama = (Path(__file__).resolve().parents[1] / "data" / "chat_templates" / "llama-3.1-instruct.jinja").read_text()
    assert _gateway(tiny_model, tmp_path / "a", llama).tool_format.name == "llama3_json"
    assert _gateway(tiny_model, tmp_path / "b", None).tool_format.name == "hermes"
    assert _gateway(tiny_model, tmp_path / "c", llama, tool_parser="hermes").tool_format.name == "hermes"
    with pytest.raises(ValueError, match="unknown tool parser"):
        _gateway(tiny_model, tmp_path / "d", None, tool_parser="nope")


def test_chat_request_with_a_forced_tool_carries_a_grammar_and_the_rendered_tools(tiny_model, tmp_path):
    from services.gateway.api_types import ChatCompletionRequest

    qwen = (Path(__file__).resolve().parents[1] / "data" / "chat_templates" / "qwen2.5-instruct.jinja").read_text()
    gw = _gateway(tiny_model, tmp_path, qwen)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
    body = ChatCompletionRequest(model=gw.model_name, messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice="required")
    prep = gw.prepare_chat(body)
    assert prep.sampling["grammar"] and prep.tool_format.name == "hermes" and prep.constrained
    assert '"name": "add"' in gw.tokenizer.decode(prep.prompt_tokens)  # the template rendered the tools
    plain = gw.prepare_chat(ChatCompletionRequest(model=gw.model_name, messages=[{"role": "user", "content": "hi"}]))
    assert "grammar" not in plain.sampling and plain.tool_format is None


def test_unknown_tool_parser_flag_is_a_one_line_error_with_exit_code_2(tiny_model, capsys):
    from services.gateway.service import main

    assert main(["--model", str(tiny_model), "--tool-parser", "mistral"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hermes" in err[0] and "mistral" in err[0]


def test_unknown_reasoning_parser_flag_is_a_one_line_error_with_exit_code_2(tiny_model, capsys):
    from services.gateway.service import main

    assert main(["--model", str(tiny_model), "--reasoning-parser", "granite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "deepseek_r1" in err[0] and "granite" in err[0]


def test_reasoning_parsing_applies_to_unconstrained_answers_and_knows_whether_the_prompt_opened_it(tiny_model, tmp_path):
    from services.gateway.api_types import ChatCompletionRequest

    opens = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}assistant: <think>\n"
    gw = _gateway(tiny_model, tmp_path / "a", opens, reasoning_parser="qwen3")
    hi = [{"role": "user", "content": "hi"}]
    prep = gw.prepare_chat(ChatCompletionRequest(model=gw.model_name, messages=hi))
    assert prep.reasoning is not None and prep.reasoning.name == "qwen3" and prep.in_reasoning
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    forced = gw.prepare_chat(ChatCompletionRequest(model=gw.model_name, messages=hi, tools=tools, tool_choice="required"))
    assert forced.reasoning is None  # the grammar's answer is the call itself
    plain = _gateway(tiny_model, tmp_path / "b", None, reasoning_parser="qwen3").prepare_chat(
        ChatCompletionRequest(model=gw.model_name, messages=hi)
    )
    assert plain.reasoning is not None and not plain.in_reasoning


def test_messages_and_responses_cut_max_tokens_to_the_context_where_chat_refuses_it(tiny_model, tmp_path):
    from services.gateway.api_types import ChatCompletionRequest
    from services.gateway.core import ApiError

    gw = _gateway(tiny_model, tmp_path, None)
    body = ChatCompletionRequest(model=gw.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=10**6)
    with pytest.raises(ApiError, match="exceeds the maximum context"):
        gw.prepare_chat(body)
    prep = gw.prepare_chat(body, clamp=True)
    assert prep.sampling["max_tokens"] == gw.max_context - len(prep.prompt_tokens)


def test_count_tokens_counts_a_prompt_longer_than_the_context_that_serving_refuses(tiny_model, tmp_path):
    from services.gateway.api_types import ChatCompletionRequest
    from services.gateway.core import ApiError

    gw = _gateway(tiny_model, tmp_path, None, max_prompt_tokens=50)
    body = ChatCompletionRequest(model=gw.model_name, messages=[{"role": "user", "content": "x" * 200}])
    with pytest.raises(ApiError, match="maximum context length"):
        gw.prepare_chat(body)
    assert gw.count_chat(body) > 200  # one token per byte, plus the template's
