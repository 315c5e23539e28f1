"""``Tokenizer``: a Hugging Face ``tokenizer.json`` (through the ``tokenizers`` library) plus chat rendering.

Chat prompts use the ChatML layout that Qwen2 models are trained on; special tokens written
in the text (``<|im_start|>`` ...) encode as single ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Tokenizer as HFTokenizer

from dualpath.model.errors import ModelLoadError

__all__ = ["Tokenizer"]

_EOS_NAMES = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>", "<|end_of_text|>")


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type", "text") == "text")


class Tokenizer:
    def __init__(self, tok: HFTokenizer, eos_ids: frozenset[int]) -> None:
        self._tok = tok
        self.eos_token_ids = eos_ids
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load ``tokenizer.json`` (and the eos token from ``tokenizer_config.json`` if present).

        Raises:
            ModelLoadError: no or unreadable ``tokenizer.json``.
        """
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise ModelLoadError(file, "missing tokenizer.json")
        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as exc:  # noqa: BLE001 - the library raises a bare Exception
            raise ModelLoadError(file, f"unreadable: {exc}") from None
        names = set(_EOS_NAMES)
        cfg = path / "tokenizer_config.json"
        if cfg.exists():
            eos = json.loads(cfg.read_text()).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                names.add(eos)
        ids = frozenset(i for i in (tok.token_to_id(n) for n in names) if i is not None)
        return cls(tok, ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added; special tokens in the text are single ids)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens skipped."""
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then the assistant prompt."""
        parts = [f"<|im_start|>{m['role']}\n{_text(m.get('content'))}<|im_end|>\n" for m in messages]
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)
