"""The paper's two scheduling thresholds, in tokens (§6.1):

- α: tokens a node can read from storage in 3 s. A node whose read queue is at most α
  keeps its storage NIC busy for no more than 3 s, so new work there is read soon.
- β: tokens one GPU computes in 5 s. A prefill engine holding more is overloaded and
  skipped.

Read admission (beyond the paper): ``hold_tokens``, ``read_hold_percent`` of α (by default
5%: 0.15 s of the storage NIC). DualPath places a request only on a read node whose open
reads (``NodeState.reads_open``) are below it and keeps the rest in the scheduler's queue,
so the queue's order (``CoreConfig.history_credit``), not the storage NIC's FIFO, decides
which waiting request reads next, and a read shares its NIC with few others.

Both derive from the hardware profile / cost model and may be overridden directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dualpath.policy.errors import InvalidThresholdError

__all__ = ["ALPHA_SECONDS", "BETA_SECONDS", "READ_HOLD_PERCENT", "Thresholds", "alpha_tokens", "beta_tokens"]

ALPHA_SECONDS = 3.0
BETA_SECONDS = 5.0
READ_HOLD_PERCENT = 5  # read admission: open reads per node below 5% of α (0.15 s of its storage NIC)


def _positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise InvalidThresholdError(name, value)


def alpha_tokens(snic_bytes_per_s: float, kv_bytes_per_token: int, seconds: float = ALPHA_SECONDS) -> int:
    """α: tokens of KV-cache a node reads from storage in ``seconds`` through a storage NIC
    of ``snic_bytes_per_s``, rounded down.

    Raises:
        InvalidThresholdError: when an input is not positive and finite.
    """
    _positive("snic_bytes_per_s", snic_bytes_per_s)
    _positive("kv_bytes_per_token", kv_bytes_per_token)
    _positive("seconds", seconds)
    return int(snic_bytes_per_s * seconds // kv_bytes_per_token)


def beta_tokens(tokens_per_s: float, seconds: float = BETA_SECONDS) -> int:
    """β: tokens one GPU computes (prefills) in ``seconds`` at ``tokens_per_s``, rounded
    down. ``tokens_per_s`` comes from profiling or the cost model.

    Raises:
        InvalidThresholdError: when an input is not positive and finite.
    """
    _positive("tokens_per_s", tokens_per_s)
    _positive("seconds", seconds)
    return int(tokens_per_s * seconds)


@dataclass(frozen=True, slots=True, kw_only=True)
class Thresholds:
    """α and β in tokens.

    Raises:
        InvalidThresholdError: on a negative value.
    """

    alpha_tokens: int
    beta_tokens: int
    read_hold_percent: int = READ_HOLD_PERCENT  # 0: no read admission (the paper's pass)

    def __post_init__(self) -> None:
        if self.alpha_tokens < 0:
            raise InvalidThresholdError("alpha_tokens", self.alpha_tokens)
        if self.beta_tokens < 0:
            raise InvalidThresholdError("beta_tokens", self.beta_tokens)
        if self.read_hold_percent < 0:
            raise InvalidThresholdError("read_hold_percent", self.read_hold_percent)

    @property
    def hold_tokens(self) -> int:
        """Open reads (tokens) at which a node takes no new read; 0: no limit (module docstring)."""
        return self.alpha_tokens * self.read_hold_percent // 100

    @classmethod
    def from_profile(
        cls,
        *,
        snic_bytes_per_s: float,
        kv_bytes_per_token: int,
        prefill_tokens_per_s: float,
        alpha_seconds: float = ALPHA_SECONDS,
        beta_seconds: float = BETA_SECONDS,
    ) -> Thresholds:
        """Derive both thresholds from the node's storage NIC, the model's KV bytes per
        token and one GPU's prefill throughput.

        Raises:
            InvalidThresholdError: when an input is not positive and finite.
        """
        return cls(
            alpha_tokens=alpha_tokens(snic_bytes_per_s, kv_bytes_per_token, alpha_seconds),
            beta_tokens=beta_tokens(prefill_tokens_per_s, beta_seconds),
        )
