"""The torch decoder (Qwen2/Llama family), its tokenizer, sampling, and the tiny-model maker.

- ``ModelConfig``      architecture fields of ``config.json``
- ``Decoder``          layer-wise forward over externally supplied per-layer KV
- ``pack_kv`` / ``unpack_kv``  the per-token ``[2, kv_heads, head_dim]`` (K then V) layout
- ``Tokenizer``        ``tokenizer.json`` + ChatML rendering
- ``sample``           greedy / temperature / top-k / top-p with logprobs
- ``greedy_generate``  reference generation loop used to check engines
- ``make_tiny_model``  a small random checkpoint built for exactness tests
"""

from importlib import import_module

# Lazy exports (PEP 562): control services (the gateway needs only ``Tokenizer`` and
# ``ModelConfig``) import this package without pulling in torch.
_HOME = {
    "ModelConfig": "config",
    "RopeScaling": "config",
    "Decoder": "decoder",
    "PastKV": "decoder",
    "ModelError": "errors",
    "ModelInputError": "errors",
    "ModelLoadError": "errors",
    "GreedyResult": "generate",
    "greedy_generate": "generate",
    "pack_kv": "kvlayout",
    "unpack_kv": "kvlayout",
    "SampledToken": "sampling",
    "SamplingParams": "sampling",
    "sample": "sampling",
    "GENERATED_ALPHABET": "tiny",
    "make_tiny_model": "tiny",
    "Tokenizer": "tokenizer",
}


def __getattr__(name: str):
    if name in _HOME:
        value = getattr(import_module(f"dualpath.model.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dualpath.model' has no attribute {name!r}")


__all__ = [
    "GENERATED_ALPHABET",
    "Decoder",
    "GreedyResult",
    "ModelConfig",
    "ModelError",
    "ModelInputError",
    "ModelLoadError",
    "PastKV",
    "RopeScaling",
    "SampledToken",
    "SamplingParams",
    "Tokenizer",
    "greedy_generate",
    "make_tiny_model",
    "pack_kv",
    "sample",
    "unpack_kv",
]
