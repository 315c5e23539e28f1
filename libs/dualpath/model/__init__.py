"""The model: HF-layout checkpoints (config, safetensors, tokenizer), the torch decoder with
layer-wise forward over externally supplied KV, sampling, and the tiny-checkpoint maker."""

from dualpath.model.config import ModelConfig
from dualpath.model.decoder import Decoder
from dualpath.model.errors import ModelError, ModelLoadError
from dualpath.model.kvlayout import pack_kv, unpack_kv
from dualpath.model.sampling import SampledToken, SamplingParams, sample
from dualpath.model.tiny import make_tiny_model
from dualpath.model.tokenizer import Tokenizer

__all__ = ["Decoder", "ModelConfig", "ModelError", "ModelLoadError", "SampledToken", "SamplingParams", "Tokenizer",
           "make_tiny_model", "pack_kv", "sample", "unpack_kv"]
