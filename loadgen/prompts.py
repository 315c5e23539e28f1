"""Prompt text of a known token length, for agents whose trajectories hold only lengths.

Text comes from a fixed corpus (1 MiB of pronounceable pseudo-words separated by spaces,
built once per process from a constant seed). A segment is a slice of the corpus that
starts at a word boundary (so it begins with a space and never merges with the text
before it) at an offset drawn from the agent's own seeded stream. An agent's first
segment starts with a tag naming the agent (`` agent<n>``), so no two agents share a
prompt prefix however many there are. Slicing costs microseconds, which keeps text
generation off the measured path of other agents.

Token counts:

* with a tokenizer (``--tokenizer DIR`` holding a Hugging Face ``tokenizer.json``) the
  corpus is encoded once and a segment of ``n`` tokens is the text of ``n`` consecutive
  corpus tokens: exact for tokenizers that split on whitespace before merging
  (byte-level BPE, char/byte-level models), which is what the joins rely on too;
* without one, 1 token is taken as 4 characters (the usual English BPE average), so a
  segment of ``n`` tokens is ``4 n`` characters. Servers report the real prompt length
  in ``usage.prompt_tokens``, and reports show it next to the intended length.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from loadgen.errors import TokenizerError

__all__ = ["PromptText", "CHARS_PER_TOKEN"]

CHARS_PER_TOKEN = 4
_CORPUS_CHARS = 1 << 20  # without a tokenizer; a quarter of it with one (encoding costs ~1 s/MiB)
_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def _corpus(chars: int) -> str:
    """Pseudo-words from a fixed seed: the same corpus in every process."""
    rng = random.Random(20260221)
    vocab = sorted(
        {"".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.choice((1, 2, 2, 3, 3, 4)))) for _ in range(4096)}
    )
    words = np.array(vocab)[np.random.default_rng(20260221).integers(0, len(vocab), size=chars // 4)]
    text = " " + " ".join(words.tolist())
    return text[:chars] if len(text) >= chars else (text * (chars // len(text) + 1))[:chars]


class PromptText:
    """Builds text segments of a requested token length.

    Raises TokenizerError from the constructor when ``tokenizer_dir`` has no loadable
    ``tokenizer.json``.
    """

    def __init__(self, tokenizer_dir: str | Path | None = None) -> None:
        self.tokenizer = None if tokenizer_dir is None else _load_tokenizer(Path(tokenizer_dir))
        self.corpus = _corpus(_CORPUS_CHARS if self.tokenizer is None else _CORPUS_CHARS // 4)
        if self.tokenizer is None:
            # Token i covers corpus[4i : 4i + 4]; a segment may start at any space.
            self.ends = np.arange(1, len(self.corpus) // CHARS_PER_TOKEN + 1) * CHARS_PER_TOKEN
            spaces = np.flatnonzero(np.frombuffer(self.corpus.encode(), np.uint8) == 32)
            self.starts_at_space = spaces  # char offsets
        else:
            enc = self.tokenizer.encode(self.corpus, add_special_tokens=False)
            offsets = np.array(enc.offsets, dtype=np.int64)  # [tokens, 2] char offsets
            self.token_starts, self.ends = offsets[:, 0], offsets[:, 1]
            first_chars = np.frombuffer(self.corpus.encode(), np.uint8)[self.token_starts]
            self.starts_at_space = np.flatnonzero(first_chars == 32)  # token indices

    def agent_rng(self, seed: int, agent: int) -> random.Random:
        """The stream of one agent (independent of every other agent's)."""
        return random.Random(f"{seed}:{agent}")

    def count(self, text: str) -> int:
        """Tokens in ``text``: exact with a tokenizer, else ``ceil(chars / 4)``."""
        if self.tokenizer is None:
            return -(-len(text) // CHARS_PER_TOKEN)
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def first_segment(self, rng: random.Random, agent: int, tokens: int) -> str:
        """An agent's first segment: its tag, then corpus text; ``tokens`` long in all."""
        tag = f" agent{agent}"
        used = self.count(tag)
        if tokens <= used:
            return tag[: tokens * CHARS_PER_TOKEN] if self.tokenizer is None else self._cut(tag, tokens)
        return tag + self.segment(rng, tokens - used)

    def segment(self, rng: random.Random, tokens: int) -> str:
        """Exactly ``tokens`` tokens of corpus text starting with a space ("" for 0)."""
        parts = []
        while tokens > 0:
            take = min(tokens, len(self.ends) // 2)
            parts.append(self._slice(rng, take))
            tokens -= take
        return "".join(parts)

    def _slice(self, rng: random.Random, tokens: int) -> str:
        # Starting points are word starts from which `tokens` more tokens exist.
        if self.tokenizer is None:
            chars = tokens * CHARS_PER_TOKEN
            limit = int(np.searchsorted(self.starts_at_space, len(self.corpus) - chars, side="right"))
            start = int(self.starts_at_space[rng.randrange(max(1, limit))])
            return self.corpus[start : start + chars]
        limit = int(np.searchsorted(self.starts_at_space, len(self.ends) - tokens, side="right"))
        first = int(self.starts_at_space[rng.randrange(max(1, limit))])
        return self.corpus[int(self.token_starts[first]) : int(self.ends[first + tokens - 1])]

    def _cut(self, text: str, tokens: int) -> str:
        assert self.tokenizer is not None  # only called with a tokenizer
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids[:tokens]
        return self.tokenizer.decode(ids)


def _load_tokenizer(path: Path):
    from tokenizers import Tokenizer  # imported lazily: only --tokenizer needs it

    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise TokenizerError(str(path), "no tokenizer.json there")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the tokenizers library raises bare Exception subclasses
        raise TokenizerError(str(path), str(exc)) from None
