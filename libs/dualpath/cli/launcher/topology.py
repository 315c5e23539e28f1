"""Topology strings: ``xPyD`` = x prefill nodes and y decode nodes (each with N engines)."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Topology", "parse_topology"]

_PATTERN = re.compile(r"^\s*(\d+)\s*P\s*(\d+)\s*D\s*$", re.IGNORECASE)


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    prefill_nodes: int
    decode_nodes: int
    engines_per_node: int = 1

    def nodes(self) -> list[tuple[str, str]]:
        """``(node_id, role)`` for every node: p0.., d0.."""
        return [(f"p{i}", "prefill") for i in range(self.prefill_nodes)] + [(f"d{i}", "decode") for i in range(self.decode_nodes)]

    def engines(self) -> list[tuple[str, str, str]]:
        """``(engine_id, node_id, role)`` for every engine: p0e0, p0e1, ..., d0e0, ..."""
        return [(f"{node}e{k}", node, role) for node, role in self.nodes() for k in range(self.engines_per_node)]

    def __str__(self) -> str:
        return f"{self.prefill_nodes}P{self.decode_nodes}D x{self.engines_per_node}"


def parse_topology(text: str, engines_per_node: int = 1) -> Topology:
    """Parse ``1P1D``, ``2P4D`` ...

    Raises:
        ValueError: not of the form xPyD with x, y >= 1, or ``engines_per_node`` < 1.
    """
    match = _PATTERN.match(text)
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise ValueError(f"topology {text!r} must look like 1P1D or 2P4D (at least one prefill and one decode node)")
    if engines_per_node < 1:
        raise ValueError("--engines-per-node must be at least 1")
    return Topology(prefill_nodes=int(match.group(1)), decode_nodes=int(match.group(2)), engines_per_node=engines_per_node)
