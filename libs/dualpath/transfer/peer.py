"""A peer process that serves memory regions: the remote side for tests and the benchmark.

``spawn_peer`` starts ``python -c "...peer import main; main()" SPEC`` where SPEC is JSON
naming the transport and the regions to create (filled with ``pattern``). The child prints
its region descriptors as one line (their msgpack wire form, hex: descriptors carry keys,
which JSON cannot), serves until its stdin closes, and cleans up; its logs go to stderr. A
test kills it (``PeerProcess.kill``) to see how transfers fail when a peer disappears.
"""

from __future__ import annotations

import asyncio
import json
import selectors
import subprocess
import sys
from dataclasses import dataclass, field
from typing import IO, Any, Self

import msgpack
import numpy as np

from dualpath.transfer.factory import create_transport
from dualpath.transfer.region import MemoryRegion
from dualpath.transfer.tls import TlsConfig
from dualpath.transfer.types import RegionDescriptor

__all__ = ["PeerProcess", "main", "pattern", "spawn_peer"]


def pattern(size: int, seed: int) -> np.ndarray:
    """Deterministic test bytes ``[size]`` (period 251, so block shifts show up)."""
    period = ((np.arange(251, dtype=np.int64) * 7 + seed) % 251).astype(np.uint8)  # [251]
    return np.resize(period, size)


@dataclass
class PeerProcess:
    """A running peer: its process and the descriptors of the regions it serves."""

    proc: subprocess.Popen[bytes]
    descriptors: dict[str, RegionDescriptor] = field(default_factory=dict)

    def kill(self) -> None:
        """Kill the peer at once (SIGKILL), reap it and close its pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._close_pipes()

    def stop(self) -> None:
        """Ask the peer to exit (close its stdin); kill it if it does not within 5 s."""
        if self.proc.poll() is None:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn_peer(
    transport: str,
    regions: dict[str, int],
    *,
    node_id: str = "peer",
    host: str = "127.0.0.1",
    seed: int = 0,
    startup_timeout_s: float = 20.0,
    tls: TlsConfig | None = None,
    stderr: IO[Any] | None = None,
) -> PeerProcess:
    """Start a peer serving ``regions`` (id → size) over ``transport`` (tcp over mutual TLS
    with ``tls``); its log lines go to ``stderr`` (default: this process's stderr).

    Raises:
        RuntimeError: the peer exited or printed no descriptors within the timeout.
    """
    spec = {
        "transport": transport,
        "node_id": node_id,
        "host": host,
        "seed": seed,
        "regions": regions,
        "tls": None if tls is None else {"ca": tls.ca, "cert": tls.cert, "key": tls.key},
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", "from dualpath.transfer.peer import main; main()", json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
    )
    assert proc.stdout is not None
    peer = PeerProcess(proc)
    try:
        line = _readline(proc, startup_timeout_s)
    except BaseException:
        peer.kill()
        raise
    for wire in msgpack.unpackb(bytes.fromhex(line.decode().strip())):
        desc = RegionDescriptor.from_wire(wire)
        peer.descriptors[desc.region_id] = desc
    return peer


def _readline(proc: subprocess.Popen[bytes], timeout_s: float) -> bytes:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            raise RuntimeError(f"peer printed no descriptors within {timeout_s} s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"peer exited with code {proc.wait()} before serving")
    return line


def main() -> None:
    """The peer process: serve the regions named in ``sys.argv[1]`` until stdin closes."""
    from dualpath.telemetry.logs import configure_logging

    configure_logging("transfer-peer", stream=sys.stderr)  # stdout carries the descriptors
    asyncio.run(_serve(json.loads(sys.argv[1])))


async def _serve(spec: dict[str, Any]) -> None:
    tls = TlsConfig(**spec["tls"]) if spec.get("tls") else None
    transport = create_transport(spec["transport"], node_id=spec["node_id"], host=spec["host"], data_tls=tls)
    await transport.start()
    regions = [MemoryRegion(rid, size) for rid, size in spec["regions"].items()]
    try:
        for region in regions:
            region.buf[:] = pattern(region.size, int(spec["seed"])).data
        wires = [transport.register(region).to_wire() for region in regions]
        sys.stdout.write(msgpack.packb(wires).hex() + "\n")
        sys.stdout.flush()
        # Serve until the parent closes our stdin (or kills us).
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)
    finally:
        await transport.close()
        for region in regions:
            region.close()
            region.unlink()
