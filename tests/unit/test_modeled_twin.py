"""A served checkpoint and its modeled twin (``--target DIR/config.json``) agree on the KV a
token keeps: the engine sizes its KV memory, blocks and transfers from the same number."""

from __future__ import annotations

import pytest

from dualpath.cli import main as dualpath
from dualpath.config import EmulationConfig
from dualpath.engine.common import _modeled
from dualpath.model import Decoder
from dualpath.model.config import dtype_from_name
from dualpath.model.tiny import ARCHS


def _bytes_per_token(decoder) -> int:
    """What the engine's ``SlotLayout`` holds per token over all layers (``build_engine``)."""
    return decoder.config.kv_bytes_per_token_layer(decoder.dtype) * decoder.num_layers


@pytest.mark.parametrize(("arch", "dtype"), [(a, "float32") for a in ARCHS] + [("deepseek_v3", "bfloat16"), ("qwen3", "bfloat16")])
def test_a_served_tiny_checkpoint_and_its_modeled_twin_keep_the_same_kv_bytes_per_token(tmp_path, arch, dtype):
    ckpt = tmp_path / arch
    assert dualpath(["make-tiny-model", str(ckpt), "--arch", arch, "--layers", "3", "--dtype", dtype]) == 0
    # served in the checkpoint's dtype (on CPU the engine's default would be float32)
    served = Decoder.load(str(ckpt), device="cpu", dtype=dtype_from_name(dtype))
    twin, _observer = _modeled(EmulationConfig(compute="modeled", target=str(ckpt / "config.json"), scale=1.0), "prefill", 512)
    assert twin.num_layers == served.num_layers == 3
    assert _bytes_per_token(twin) == _bytes_per_token(served) == twin.cost.kv_bytes(1)
    width = 32 + 8 if arch.startswith("deepseek") else 2 * 2 * 16  # MLA: latent + rotary key; GQA: K and V of 2 heads x 16
    assert _bytes_per_token(served) == 3 * width * served.dtype.itemsize
