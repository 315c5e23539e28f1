"""The torch decoder (Qwen2/Llama family), its tokenizer, sampling, and the tiny-model maker.

- ``ModelConfig``      architecture fields of ``config.json``
- ``Decoder``          layer-wise forward over externally supplied per-layer KV
- ``pack_kv`` / ``unpack_kv``  the per-token ``[2, kv_heads, head_dim]`` (K then V) layout
- ``Tokenizer``        ``tokenizer.json`` + ChatML rendering
- ``sample``           greedy / temperature / top-k / top-p with logprobs
- ``greedy_generate``  reference generation loop used to check engines
- ``make_tiny_model``  a small random checkpoint built for exactness tests
"""

from dualpath.model.config import ModelConfig, RopeScaling
from dualpath.model.decoder import Decoder, PastKV
from dualpath.model.errors import ModelError, ModelInputError, ModelLoadError
from dualpath.model.generate import GreedyResult, greedy_generate
from dualpath.model.kvlayout import pack_kv, unpack_kv
from dualpath.model.sampling import SampledToken, SamplingParams, sample
from dualpath.model.tiny import GENERATED_ALPHABET, make_tiny_model
from dualpath.model.tokenizer import Tokenizer

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
