"""``SlotLayout``: byte addresses of a request's KV inside a node buffer slot.

A slot is a run of Full Blocks, each ``[layers, block_tokens, bytes_per_token_layer]``
(the block file payload layout), so:

- block ``b`` starts at ``b * block_bytes``;
- its Layer Block for layer ``l`` is the contiguous range ``[l * layer_bytes, +layer_bytes)``
  inside it (``layer_bytes = block_tokens * bytes_per_token_layer``);
- token ``t`` of layer ``l`` lies at ``(t // bt) * block_bytes + l * layer_bytes + (t % bt) * bpt``.

Layer Blocks are views into Full Blocks: moving "layer l of tokens [s, e)" is one piece per
block touched, never a layout conversion; the full blocks' pieces are ``block_bytes`` apart,
so they go as one strided entry (``layer_strided``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SlotLayout"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotLayout:
    layers: int
    block_tokens: int
    bytes_per_token_layer: int
    kv_layout: int = 0  # what a token's bytes are (dualpath.kv.block.KV_LAYOUTS); travels with loads and persists

    @property
    def layer_bytes(self) -> int:
        return self.block_tokens * self.bytes_per_token_layer

    @property
    def block_bytes(self) -> int:
        return self.layers * self.layer_bytes

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def slot_bytes(self, tokens: int) -> int:
        return self.blocks_for(tokens) * self.block_bytes

    def layer_runs(self, layer: int, start: int, end: int) -> list[tuple[int, int, int]]:
        """Contiguous runs of layer ``layer`` for tokens ``[start, end)``.

        Returns ``(slot_offset, token_start, ntokens)`` per block touched, in token order.
        """
        runs = []
        bt, bpt = self.block_tokens, self.bytes_per_token_layer
        t = start
        while t < end:
            b, i = divmod(t, bt)
            n = min(bt - i, end - t)
            runs.append((b * self.block_bytes + layer * self.layer_bytes + i * bpt, t, n))
            t += n
        return runs

    def layer_strided(self, layer: int, start: int, end: int) -> list[tuple[int, int, int, int]]:
        """``layer_runs`` grouped into strided runs, without walking the blocks:
        ``(slot_offset, token_start, ntokens, count)`` means ``count`` runs of ``ntokens``
        tokens, ``block_bytes`` apart in the slot and consecutive in token order. At most
        three: a partial first block, the whole blocks, a partial last block."""
        bt, bpt = self.block_tokens, self.bytes_per_token_layer

        def offset(t: int) -> int:
            b, i = divmod(t, bt)
            return b * self.block_bytes + layer * self.layer_bytes + i * bpt

        out: list[tuple[int, int, int, int]] = []
        t = start
        if t < end and (t % bt or end - t < bt):  # a partial first block
            first_end = min(end, (t // bt + 1) * bt)
            out.append((offset(t), t, first_end - t, 1))
            t = first_end
        whole = (end - t) // bt if t < end else 0
        if whole:
            out.append((offset(t), t, bt, whole))
            t += whole * bt
        if t < end:
            out.append((offset(t), t, end - t, 1))
        return out
