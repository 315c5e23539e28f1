"""Messages and Responses requests -> the chat request they mean (no stack): blocks, tool uses
and results, items, tool choices and formats, and the refusals that name what is unsupported."""

from __future__ import annotations

import json

import pytest

from services.gateway import anthropic_api, responses_api
from services.gateway.core import ApiError


def _messages(**kw):
    return anthropic_api.MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **kw})


def test_anthropic_blocks_become_chat_messages_with_tool_calls_and_results():
    body = _messages(
        system=[{"type": "text", "text": "Be brief. ", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "Use tools."}],
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "call it", "signature": "x"},
                    {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12C", "is_error": True},
                    {"type": "text", "text": "and now?", "cache_control": {"type": "ephemeral"}},
                ],
            },
            {"role": "system", "content": "A reminder in the middle."},  # Claude Code sends these
        ],
        tools=[{"name": "w", "description": "weather", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        metadata={"user_id": "u-1"},
    )
    chat = anthropic_api.to_chat(body)
    msgs = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert msgs[0] == {"role": "system", "content": "Be brief. Use tools."}
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "w", "arguments": json.dumps({"city": "Oslo"})}
    assert msgs[2]["reasoning_content"] == "call it" and msgs[2].get("content") is None
    assert msgs[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: 12C"}
    assert msgs[4] == {"role": "user", "content": "and now?"} and msgs[5]["role"] == "system"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools == [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}, "description": "weather"}}]
    assert chat.stop == ["END"] and chat.dualpath_session == "u-1" and chat.max_tokens == 8


@pytest.mark.parametrize(
    ("choice", "want"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "w"}, {"type": "function", "function": {"name": "w"}}),
    ],
)
def test_anthropic_tool_choices_map_to_chat_tool_choices(choice, want):
    tools = [{"name": "w", "input_schema": {"type": "object"}}]
    chat = anthropic_api.to_chat(_messages(messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice=choice))
    assert chat.tool_choice == want


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ([{"type": "image", "source": {"type": "base64", "data": ""}}], "image blocks are not supported"),
        ([{"type": "tool_use", "id": "t", "name": "w", "input": {}}], "cannot hold a block of type 'tool_use'"),  # in a user turn
        ([{"type": "tool_result"}], "tool_use_id"),
        ([{"type": "mystery"}], "'mystery'"),
    ],
)
def test_anthropic_blocks_it_cannot_serve_are_a_400_naming_the_block(content, says):
    with pytest.raises(ApiError) as err:
        anthropic_api.to_chat(_messages(messages=[{"role": "user", "content": content}]))
    assert err.value.status == 400 and says in err.value.message and err.value.param == "messages.0.content.0"


def test_anthropic_usage_splits_the_prompt_into_cache_reads_creations_and_the_rest():
    class Gw:
        block_tokens = 64

        class cfg:
            prefix_cache = True

    prep = type("P", (), {"prompt_tokens": [0] * 300})()
    u = anthropic_api.usage(Gw(), prep, cached=128, output_tokens=5)
    assert u == {"input_tokens": 44, "cache_creation_input_tokens": 128, "cache_read_input_tokens": 128, "output_tokens": 5}
    assert anthropic_api.stop_reason("stop", "", True) == ("tool_use", None)
    assert anthropic_api.stop_reason("length", "", False) == ("max_tokens", None)
    assert anthropic_api.stop_reason("stop", "END", False) == ("stop_sequence", "END")
    assert anthropic_api.stop_reason("stop", "", False) == ("end_turn", None)


def test_anthropic_errors_have_anthropics_shape_and_a_validation_error_is_a_400():
    r = anthropic_api.error_response(422, "bad")
    assert r.status_code == 400 and json.loads(bytes(r.body)) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "bad"},
    }
    assert json.loads(bytes(anthropic_api.error_response(503, "x").body))["error"]["type"] == "overloaded_error"
    assert json.loads(bytes(anthropic_api.error_response(401, "x").body))["error"]["type"] == "authentication_error"


def _responses(**kw):
    return responses_api.ResponsesRequest.model_validate({"model": "m", **kw})


