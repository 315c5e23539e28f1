"""Incremental detokenization with stop strings.

Decodes the generated ids as they arrive and releases only text that can no longer change:
a trailing U+FFFD (an incomplete UTF-8 sequence) and any suffix that could still grow into a
stop string are held back until the next token decides.
"""

from __future__ import annotations

__all__ = ["Detokenizer"]

_CONTEXT_IDS = 6


class Detokenizer:
    def __init__(self, tokenizer, stops: list[str]) -> None:
        self._tok = tokenizer
        self._stops = stops
        self.ids: list[int] = []
        self.emitted = ""  # text already released
        self.stopped = False
        self.matched = ""  # the stop string that stopped the answer
        self._stable_ids = 0  # ids[:_stable_ids] decode to _stable_text and end on a clean boundary
        self._stable_text = ""

    def _decode(self) -> str:
        """Text of all ids, decoding only the tail since the last clean boundary (plus a few ids
        of context, as tokenizers with leading-space rules decode a piece differently alone):
        per-token cost stays constant instead of growing with the answer."""
        ctx = max(0, self._stable_ids - _CONTEXT_IDS)
        head = self._tok.decode(self.ids[ctx : self._stable_ids])
        full = self._tok.decode(self.ids[ctx:])
        text = self._stable_text + full[len(head) :] if full.startswith(head) else self._tok.decode(self.ids)
        if not text.endswith("\ufffd"):
            self._stable_ids, self._stable_text = len(self.ids), text
        return text

    def _hold(self, text: str) -> int:
        """How many trailing characters of ``text`` must wait for more tokens."""
        hold = 1 if text.endswith("\ufffd") else 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return hold

    def add(self, ids: list[int]) -> str:
        """Add tokens; return the newly released text (empty once a stop string matched)."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        text = self._decode()
        for s in self._stops:
            cut = text.find(s, max(0, len(self.emitted) - len(s)))
            if cut != -1:
                self.stopped, self.matched = True, s
                delta = text[len(self.emitted) : cut] if cut >= len(self.emitted) else ""
                self.emitted += delta
                return delta
        ready = len(text) - self._hold(text)
        if ready <= len(self.emitted):
            return ""
        delta = text[len(self.emitted) : ready]
        self.emitted = text[:ready]
        return delta

    def flush(self) -> str:
        """Release everything held back (the request finished without a stop string)."""
        if self.stopped:
            return ""
        text = self._decode()
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta
