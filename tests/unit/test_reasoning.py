"""Reasoning output (``--reasoning-parser``): ``<think>…</think>`` split off the content, whole
and streamed, for DeepSeek-R1 (the answer may start inside the reasoning) and Qwen3 (reasoning
only after ``<think>``), and tool calls still parsed from the content after it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualpath.chat.reasoning import REASONING_PARSERS, StreamingReasoningParser, reasoning_format
from dualpath.chat.tools import tool_format
from services.gateway.answer import AnswerDeltas, parse_answer
from services.gateway.core import Prepared

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]


@pytest.mark.parametrize(
    ("fmt", "in_reasoning", "text", "want"),
    [
        (R1, True, "plan it</think>\n\nthe answer", ("plan it", "the answer")),  # template opened <think>
        (R1, True, "<think>\nplan it</think>the answer", ("plan it", "the answer")),  # model wrote it itself
        (R1, True, "still thinking", ("still thinking", "")),  # never closed: all reasoning
        (R1, False, "plan</think>answer", ("plan", "answer")),  # R1 starts in reasoning whatever the prompt
        (QWEN3, False, "just an answer", (None, "just an answer")),
        (QWEN3, False, "<think>\nhmm\n</think>\n\nyes", ("hmm\n", "yes")),
        (QWEN3, False, "<think>cut off", ("cut off", "")),
        (QWEN3, True, "hmm</think>yes", ("hmm", "yes")),  # the prompt ended inside <think>
        (QWEN3, False, "<thi", (None, "<thi")),  # a prefix of the marker that never became it
        (QWEN3, False, "a <think> inside</think>", (None, "a <think> inside</think>")),  # only at the start
    ],
)
def test_split_puts_the_think_part_apart_from_the_content(fmt, in_reasoning, text, want):
    assert fmt.split(text, in_reasoning=in_reasoning) == want


def test_a_prompt_that_ends_inside_think_opens_the_answer_in_reasoning():
    assert QWEN3.opens_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not QWEN3.opens_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking switched off
    assert not QWEN3.opens_in_reasoning("<|im_start|>assistant\n")
    assert R1.opens_in_reasoning("anything")


def test_unknown_reasoning_parser_names_the_known_ones():
    assert reasoning_format("") is None and reasoning_format("none") is None
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        reasoning_format("granite")


@given(
    fmt=st.sampled_from([R1, QWEN3]),
    in_reasoning=st.booleans(),
    text=st.lists(st.sampled_from(["<think>", "</think>", "<", "/", "think", ">", "a", " ", "\n"]), max_size=30).map("".join),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8),
)
def test_streaming_in_any_pieces_gives_the_same_split_as_the_whole_answer(fmt, in_reasoning, text, cuts):
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    parser = StreamingReasoningParser(fmt, in_reasoning=in_reasoning)
    out = [p for piece in pieces for p in parser.feed(piece)] + parser.finish()
    reasoning = "".join(t for kind, t in out if kind == "reasoning")
    content = "".join(t for kind, t in out if kind == "content")
    whole = fmt.split(text, in_reasoning=in_reasoning)
    assert (reasoning if parser.saw_reasoning else None, content) == whole


def _prep(**kw) -> Prepared:
    return Prepared(prompt_tokens=[1], sampling={}, stops=[], stream=True, include_usage=False, want_logprobs=False, read_path=0, **kw)


def test_tool_calls_after_the_reasoning_are_still_parsed_whole_and_streamed():
    prep = _prep(reasoning=QWEN3, tool_format=tool_format("hermes"))
    text = '<think>I need the weather.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    parsed = parse_answer(prep, text)
    assert parsed.reasoning == "I need the weather." and parsed.content is None
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", '{"city": "Oslo"}')]

    deltas = AnswerDeltas(prep)
    out = [d for ch in text for d in deltas.feed(ch)] + deltas.finish()
    assert "".join(d.get("reasoning_content", "") for d in out) == "I need the weather."
    assert not any("content" in d for d in out)
    calls = [c for d in out for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"].get("arguments", "") for c in calls) == '{"city": "Oslo"}'
    assert [c.name for c in deltas.calls] == ["get_weather"]


def test_without_a_reasoning_parser_think_tags_stay_in_the_content():
    prep = _prep()
    assert parse_answer(prep, "<think>x</think>y").content == "<think>x</think>y"
    assert AnswerDeltas(prep).feed("<think>") == [{"content": "<think>"}]
