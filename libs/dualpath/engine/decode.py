"""The decode engine's KV memory and its continuous-batching decode step (torch, no I/O).

Each running sequence owns a KV tensor ``[layers, heads, capacity, head_width]`` on the
compute device (its share of "HBM"), grown a block at a time: a token's ``width`` values per
layer (as the model's ``KvSpec`` lays them out: K then V, or MLA's latent then rotary key)
split into ``KvSpec.rows``, each row's tokens back to back (head-major, so that attention
reads a head's keys as one run). ``KvMemory.tokens`` views it token by token: blocks of
storage (token-major ``[layers, T, width]``) are copied in and out through that view, their
bytes unchanged. A step feeds every running
sequence's last token through all layers at once (linear layers batched, attention per
sequence over its own cache) and returns the logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dualpath.engine.decoder import EngineDecoder
from dualpath.model.config import KvSpec

__all__ = ["DecodeSequence", "KvMemory", "decode_step", "decode_step_async"]


@dataclass(slots=True, kw_only=True)
class DecodeSequence:
    """A sequence being decoded: ``tokens`` (prompt + generated) and the KV of ``kv_len`` of them."""

    request_id: str
    tokens: list[int]
    kv: torch.Tensor  # [layers, heads, capacity, head_width] (KvSpec.rows)
    kv_len: int
    generated: list[int] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return self.kv.shape[2]


class KvMemory:
    """Allocates per-sequence KV tensors within a token budget (the engine's HBM capacity)."""

    def __init__(
        self,
        *,
        layers: int,
        spec: KvSpec,
        dtype: torch.dtype,
        device: torch.device,
        capacity_tokens: int,
        block_tokens: int,
    ) -> None:
        self.layers, self.spec = layers, spec
        self.dtype, self.device = dtype, device
        self.capacity_tokens = capacity_tokens
        self.block_tokens = block_tokens
        self.used_tokens = 0

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.used_tokens

    def _round(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens) * self.block_tokens

    def allocate(self, tokens: int) -> torch.Tensor:
        """A zeroed KV tensor ``[layers, heads, capacity, head_width]`` for ``tokens`` (rounded
        up to whole blocks).

        Raises:
            MemoryError: the budget has no room (the scheduler should not have sent it).
        """
        n = self._round(max(tokens, 1))
        if n > self.free_tokens:
            raise MemoryError(f"KV memory full: need {n} tokens, {self.free_tokens} free of {self.capacity_tokens}")
        self.used_tokens += n
        heads, head_width = self.spec.rows
        return torch.zeros((self.layers, heads, n, head_width), dtype=self.dtype, device=self.device)

    def tokens(self, kv: torch.Tensor) -> torch.Tensor:
        """``kv`` (from ``allocate``) token by token: a view ``[layers, capacity, heads,
        head_width]``, which token-major KV ``[layers, T, width]`` matches as
        ``spec.as_rows(...)`` (copy either way; the bytes of a token are the same)."""
        return kv.transpose(1, 2)

    def grow(self, seq: DecodeSequence, tokens: int) -> None:
        """Make room for ``tokens`` in ``seq`` (adds whole blocks, copies the used part).

        Only the added blocks count against the budget: the copy is an implementation detail
        of contiguous per-sequence tensors (paged KV would not copy).

        Raises:
            MemoryError: the budget has no room for the added blocks.
        """
        if tokens <= seq.capacity:
            return
        old = seq.capacity
        self.release(seq.kv)
        try:
            new = self.allocate(max(tokens, old + self.block_tokens))
        except MemoryError:
            self.used_tokens += old  # unchanged
            raise
        new[:, :, : seq.kv_len].copy_(seq.kv[:, :, : seq.kv_len])
        seq.kv = new

    def release(self, kv: torch.Tensor) -> None:
        self.used_tokens -= kv.shape[2]


async def decode_step_async(decoder: EngineDecoder, memory: KvMemory, seqs: list[DecodeSequence], inputs: list[int]) -> torch.Tensor:
    """``decode_step`` awaited: the decoder's step runs as it says (``EngineDecoder.decode_step_async``:
    the torch decoder's in a worker thread, a modeled one's time awaited on the loop).

    Raises:
        MemoryError: a sequence's next block does not fit the KV memory.
    """
    _make_room(memory, seqs)
    logits = await decoder.decode_step_async([s.kv for s in seqs], [s.kv_len for s in seqs], inputs)
    for s in seqs:
        s.kv_len += 1
    return logits


def decode_step(decoder: EngineDecoder, memory: KvMemory, seqs: list[DecodeSequence], inputs: list[int]) -> torch.Tensor:
    """Run one token per sequence (``inputs[i]`` at position ``seqs[i].kv_len``) through the model.

    Appends each token's KV to its sequence and returns logits ``[len(seqs), vocab]``.

    Raises:
        MemoryError: a sequence's next block does not fit the KV memory.
    """
    _make_room(memory, seqs)
    logits = decoder.decode_step([s.kv for s in seqs], [s.kv_len for s in seqs], inputs)
    for s in seqs:
        s.kv_len += 1
    return logits


def _make_room(memory: KvMemory, seqs: list[DecodeSequence]) -> None:
    """Grow each sequence's KV to hold one more token (a block at a time)."""
    for s in seqs:
        memory.grow(s, s.kv_len + 1)
