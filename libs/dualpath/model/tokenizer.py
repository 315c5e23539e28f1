"""``Tokenizer``: a ``tokenizer.json`` (Hugging Face ``tokenizers``) plus the checkpoint's chat template.

The serving path re-tokenizes the whole conversation every turn and relies on the ids of
earlier turns being reproduced exactly (that is what makes their KV blocks hits), so
``encode`` never adds special tokens of its own and ``render_chat`` is a pure function of
the messages. Chat messages are rendered with the checkpoint's own Jinja template
(``dualpath.chat.template``; ChatML only when the checkpoint has none).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from dualpath.chat.errors import ChatError
from dualpath.chat.template import ChatTemplate
from dualpath.model.errors import ModelInputError, ModelLoadError

__all__ = ["EOS_NAMES", "Tokenizer"]

# End-of-turn / end-of-text names of the Qwen2 (ChatML) and Llama families.
EOS_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")


class Tokenizer:
    """Text <-> token ids for one checkpoint, and rendering of chat messages with its template.

    Special tokens such as ``<|im_start|>`` are matched as single tokens wherever they
    appear in the text given to ``encode``.
    """

    def __init__(
        self, tokenizer: HFTokenizer, *, eos_token_ids: frozenset[int], chat_template: ChatTemplate | None = None, path: Path | None = None
    ) -> None:
        self._tok = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template or ChatTemplate.from_dir(Path("/nonexistent"))
        self.path = path  # the checkpoint directory (None: built in memory)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``<path>/tokenizer.json``.

        EOS ids are the special tokens named in ``EOS_NAMES`` plus the ``eos_token`` /
        ``eos_token_id`` of ``tokenizer_config.json``, ``generation_config.json`` and
        ``config.json`` where present.

        The chat template: see ``dualpath.chat.template.ChatTemplate.from_dir``.

        Raises:
            ModelLoadError: ``tokenizer.json`` missing or unparsable, one of the optional
                JSON files present but not a JSON object, or a chat template that does not
                compile.
        """
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(file, "tokenizer.json not found")
        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises a bare Exception on bad JSON
            raise ModelLoadError(file, f"cannot load tokenizer.json: {exc}") from None
        # Only added special tokens count: in some vocabularies "</s>" is ordinary text.
        specials = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        eos: set[int] = {specials[name] for name in EOS_NAMES if name in specials}
        tok_config = _optional_json(path / "tokenizer_config.json")
        name = tok_config.get("eos_token")
        if isinstance(name, dict):  # older files store an AddedToken object
            name = name.get("content")
        if isinstance(name, str) and (i := tok.token_to_id(name)) is not None:
            eos.add(i)
        for extra in ("generation_config.json", "config.json"):
            value = _optional_json(path / extra).get("eos_token_id")
            eos.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
        try:
            template = ChatTemplate.from_dir(path)
        except ChatError as exc:
            raise ModelLoadError(path / "tokenizer_config.json", exc.message) from None
        return cls(tok, eos_token_ids=frozenset(eos), chat_template=template, path=path)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS/EOS or other special tokens are added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, leaving out special tokens.

        Ids past the tokenizer's vocabulary (a model's padded embedding rows) decode to
        nothing, as in transformers.

        Raises:
            ModelInputError: an id is negative.
        """
        ids = [int(i) for i in ids]
        if any(i < 0 for i in ids):
            raise ModelInputError("negative token id")
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry (e.g. ``"<|im_end|>"``), or ``None``."""
        return self._tok.token_to_id(token)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *, tools: list[dict] | None = None, **kwargs: Any
    ) -> str:
        """Prompt text of ``messages`` rendered with the checkpoint's chat template.

        Content is a string, ``None`` (rendered as empty text, except on an assistant turn
        carrying ``tool_calls``, where the template sees ``None``) or a list of
        ``{"type": "text", "text": ...}`` parts, which are concatenated. ``tools`` and
        ``kwargs`` are passed to the template (HF's ``apply_chat_template`` semantics).

        Raises:
            ModelInputError: a message is not a dict with a string ``role``, its content is
                of another type or holds a non-text part, or the template refuses the messages.
        """
        chat = []
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ModelInputError(f"message {index} needs a string 'role'")
            text = _content_text(message.get("content"), index)
            keep_none = message.get("content") is None and message.get("role") == "assistant" and bool(message.get("tool_calls"))
            chat.append({**message, "content": None if keep_none else text})
        try:
            return self.chat_template.render(chat, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
        except ChatError as exc:
            raise ModelInputError(exc.message) from None


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ModelInputError(f"message {index}: only text content parts are supported, got {part!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise ModelInputError(f"message {index}: content must be a string or a list of text parts")


def _optional_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(file, f"cannot read {file.name}: {exc}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(file, f"{file.name} is not a JSON object")
    return value
