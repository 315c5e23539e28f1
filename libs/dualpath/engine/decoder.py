"""What the engines need of a decoder, and of an observer of the decode loop (``typing.Protocol``).

Two decoders implement ``EngineDecoder``: the torch ``dualpath.model.Decoder`` (real math,
every awaited call in a worker thread) and the testbed's ``ModeledDecoder`` (no math, the
cost model's time slept on the event loop). The engines call only what is declared here, so
they need not know which one they hold, and mypy checks both against it.

``StepObserver`` is what the decode engine tells about its loop; the testbed attaches one
(``HostPerStep``: host time per step beyond the modeled GPU's) through ``EngineSetup``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from dualpath.model.config import KvSpec
from dualpath.model.decoder import PastKV
from dualpath.policy.intra import Predict

__all__ = ["DecoderConfig", "EngineDecoder", "LayerOut", "StepObserver"]

LayerOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (hidden [N, H], k [N, *k_shape], v [N, *v_shape])


class DecoderConfig(Protocol):
    """The slice of a model's configuration the engines read."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_position_embeddings(self) -> int: ...

    def kv_bytes_per_token_layer(self, dtype: torch.dtype) -> int:
        """Bytes of KV one token keeps per layer in ``dtype``."""
        ...


class EngineDecoder(Protocol):
    """A decoder as the prefill and decode engines drive it.

    Prefill: ``embed`` the batch's new tokens, ``forward_layer_async`` layer by layer over the
    cached KV each layer brings in, ``logits`` of the prompt-ending rows. Decode:
    ``decode_step_async`` one token per running sequence over the engine's KV memory.
    """

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of hidden states and KV."""
        ...

    @property
    def num_layers(self) -> int: ...

    @property
    def kv_spec(self) -> KvSpec:
        """What one token keeps per layer (the KV the engines move and store)."""
        ...

    @property
    def config(self) -> DecoderConfig: ...

    @property
    def compute_charged_s(self) -> float | None:
        """Compute seconds a cost model charged so far (no slow motion); None for a decoder
        that computes for real."""
        ...

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[N]`` token ids -> ``[N, H]`` hidden states."""
        ...

    def forward_layer(
        self,
        layer: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        segments: Sequence[tuple[int, int]],
        past: Sequence[PastKV],
    ) -> LayerOut:
        """Layer ``layer`` for the new tokens of several sequences (``segments[i] = (start,
        length)`` rows of ``hidden``, ``past[i]`` the cached KV of sequence ``i`` or None),
        in the calling thread."""
        ...

    async def forward_layer_async(
        self,
        layer: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        segments: Sequence[tuple[int, int]],
        past: Sequence[PastKV],
    ) -> LayerOut:
        """``forward_layer`` awaited: the event loop keeps serving the bus while it runs."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[M, H]`` -> ``[M, vocab]`` float32."""
        ...

    def decode_step(self, kvs: Sequence[torch.Tensor], kv_lens: Sequence[int], inputs: Sequence[int]) -> torch.Tensor:
        """One token per sequence, in the calling thread: ``inputs[i]`` at position
        ``kv_lens[i]`` of sequence ``i``, whose KV is ``kvs[i] [layers, heads, capacity,
        head_width]`` (``KvMemory``'s head-major layout; its first ``kv_lens[i]`` tokens valid,
        room for one more: the token's KV is written there). Returns logits ``[len(inputs), vocab]``."""
        ...

    async def decode_step_async(self, kvs: Sequence[torch.Tensor], kv_lens: Sequence[int], inputs: Sequence[int]) -> torch.Tensor:
        """``decode_step`` awaited: the event loop keeps serving the bus while it runs."""
        ...

    def prefill_time_model(self) -> Predict | None:
        """The decoder's own prediction of a prefill batch's seconds, when it has one (a
        modeled decoder: its cost model); None when the engine must measure a profile."""
        ...

    def stats(self) -> dict[str, float]:
        """Figures for the engine's report (a modeled decoder's modeled seconds and model
        traffic); empty for a decoder that computes for real."""
        ...


class StepObserver(Protocol):
    """Told about the decode engine's loop: each step's start and end, and idle waits."""

    def started(self, t: float) -> None:
        """A step starts at ``time.perf_counter()`` ``t``."""
        ...

    def ran(self, batch: int) -> None:
        """The step started last, of ``batch`` requests, and its result processing are done."""
        ...

    def idle(self) -> None:
        """The engine waits for work: the step before is not followed back to back."""
        ...

    def stats(self) -> dict[str, float]:
        """Figures for the engine's report."""
        ...
