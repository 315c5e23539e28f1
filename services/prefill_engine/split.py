"""The prefill engine's split read (``read_path=split``): both storage NICs read one request.

The scheduler gave the task ``read_split = [p, d]``: the PE node's traffic manager reads the
first ``p`` hit blocks into a PE buffer slot of its own, the DE node's reads the last ``d``
straight into the DE buffer slot at block ``p``, both at once. A block that is missing or
corrupt ends the hit as for any read: if the PE share comes back short, the DE share is not
used (its tokens are recomputed over it). ``BatchLayerIO`` then fetches each layer's cached
tokens from both places (``IoItem.de_from``) before the layer computes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

from dualpath.engine.layout import SlotLayout
from dualpath.protocol import messages as m
from dualpath.transfer import RegionDescriptor

__all__ = ["SplitLoad", "is_split", "load_split"]

LoadFn = Callable[[str, m.LoadRequest], Awaitable[m.LoadReply]]


@dataclass(frozen=True, slots=True, kw_only=True)
class SplitLoad:
    """What a split read left: ``hit_blocks`` usable leading blocks, the first ``pe_blocks`` of
    them in the PE buffer at ``source``/``source_offset``, the rest in the DE slot."""

    hit_blocks: int
    pe_blocks: int
    source: RegionDescriptor
    source_offset: int
    bytes_read: int

    @property
    def de_blocks(self) -> int:
        return self.hit_blocks - self.pe_blocks


def is_split(task: m.PrefillTask) -> bool:
    """True when the task's hits are to be read by both sides."""
    return len(task.read_split) == 2 and task.read_split[0] > 0 and task.read_split[1] > 0


async def load_split(task: m.PrefillTask, planned: int, layout: SlotLayout, dtype: str, load: LoadFn) -> SplitLoad:
    """Run both shares' reads of the ``planned`` hit blocks (``kv.hits.planned_hit_blocks``)
    concurrently through ``load(node, request)``; raises what it raises."""
    pe_blocks = min(task.read_split[0], planned)
    want = min(task.read_split[0] + task.read_split[1], planned)
    common: dict[str, Any] = dict(
        request_id=task.request_id,
        model_digest=task.model_digest,
        layers=layout.layers,
        bytes_per_token_layer=layout.bytes_per_token_layer,
        dtype=dtype,
        block_tokens=layout.block_tokens,
        kv_layout=layout.kv_layout,
        attempt=task.attempt,
    )
    pe_req = m.LoadRequest(hashes=task.block_hashes[:pe_blocks], allocate=True, total_blocks=pe_blocks, **common)
    de_req = m.LoadRequest(hashes=task.block_hashes[pe_blocks:want], first_block=pe_blocks, **common)
    replies: dict[str, m.LoadReply] = {}

    async def one(side: str, node: str, req: m.LoadRequest) -> None:
        replies[side] = await load(node, req)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "pe", task.prefill_node, pe_req)
        tg.start_soon(one, "de", task.decode_node, de_req)
    pe, de = replies["pe"], replies["de"]
    hit = pe.loaded if pe.loaded < pe_blocks else pe_blocks + de.loaded
    return SplitLoad(
        hit_blocks=hit,
        pe_blocks=min(pe.loaded, pe_blocks),
        source=RegionDescriptor.from_wire(pe.region),
        source_offset=pe.offset,
        bytes_read=pe.bytes_read + de.bytes_read,
    )
