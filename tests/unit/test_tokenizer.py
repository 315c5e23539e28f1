"""Tokenizer and chat rendering of the tiny checkpoint (``dualpath.model.tokenizer``)."""

from __future__ import annotations

import json

import pytest
import tokenizers

from dualpath.model import ModelInputError, ModelLoadError, Tokenizer, make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), vocab=400)


@pytest.fixture(scope="module")
def tok(tiny):
    return Tokenizer.from_dir(tiny)


def test_tokenizer_json_loads_with_the_tokenizers_library(tiny):
    raw = tokenizers.Tokenizer.from_file(str(tiny / "tokenizer.json"))
    assert raw.get_vocab_size(with_added_tokens=True) == 400
    assert raw.token_to_id("<|im_start|>") == 257


def test_special_tokens_in_text_are_single_tokens(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|endoftext|>")
    assert ids == [257, *b"user\nhi", 258, 10, 256]


def test_encode_adds_no_special_tokens_and_maps_each_byte_to_one_token(tok):
    text = "Hello, world! 42"
    assert tok.encode(text) == list(text.encode())
    assert tok.encode("") == []


def test_decode_inverts_encode_for_ascii_and_utf8(tok):
    for text in ("plain ASCII text, with {json: 'quotes'}\n\ttabs", "naïve café — 東京 🚀"):
        assert tok.decode(tok.encode(text)) == text


def test_decode_skips_special_tokens(tok):
    assert tok.decode([257, *b"ab", 258, 256]) == "ab"


def test_decode_rejects_negative_ids(tok):
    with pytest.raises(ModelInputError):
        tok.decode([65, -1])


def test_eos_ids_include_im_end_and_endoftext(tok):
    assert tok.eos_token_ids == frozenset({256, 258})
    assert tok.vocab_size == 400


def test_render_chat_produces_chatml_with_generation_prompt(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None},
    ]
    assert tok.render_chat(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.render_chat(messages[:1], add_generation_prompt=False) == "<|im_start|>system\nBe brief.<|im_end|>\n"


def test_rendered_earlier_turns_are_a_token_prefix_of_the_next_turn(tok):
    first = [{"role": "user", "content": "What is 2+2?"}]
    second = [*first, {"role": "assistant", "content": "Four"}, {"role": "user", "content": "And 3+3?"}]
    a, b = tok.encode(tok.render_chat(first)), tok.encode(tok.render_chat(second))
    assert b[: len(a)] == a
    assert b[len(a) : len(a) + 5] == [*b"Four", 258]


@pytest.mark.parametrize(
    "messages",
    [
        [{"content": "no role"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        [{"role": "user", "content": 3}],
        ["not a dict"],
    ],
)
def test_render_chat_rejects_malformed_messages(tok, messages):
    with pytest.raises(ModelInputError):
        tok.render_chat(messages)


def test_tokenizer_config_carries_chat_template_and_eos(tiny):
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in config["chat_template"]


def test_missing_tokenizer_json_raises_load_error_naming_it(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_tokenizer_json_raises_load_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
