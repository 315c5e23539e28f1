"""The Mooncake Transfer Engine baseline of the transfer benchmark (TCP on loopback).

Used only when ``mooncake-transfer-engine`` is importable; it is not a dependency. A target
engine runs in a child process (``target_main``) and registers a buffer; the benchmark's
engine registers its own and issues ``batch_transfer_sync_read``/``_write`` of the same
blocks the dualpath transports move. Engines find each other with Mooncake's
``P2PHANDSHAKE`` mode, so no metadata server is needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Self

import numpy as np

__all__ = ["MooncakeLoopback", "mooncake_status", "target_main"]

_QUIET = {"GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR"}  # Mooncake logs through glog


def mooncake_status() -> tuple[bool, str]:
    """Whether Mooncake's engine can be imported here, and a note saying which or why not."""
    os.environ.update({k: os.environ.get(k, v) for k, v in _QUIET.items()})
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except (ImportError, OSError) as exc:
        return False, (
            f"mooncake-transfer-engine is not importable ({exc}); "
            "pip install mooncake-transfer-engine (CUDA build) or "
            "mooncake-transfer-engine-non-cuda (needs libibverbs.so.1) to compare"
        )
    from importlib import metadata

    for dist in ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"):
        try:
            return True, f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return True, "mooncake.engine (version unknown)"


def _engine() -> Any:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize failed with {rc}")
    return engine


def target_main() -> None:
    """The child process: register a buffer of ``sys.argv[1]`` bytes, print where it is,
    and serve until stdin closes."""
    size = int(sys.argv[1])
    engine = _engine()
    buf = np.ones(size, dtype=np.uint8)  # touched: no page faults inside timed transfers
    if engine.register_memory(buf.ctypes.data, size) != 0:
        raise RuntimeError("Mooncake register_memory failed")
    print(json.dumps({"port": engine.get_rpc_port(), "addr": buf.ctypes.data}), flush=True)
    sys.stdin.read()


class MooncakeLoopback:
    """A Mooncake engine here and one in a child process, ``size`` bytes registered each."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        """Start the target and the local engine.

        Raises:
            RuntimeError: either engine failed to start or register its buffer.
        """
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from dualpath.bench.mooncake import target_main; target_main()",
                str(self.size),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **_QUIET},
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("the Mooncake target process exited before serving")
        info = json.loads(line)
        self._target = f"127.0.0.1:{info['port']}"
        self._remote = int(info["addr"])
        self._engine = _engine()
        self._buf = np.ones(self.size, dtype=np.uint8)
        self._local = self._buf.ctypes.data
        if self._engine.register_memory(self._local, self.size) != 0:
            raise RuntimeError("Mooncake register_memory failed")
        return self

    @property
    def target_pid(self) -> int | None:
        """The target process's id (for its CPU time), None before ``__enter__``."""
        return self._proc.pid if self._proc is not None else None

    def batch(self, op: str, layout: list[tuple[int, int, int]]) -> None:
        """Move the blocks of ``layout`` ((local offset, remote offset, length) each).

        Raises:
            RuntimeError: Mooncake reported a failed transfer.
        """
        local = [self._local + lo for lo, _, _ in layout]
        remote = [self._remote + ro for _, ro, _ in layout]
        lengths = [n for _, _, n in layout]
        if op == "read":
            rc = self._engine.batch_transfer_sync_read(self._target, local, remote, lengths)
        else:
            rc = self._engine.batch_transfer_sync_write(self._target, local, remote, lengths)
        if rc != 0:
            raise RuntimeError(f"Mooncake batch transfer failed with {rc}")

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
