"""Prompt text of exact token lengths, and the request bodies built from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.conversation import Conversation
from loadgen.errors import TokenizerError
from loadgen.prompts import PromptText


def _byte_level(path: Path) -> Path:
    """A tokenizer like the tiny test model's: one token per byte, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return path


def _trained_bpe(path: Path) -> Path:
    """A real BPE with merges (GPT-2 style byte-level pre-tokenization), trained on the fly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([PromptText().corpus[:200_000]], trainer=trainer)
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module", params=["byte-level", "bpe"])
def exact(request, tmp_path_factory) -> PromptText:
    """Prompt text sized by a real tokenizer (built once per module: encoding the corpus takes ~0.5 s)."""
    root = tmp_path_factory.mktemp("tok") / request.param
    return PromptText(_byte_level(root) if request.param == "byte-level" else _trained_bpe(root))


def test_without_a_tokenizer_a_token_is_four_characters_of_words() -> None:
    p = PromptText()
    text = p.segment(p.agent_rng(0, 0), 150)
    assert len(text) == 600 and text.startswith(" ")
    assert set(text) <= set(" abcdefghijklmnopqrstuvwxyz")
    assert p.count(text) == 150


@pytest.mark.parametrize("tokens", [1, 7, 600, 5000])
def test_with_a_tokenizer_segments_have_exactly_the_requested_tokens(exact: PromptText, tokens: int) -> None:
    p = exact
    rng = p.agent_rng(1, 2)
    assert p.count(p.segment(rng, tokens)) == tokens
    assert p.count(p.first_segment(rng, 2, tokens)) == tokens


def test_joined_segments_count_as_the_sum_of_their_parts(exact: PromptText) -> None:
    p = exact
    rng = p.agent_rng(0, 3)
    parts = [p.first_segment(rng, 3, 120), p.segment(rng, 40), p.segment(rng, 333)]
    assert p.count("".join(parts)) == 493


def test_every_agent_gets_its_own_prefix_and_the_same_agent_the_same_text() -> None:
    p = PromptText()
    firsts = [p.first_segment(p.agent_rng(0, i), i, 50) for i in range(200)]
    assert len({f[:12] for f in firsts}) == 200  # the tag makes even short prefixes unique
    assert firsts[7].startswith(" agent7 ")
    assert p.first_segment(p.agent_rng(0, 7), 7, 50) == firsts[7]
    assert p.first_segment(p.agent_rng(1, 7), 7, 50) != firsts[7]


def test_segments_longer_than_the_corpus_are_stitched_together() -> None:
    p = PromptText()
    text = p.segment(p.agent_rng(0, 0), 400_000)  # 1.6 MB of text from a 1 MiB corpus
    assert len(text) == 1_600_000


def test_a_directory_without_tokenizer_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        PromptText(tmp_path)


def test_completions_body_holds_the_whole_history_and_asks_for_exact_lengths() -> None:
    c = Conversation(chat=False, model="m")
    c.add_system('sys "quoted"\n')
    c.add_user(" ask é")
    c.add_answer(" answer")
    c.add_user(" next")
    body = json.loads(c.body(17))
    assert body["prompt"] == 'sys "quoted"\n ask é answer next'
    assert body["max_tokens"] == body["min_tokens"] == 17 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "m"


def test_chat_body_alternates_user_and_assistant_after_the_system_prompt() -> None:
    c = Conversation(chat=True, model="m", exact=False)
    c.add_system("be brief")
    c.add_user("q1")
    c.add_answer("a1")
    c.add_user("q2")
    body = json.loads(c.body(3))
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user"]
    assert body["messages"][2]["content"] == "a1"
    assert "min_tokens" not in body and "ignore_eos" not in body and body["max_tokens"] == 3
    empty = Conversation(chat=True, model="m")
    empty.add_system("")
    empty.add_user("q")
    assert [m["role"] for m in json.loads(empty.body(1))["messages"]] == ["user"]
