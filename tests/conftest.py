"""Shared fixtures: a tiny checkpoint on disk, a real nats-server, a whole DualPath stack."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dualpath.bus.embedded import EmbeddedNats, free_port


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"  # nats-py needs asyncio


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Qwen2 checkpoint made on disk (loaded by the same code as a real one)."""
    from dualpath.model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=0)


@pytest.fixture()
def nats_server():
    """A real nats-server on a free loopback port, stopped afterwards."""
    server = EmbeddedNats().start()
    try:
        yield server
    finally:
        server.stop()


def start_stack(model: Path, storage: Path, run_dir: Path, *, topology: str = "1P1D", engines_per_node: int = 1, **kw):
    """Start a real stack (NATS + one process per service) and wait until it is ready."""
    from dualpath.cli.launcher.stack import Stack, StackConfig
    from dualpath.cli.launcher.topology import parse_topology

    cfg = StackConfig(
        model=str(model),
        topology=parse_topology(topology, engines_per_node),
        storage=str(storage),
        run_dir=str(run_dir),
        port=free_port(),
        buffer_mb=kw.pop("buffer_mb", 64),
        **kw,
    )
    return Stack(cfg).start(timeout=float(os.environ.get("DUALPATH_TEST_READY_TIMEOUT", "120")))
