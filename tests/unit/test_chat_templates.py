"""Chat templates (``dualpath.chat.template``): the published templates of Qwen2.5, Llama 3.1 and
DeepSeek-V3 (``tests/data/chat_templates``) render byte for byte what ``transformers``'
``apply_chat_template`` renders, with and without tools; where templates come from; the sandbox."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import tokenizers

from dualpath.chat.errors import ChatTemplateError
from dualpath.chat.template import CHATML_TEMPLATE, ChatTemplate
from dualpath.model import ModelLoadError, Tokenizer, make_tiny_model

transformers = pytest.importorskip("transformers")

DATA = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
SPECIALS = {
    "qwen2.5-instruct": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "llama-3.1-instruct": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "deepseek-v3": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
        },
    },
]
PLAIN = [
    {"role": "system", "content": "You are terse. Ünïcode ✓"},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi. What do you need?"},
    {"role": "user", "content": 'Tell me a <joke> & a "quote".'},
]
# History with a tool call and its result. DeepSeek-V3's template concatenates ``arguments``
# as text; Qwen's and Llama's render a mapping with ``tojson`` (HF's convention).
TOOL_HISTORY = [
    {"role": "system", "content": "Use tools when useful."},
    {"role": "user", "content": "Weather in Paris, in C?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'},
]
DEEPSEEK_TOOL_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Let me check."},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 22}'},
    {"role": "assistant", "content": "21 degrees."},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), vocab=300)


def _source(name: str) -> str:
    return (DATA / f"{name}.jinja").read_text(encoding="utf-8")


def _hf(tiny: Path, name: str):
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(tiny / "tokenizer.json"), chat_template=_source(name), **SPECIALS[name])


def _case(name: str, tools: bool):
    if not tools:
        return PLAIN, None
    return (DEEPSEEK_TOOL_HISTORY if name == "deepseek-v3" else TOOL_HISTORY), TOOLS


@pytest.mark.parametrize("tools", [False, True], ids=["without-tools", "with-tools"])
@pytest.mark.parametrize("name", sorted(SPECIALS))
@pytest.mark.parametrize("generation_prompt", [True, False], ids=["gen", "nogen"])
def test_published_template_renders_exactly_what_transformers_renders(tiny, name, tools, generation_prompt):
    messages, tool_list = _case(name, tools)
    expected = _hf(tiny, name).apply_chat_template(messages, tools=tool_list, tokenize=False, add_generation_prompt=generation_prompt)
    ours = ChatTemplate({"default": _source(name)}, special_tokens=SPECIALS[name]).render(
        messages, tools=tool_list, add_generation_prompt=generation_prompt
    )
    assert ours == expected
    if tools and name != "deepseek-v3":  # DeepSeek-V3's template does not show tool definitions
        assert "get_weather" in ours.split("Weather in Paris")[0]


def test_deepseek_tool_call_turn_renders_its_calls_where_transformers_drops_the_content_key():
    """transformers drops ``content=None`` and DeepSeek-V3's template then fails; we keep ``None``
    on assistant turns with tool calls, so the template renders its tool-call branch."""
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = ChatTemplate({"default": _source("deepseek-v3")}, special_tokens=SPECIALS["deepseek-v3"]).render(messages)
    assert '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```' in text
    assert text.endswith("<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")


def _checkpoint(tiny: Path, dest: Path, **config) -> Path:
    shutil.copytree(tiny, dest)
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg.update(config)
    for key in [k for k, v in config.items() if v is None]:
        cfg.pop(key)
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


def test_checkpoint_template_from_tokenizer_config_is_used_and_specials_come_along(tiny, tmp_path):
    d = _checkpoint(tiny, tmp_path / "m", chat_template=_source("llama-3.1-instruct"), bos_token="<|begin_of_text|>")
    tok = Tokenizer.from_dir(d)
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert tok.chat_template.source == "tokenizer_config.json"


def test_chat_template_jinja_file_replaces_the_config_template(tiny, tmp_path):
    d = _checkpoint(tiny, tmp_path / "m")
    (d / "chat_template.jinja").write_text(_source("qwen2.5-instruct"), encoding="utf-8")
    text = Tokenizer.from_dir(d).render_chat([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")


def test_named_templates_pick_default_tool_use_or_a_name(tiny, tmp_path):
    named = [
        {"name": "default", "template": "D{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
        {"name": "rag", "template": "R"},
    ]
    d = _checkpoint(tiny, tmp_path / "m", chat_template=named)
    tpl = Tokenizer.from_dir(d).chat_template
    assert tpl.render([{"role": "user", "content": "x"}]) == "Dx"
    assert tpl.render([{"role": "user", "content": "x"}], tools=TOOLS) == "T2"
    assert tpl.render([{"role": "user", "content": "x"}], template="rag") == "R"
    with pytest.raises(ChatTemplateError, match="no chat template named"):
        tpl.render([{"role": "user", "content": "x"}], template="nope")


def test_additional_chat_templates_directory_gives_named_templates(tiny, tmp_path):
    d = _checkpoint(tiny, tmp_path / "m")
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "short.jinja").write_text("S", encoding="utf-8")
    (d / "chat_template.jinja").write_text("D", encoding="utf-8")
    tpl = ChatTemplate.from_dir(d)
    assert tpl.render([{"role": "user", "content": "x"}]) == "D"
    assert tpl.render([{"role": "user", "content": "x"}], template="short") == "S"


def test_chatml_is_used_only_when_the_checkpoint_has_no_template(tiny, tmp_path):
    d = _checkpoint(tiny, tmp_path / "m", chat_template=None)
    tpl = ChatTemplate.from_dir(d)
    assert tpl.default == CHATML_TEMPLATE and tpl.source.startswith("ChatML")
    assert tpl.render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_raise_exception_and_sandbox_escapes_become_template_errors():
    with pytest.raises(ChatTemplateError, match="only user turns"):
        ChatTemplate({"default": "{{ raise_exception('only user turns') }}"}).render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate({"default": "{{ ''.__class__.__mro__[1].__subclasses__() }}"}).render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate({"default": "{% set ns = namespace(_x=1) %}"}).render([{"role": "user", "content": "x"}])


def test_tojson_does_not_escape_html_and_honours_indent():
    out = ChatTemplate({"default": "{{ messages[0] | tojson }}|{{ {'a': [1]} | tojson(indent=2) }}"}).render(
        [{"role": "user", "content": "<b>é</b>"}]
    )
    assert out == '{"role": "user", "content": "<b>é</b>"}|{\n  "a": [\n    1\n  ]\n}'


def test_a_template_that_does_not_compile_fails_the_load_naming_the_file(tiny, tmp_path):
    d = _checkpoint(tiny, tmp_path / "m", chat_template="{% for %}")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json"):
        Tokenizer.from_dir(d)


@pytest.mark.parametrize("name", sorted(SPECIALS))
def test_served_prompt_ids_equal_transformers_tokenized_chat(tiny, tmp_path, name):
    """What the gateway submits (render, then encode without added specials) is HF's
    ``apply_chat_template(tokenize=True)``, ids for ids, for a checkpoint carrying the template."""
    d = _checkpoint(tiny, tmp_path / "m", chat_template=_source(name), **SPECIALS[name])
    # The family's control tokens are single special tokens of the vocabulary, as in the real checkpoint.
    raw = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    raw.add_special_tokens(sorted(set(re.findall(r"<\|[a-z_]+\|>|<｜[^｜]+｜>", _source(name))) | set(SPECIALS[name].values())))
    raw.save(str(d / "tokenizer.json"))
    messages, tools = _case(name, True)
    tok = Tokenizer.from_dir(d)
    ours = tok.encode(tok.render_chat(messages, tools=tools))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), chat_template=_source(name), **SPECIALS[name])
    assert ours == list(hf.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False))
    assert len(ours) < len(tok.render_chat(messages, tools=tools).encode())  # the control tokens are single ids
