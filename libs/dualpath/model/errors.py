"""Errors raised by the model package.

Hierarchy::

    ModelError
    ├── ModelLoadError    a checkpoint or tokenizer directory cannot be used
    └── ModelInputError   (also a ValueError) arguments to the decoder, sampler or
                          tokenizer do not fit the model

A ``ModelLoadError`` happens once, at load time, and names the file and the field or
tensor at fault. A ``ModelInputError`` is a caller bug or bad client input; it is raised
before any computation so nothing is half-done.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["ModelError", "ModelInputError", "ModelLoadError"]


class ModelError(Exception):
    """Base class of every error raised by ``dualpath.model``."""


class ModelLoadError(ModelError):
    """Raised when a checkpoint directory is unusable.

    Raised by ``ModelConfig.from_dir`` (``config.json`` missing, not JSON, a required
    field missing or of the wrong type, an unsupported architecture), by ``Decoder.load``
    (no ``*.safetensors`` file, a shard named by the index missing, a tensor missing or of
    the wrong shape) and by ``Tokenizer.from_dir`` (``tokenizer.json`` missing or invalid).
    ``path`` is the file at fault; ``detail`` names the field or tensor.
    """

    def __init__(self, path: Path | str, detail: str) -> None:
        self.path = Path(path)
        self.detail = detail
        super().__init__(f"{self.path}: {detail}")


class ModelInputError(ModelError, ValueError):
    """Raised when arguments do not fit the model.

    Examples: a token id outside the vocabulary, a layer index out of range, segments
    that do not tile the hidden batch, cached KV of the wrong shape or dtype, sampling
    parameters out of range, a chat message without a role or with non-text content.
    """
