"""``Stack``: start a whole DualPath deployment as local processes, wait until ready, stop it.

Used by ``dualpath up``, the tests and the experiments. Each service is a separate process
(``python -m services.<name>``) configured by command-line flags; its JSON log goes to
``<run_dir>/logs/<name>.log``. Stopping sends SIGTERM in reverse start order (gateway
first, NATS last), waits, then kills whatever is left, so no process outlives the stack.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from dualpath.bus.embedded import EmbeddedNats
from dualpath.config import EmulationConfig
from dualpath.cli.launcher.topology import Topology

__all__ = ["Stack", "StackConfig", "StackError"]


class StackError(RuntimeError):
    """Raised when a service exits during start-up or the stack is not ready in time."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StackConfig:
    model: str
    topology: Topology
    storage: str
    run_dir: str
    port: int = 8000
    host: str = "127.0.0.1"
    policy: str = "dualpath"
    read_path: str = "auto"
    device: str = "cpu"
    namespace: str = ""
    nats_url: str = ""  # empty: start an embedded nats-server
    buffer_mb: int = 256
    max_batch_tokens: int = 2048
    kv_capacity_tokens: int = 65536
    api_key: str = ""
    prefix_cache: bool = True
    emulation: EmulationConfig | None = None  # testbed: modeled compute, emulated NICs, oracle
    extra_env: dict[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """Environment for every service: the emulation settings as their DUALPATH_* variables."""
        out = dict(self.extra_env)
        if self.emulation is not None:
            for f in dataclasses.fields(self.emulation):
                value = getattr(self.emulation, f.name)
                out[f.metadata["env"]] = str(value).lower() if isinstance(value, bool) else str(value)
        return out


class Stack:
    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        self.namespace = cfg.namespace or f"dp{os.getpid()}x{int(time.time() * 1000) % 100000}"
        self.nats: EmbeddedNats | None = None
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.logs = Path(cfg.run_dir) / "logs"

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    @property
    def nats_url(self) -> str:
        return self.cfg.nats_url or (self.nats.url if self.nats else "")

    def _spawn(self, name: str, module: str, args: list[str]) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = open(self.logs / f"{name}.log", "ab")
        env = {**os.environ, **self.cfg.env(), "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", module, "--nats-url", self.nats_url, "--namespace", self.namespace, *args]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        self.procs.append((name, proc))

    def start(self, timeout: float = 120.0, progress=None) -> "Stack":
        """Start everything and wait for ``/health`` to report every engine.

        Raises:
            StackError: a service died during start-up (its log tail is in the message) or timeout.
        """
        c = self.cfg
        say = progress or (lambda _msg: None)
        Path(c.storage).mkdir(parents=True, exist_ok=True)
        Path(c.run_dir).mkdir(parents=True, exist_ok=True)
        if not c.nats_url:
            self.nats = EmbeddedNats(log_file=str(Path(c.run_dir) / "nats.log")).start()
            say(f"nats-server on {self.nats.url}")
        model = ["--model", c.model]
        self._spawn("kv-persistence", "services.kv_persistence", ["--storage", c.storage])
        self._spawn("scheduler", "services.scheduler", ["--policy", c.policy, "--read-path", c.read_path])
        for node, role in c.topology.nodes():
            self._spawn(f"traffic-manager-{node}", "services.traffic_manager",
                        ["--node-id", node, "--storage", c.storage, "--buffer-mb", str(c.buffer_mb)])
        for engine, node, role in c.topology.engines():
            if role == "prefill":
                self._spawn(f"prefill-{engine}", "services.prefill_engine",
                            [*model, "--engine-id", engine, "--node-id", node, "--device", c.device,
                             "--max-batch-tokens", str(c.max_batch_tokens)])
            else:
                self._spawn(f"decode-{engine}", "services.decode_engine",
                            [*model, "--engine-id", engine, "--node-id", node, "--device", c.device,
                             "--kv-capacity-tokens", str(c.kv_capacity_tokens)])
        self._spawn("gateway", "services.gateway", [*model, "--host", c.host, "--port", str(c.port), "--api-key", c.api_key,
                                                       "--prefix-cache", str(c.prefix_cache).lower()])
        say(f"{len(self.procs)} services starting (logs in {self.logs})")
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        want_p = self.cfg.topology.prefill_nodes * self.cfg.topology.engines_per_node
        want_d = self.cfg.topology.decode_nodes * self.cfg.topology.engines_per_node
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                r = httpx.get(self.url + "/health", timeout=2.0)
                body = r.json()
                if r.status_code == 200 and body.get("prefill_engines", 0) >= want_p and body.get("decode_engines", 0) >= want_d:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise StackError(f"stack not ready within {timeout:.0f}s; see logs in {self.logs}")

    def check_alive(self) -> None:
        """Raise ``StackError`` if any service has exited."""
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = self.log_tail(name)
                raise StackError(f"service {name} exited with code {proc.returncode}:\n{tail}")

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.logs / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 15.0) -> dict[str, int | None]:
        """Stop in stages so in-flight work drains: gateway, engines, traffic managers, scheduler,
        kv-persistence, NATS. Each stage gets SIGTERM, then SIGKILL after ``timeout``.

        Returns each service's exit code (None when it had to be killed).
        """
        stages = ("gateway", ("prefill-", "decode-"), "traffic-manager", "scheduler", "kv-persistence")
        codes: dict[str, int | None] = {}
        for stage in stages:
            group = [(n, p) for n, p in self.procs if n.startswith(stage)]
            for _name, proc in group:
                if proc.poll() is None:
                    try:
                        proc.send_signal(signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + timeout
            for name, proc in group:
                try:
                    codes[name] = proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    codes[name] = None
        for name, proc in self.procs:  # anything not in a stage
            if name not in codes:
                proc.kill()
                codes[name] = proc.wait()
        self.procs.clear()
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        return codes

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