def test_responses_items_become_chat_messages_calls_joining_their_assistant_turn():
    items = responses_api.normalize_input(
        [
            {"role": "developer", "content": "rules"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}], "encrypted_content": "x"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": '{"a": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        ]
    )
    assert all(item["id"] for item in items) and items[0]["type"] == "message"
    msgs = responses_api.items_to_messages(items)
    assert msgs[0] == {"role": "system", "content": "rules"} and msgs[1] == {"role": "user", "content": "go"}
    assert msgs[2]["content"] == "calling" and msgs[2]["reasoning_content"] == "think"
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"]
    assert msgs[3:] == [{"role": "tool", "tool_call_id": "c1", "content": "one"}, {"role": "tool", "tool_call_id": "c2", "content": "two"}]


def test_responses_request_maps_tools_formats_and_drops_hosted_tools():
    body = _responses(
        input="hi",
        instructions="sys",
        tools=[
            {"type": "function", "name": "f", "parameters": {"type": "object"}},
            {"type": "web_search"},
            {"type": "namespace", "tools": []},
        ],
        tool_choice={"type": "function", "name": "f"},
        text={"format": {"type": "json_schema", "name": "v", "schema": {"type": "object"}, "strict": True}},
        max_output_tokens=9,
    )
    chat = responses_api.to_chat(body, [], responses_api.normalize_input(body.input), "s1")
    assert [t["function"]["name"] for t in chat.tools or []] == ["f"]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "v", "schema": {"type": "object"}, "strict": True}}
    assert chat.max_tokens == 9 and chat.dualpath_session == "s1" and chat.messages[0].content == "sys"


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),  # no function tools
    ],
)
def test_responses_requests_it_cannot_serve_are_a_400_naming_the_field(kw, param):
    body = _responses(**kw)
    with pytest.raises(ApiError) as err:
        responses_api.to_chat(body, [], responses_api.normalize_input(body.input), "")
    assert err.value.status == 400 and err.value.param == param


def _sse(lines: list[str]) -> list[tuple[str, dict]]:
    out = []
    for chunk in lines:
        head, data = chunk.strip().split("\n", 1)
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


DELTAS = [
    {"reasoning_content": "let me "},
    {"reasoning_content": "see"},
    {"content": "Calling."},
    {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "w", "arguments": ""}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]},
]


def test_anthropic_stream_opens_one_block_per_kind_in_order_and_closes_each():
    blocks = anthropic_api._Blocks()
    events = _sse([line for d in DELTAS for line in blocks.feed(d)] + blocks.finish())
    starts = [(e["index"], e["content_block"]["type"]) for name, e in events if name == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    assert [e["index"] for name, e in events if name == "content_block_stop"] == [0, 1, 2]
    deltas = [(e["index"], e["delta"]) for name, e in events if name == "content_block_delta"]
    assert deltas[:3] == [
        (0, {"type": "thinking_delta", "thinking": "let me "}),
        (0, {"type": "thinking_delta", "thinking": "see"}),
        (1, {"type": "text_delta", "text": "Calling."}),
    ]
    assert json.loads("".join(d["partial_json"] for i, d in deltas if i == 2)) == {"city": "Oslo"}
    tool = next(e["content_block"] for name, e in events if name == "content_block_start" and e["index"] == 2)
    assert tool == {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {}}
    empty = _sse(anthropic_api._Blocks().finish())  # an empty answer is one empty text block
    assert [n for n, _ in empty] == ["content_block_start", "content_block_stop"] and empty[0][1]["content_block"]["type"] == "text"


def test_responses_stream_builds_reasoning_message_and_call_items_with_their_done_events():
    ev = responses_api._Events()
    events = _sse([line for d in DELTAS for line in ev.feed(d)] + ev.finish())
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    done = [e["item"] for name, e in events if name == "response.output_item.done"]
    assert [i["type"] for i in done] == ["reasoning", "message", "function_call"] and ev.output == done
    assert done[0]["content"] == [{"type": "reasoning_text", "text": "let me see"}]
    assert done[1]["content"][0]["text"] == "Calling." and done[2]["arguments"] == '{"city": "Oslo"}' and done[2]["call_id"] == "call_1"
    names = [n for n, _ in events]
    for kind in ("response.reasoning_text.done", "response.output_text.done", "response.function_call_arguments.done"):
        assert names.count(kind) == 1
    assert [e["output_index"] for name, e in events if name == "response.output_item.added"] == [0, 1, 2]


def test_anthropic_server_side_fields_are_a_400_naming_them():
    for name, value in (("mcp_servers", [{"type": "url", "url": "http://x", "name": "x"}]), ("container", "c1")):
        with pytest.raises(ApiError) as err:
            anthropic_api.to_chat(_messages(messages=[{"role": "user", "content": "x"}], **{name: value}))
        assert err.value.status == 400 and err.value.param == name
