"""What both engine services set up: the model, the engine's data plane, block format, reports."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dualpath.config import EmulationConfig, ModelConfigSpec, NodeConfig
from dualpath.engine.dataplane import EngineDataPlane
from dualpath.engine.decoder import EngineDecoder, StepObserver
from dualpath.engine.layout import SlotLayout
from dualpath.kv.block import KV_LAYOUTS
from dualpath.model import Decoder, Tokenizer
from dualpath.model.config import dtype_from_name
from dualpath.model.sampling import warm_grammar_vocabulary
from dualpath.testbed.profile import cnic_prefix
from dualpath.transfer import MemoryRegion, create_transport
from dualpath.transfer.nic import DuplexNic, NicDirectory

if TYPE_CHECKING:
    from dualpath.testbed import ModeledDecoder

__all__ = ["EngineSetup", "FinishedReports", "build_engine", "dtype_name", "read_path_name"]

_READ_PATH_NAMES = {1: "pe", 2: "de", 3: "none", 0: "auto"}


def read_path_name(value: int) -> str:
    return _READ_PATH_NAMES.get(int(value), str(value))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class FinishedReports:
    """The ``(request, attempt)`` pairs an engine's report names as finished: those finished
    since the last report and those of the ``repeat - 1`` reports before it. A report is
    published at most once and the scheduler ignores a finish it already took, so a lost
    report then loses no finish (the scheduler would retry a prefill it then finds missing
    from the engine's ``holding``, or hold a decode's charges forever)."""

    def __init__(self, repeat: int = 3) -> None:
        self._earlier: deque[list[tuple[str, int]]] = deque(maxlen=repeat - 1)

    def name(self, done: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """The pairs this report names: the earlier reports' and ``done``, oldest first."""
        named = [pair for earlier in self._earlier for pair in earlier]
        named += done
        self._earlier.append(done)
        return named


@dataclass(slots=True, kw_only=True)
class EngineSetup:
    decoder: EngineDecoder  # the torch decoder, or the testbed's ModeledDecoder
    layout: SlotLayout
    dataplane: EngineDataPlane
    dtype: str
    model_name: str
    eos_ids: frozenset[int]
    oracle: bool = False
    model_dir: str = ""  # the checkpoint directory: its tokenizer is the vocabulary of structured-output grammars
    nic: DuplexNic | None = None  # the GPU's emulated full-duplex compute NIC (testbed); ``acquire`` = an H2D/D2H
    observer: StepObserver | None = None  # told about a decode engine's loop (testbed: host time per step)

    async def close(self) -> None:
        await self.dataplane.close()
        if self.nic is not None:
            self.nic.close()


def _modeled(emu: EmulationConfig, role: str, vocab_size: int) -> tuple[ModeledDecoder, StepObserver | None]:
    """The testbed's decoder (the cost model's time, no math) and, for a decode engine, the
    observer that measures its host time per step beyond the modeled GPU's."""
    from dualpath.cost import cost_model
    from dualpath.testbed import HostPerStep, ModeledDecoder, scaled_bytes_per_token_layer

    cost = cost_model(emu.target, emu.gpu)
    bpt = scaled_bytes_per_token_layer(cost.target.kv_bytes_per_token_layer, emu.scale)
    decoder = ModeledDecoder(cost, role=role, vocab_size=vocab_size, bytes_per_token_layer=bpt, slowdown=emu.slowdown)
    return decoder, (HostPerStep(lambda: decoder.modeled_s) if role == "decode" else None)


async def build_engine(
    *,
    engine_id: str,
    namespace: str,
    model: ModelConfigSpec,
    node: NodeConfig,
    window_mb: int,
    emu: EmulationConfig | None = None,
    role: str = "prefill",
) -> EngineSetup:
    """Load the model (or its cost model) and open the engine's data plane (its own region +
    node-local and remote transports, through an emulated CNIC when the testbed sets one)."""
    emu = emu or EmulationConfig()
    tokenizer = Tokenizer.from_dir(model.model)
    decoder: EngineDecoder
    modeled: ModeledDecoder | None = None
    observer: StepObserver | None = None
    if emu.modeled:
        modeled, observer = _modeled(emu, role, tokenizer.vocab_size)
        decoder = modeled
    else:
        dtype = dtype_from_name(model.dtype) if model.dtype else None
        decoder = Decoder.load(model.model, device=model.device, dtype=dtype)
        # structured outputs' vocabulary, built now rather than in the engine loop
        await warm_grammar_vocabulary(model.model, decoder.config.vocab_size)
    layout = SlotLayout(
        layers=decoder.num_layers,
        block_tokens=model.block_tokens,
        bytes_per_token_layer=decoder.config.kv_bytes_per_token_layer(decoder.dtype),
        kv_layout=KV_LAYOUTS[decoder.kv_spec.kind],
    )
    nic = emu.profile().cnic(namespace, engine_id, one_class=emu.nic_classes == 1) if emu.cnic_gbps else None  # the GPU's CNIC
    if nic is not None and modeled is not None and emu.model_traffic != "off":  # MoE all-to-all on the CNIC (testbed)
        from dualpath.testbed.collectives import attach_model_traffic

        attach_model_traffic(modeled, nic, emu)
    region = MemoryRegion(f"{namespace}-{engine_id}-win", window_mb << 20)
    local = create_transport("shm", node_id=node.node_id, nic=nic)
    remote = create_transport(node.transport, node_id=node.node_id, host=node.data_host, nic=nic, data_tls=node.data_tls_config())
    await local.start()
    await remote.start()
    # Testbed: every node is on this host, so shared memory carries every hop while the
    # emulated NICs at both ends charge the modeled link (host transport costs no modeled time).
    dp = EngineDataPlane(
        node_id=node.node_id,
        region=region,
        local=local,
        remote=remote,
        peers=NicDirectory(cnic_prefix(namespace)) if nic else None,
        same_host=nic is not None,
    )
    name = model.model_name or Path(model.model).resolve().name
    return EngineSetup(
        decoder=decoder,
        layout=layout,
        dataplane=dp,
        dtype=dtype_name(decoder.dtype),
        model_name=name,
        eos_ids=frozenset(tokenizer.eos_token_ids),
        oracle=emu.oracle,
        model_dir=str(model.model),
        nic=nic,
        observer=observer,
    )
