"""What both engine services set up: the model, the engine's data plane, block format, reports."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dualpath.config import ModelConfigSpec, NodeConfig
from dualpath.engine.dataplane import EngineDataPlane
from dualpath.engine.layout import SlotLayout
from dualpath.model import Decoder, Tokenizer
from dualpath.model.config import dtype_from_name
from dualpath.transfer import MemoryRegion, create_transport

__all__ = ["EngineSetup", "build_engine", "dtype_name", "read_path_name"]

_READ_PATH_NAMES = {1: "pe", 2: "de", 3: "none", 0: "auto"}


def read_path_name(value: int) -> str:
    return _READ_PATH_NAMES.get(int(value), str(value))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(slots=True, kw_only=True)
class EngineSetup:
    decoder: Decoder
    layout: SlotLayout
    dataplane: EngineDataPlane
    dtype: str
    model_name: str
    eos_ids: frozenset[int]

    async def close(self) -> None:
        await self.dataplane.close()


async def build_engine(*, engine_id: str, namespace: str, model: ModelConfigSpec, node: NodeConfig, window_mb: int) -> EngineSetup:
    """Load the model and open the engine's data plane (its own region + node-local and remote transports)."""
    dtype = dtype_from_name(model.dtype) if model.dtype else None
    decoder = Decoder.load(model.model, device=model.device, dtype=dtype)
    layout = SlotLayout(layers=decoder.num_layers, block_tokens=model.block_tokens,
                        bytes_per_token_layer=decoder.config.kv_bytes_per_token_layer(decoder.dtype))
    region = MemoryRegion(f"{namespace}-{engine_id}-win", window_mb << 20)
    local = create_transport("shm", node_id=node.node_id)
    remote = create_transport(node.transport, node_id=node.node_id, host=node.data_host)
    await local.start()
    await remote.start()
    dp = EngineDataPlane(node_id=node.node_id, region=region, local=local, remote=remote)
    name = model.model_name or Path(model.model).resolve().name
    eos = frozenset(Tokenizer.from_dir(model.model).eos_token_ids)
    return EngineSetup(decoder=decoder, layout=layout, dataplane=dp, dtype=dtype_name(decoder.dtype), model_name=name,
                       eos_ids=eos)
