"""``Stack``: start a whole DualPath deployment as local processes, keep it running, stop it.

Used by ``dualpath up``, the tests and the experiments. Each service is a separate process
(``python -m services.<name>``) configured by command-line flags; its JSON log goes to
``<run_dir>/logs/<name>.log``. NATS runs as one or three local ``nats-server`` processes with
JetStream (``nats_cluster``). Once the stack is ready a ``Supervisor`` restarts any child that
dies (with back-off) while the others keep serving, and logs the event. ``replicas`` = 2 runs
the redundant form: two schedulers (one active, one standby behind a JetStream lease) and two
kv-persistence replicas sharing an index replicated through JetStream. Stopping sends SIGTERM
in stages (gateway first, NATS last), waits, then kills whatever is left, so no process
outlives the stack.

NATS is locked down (``dualpath.bus.auth``): each child connects as an identity of its own, with
a fresh password handed over in its environment and only the permissions its role needs; a
client without credentials is refused. ``nats_tls`` adds mutual TLS with a throwaway authority
(per-identity client certificates). ``nats_options`` gives the launcher's own tools (and the
tests) an operator identity. An external NATS (``nats_url``) is used as configured.
``data_tls`` runs the tcp data plane over mutual TLS: a throwaway authority and one certificate
per data-plane host (traffic managers and engines), handed to each in its environment.

Where each service runs is a ``Placement``: ``LocalPlacement`` (the default) runs everything on
this host's loopback; ``dualpath netns`` places each on a host of its own (a network namespace),
bound to that host's address.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

from dualpath.bus.auth import OPERATOR, ClusterAuth, ClusterTls, Identity
from dualpath.cli.launcher.supervisor import Supervisor, SupervisorEvent
from dualpath.cli.launcher.topology import Topology
from dualpath.config import EmulationConfig, GatewayConfig, NodeConfig, default_of
from dualpath.protocol.subjects import Role
from dualpath.transfer.tls import TlsConfig

__all__ = ["LocalPlacement", "Placement", "Stack", "StackConfig", "StackError", "service_names", "stack_identities"]


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
    prefetch_mb: int = 0  # agent-aware prefetch: the scheduler hints finished sessions' blocks; cache per node (0: off)
    prefetch_ttl_s: float = 60.0
    device: str = "cpu"
    namespace: str = ""
    nats_url: str = ""  # empty: start local nats-server(s)
    nats_cluster: int = 1  # local nats-servers: 1, or a JetStream cluster of 3+
    nats_auth: bool = True  # local nats-servers: one identity per service with least-privilege permissions
    nats_tls: bool = False  # local nats-servers: mutual TLS (clients and routes), per-identity certificates
    data_tls: bool = False  # tcp data plane over mutual TLS, a throwaway CA and one certificate per data-plane host
    extra_identities: tuple[Identity, ...] = ()  # NATS identities for processes started beside the stack (a second gateway)
    replicas: int = 1  # schedulers (one active) and kv-persistence replicas; 2+ = the redundant form
    supervise: bool = True  # restart children that die once the stack is up
    buffer_mb: int = default_of(NodeConfig, "buffer_mb")  # one source of truth: the node config
    compute_quota_ms: float | None = None  # prefill compute quota per batch; None: the engine's own (env or 300 ms)
    kv_capacity_tokens: int = 65536
    api_key: str = ""
    api_key_file: str = ""  # KEY TENANT [limits] lines (dualpath.tenant.keys): each caller's tenant
    tenant_max_concurrency: int = 0  # requests in flight per tenant (0: no limit)
    tenant_tokens_per_minute: int = 0  # prompt plus generated tokens per tenant per minute (0: no limit)
    prefix_cache: bool = True
    tool_parser: str = default_of(GatewayConfig, "tool_parser")
    reasoning_parser: str = default_of(GatewayConfig, "reasoning_parser")
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


class Placement(Protocol):
    """Where each service of a stack runs (services are named as ``Stack`` names its children)."""

    def address(self, service: str) -> str:
        """The address ``service`` binds (its HTTP or data-plane listener) and advertises."""
        ...

    def command(self, service: str, cmd: list[str]) -> list[str]:
        """``cmd`` as run on ``service``'s host (e.g. prefixed by ``ip netns exec``)."""
        ...

    def reachable(self, service: str, host: str, port: int) -> bool:
        """True when ``host:port`` accepts a TCP connection as seen from ``service``'s host."""
        ...


@dataclass(frozen=True, slots=True)
class LocalPlacement:
    """Every service on this host: loopback, the gateway on ``gateway_host``."""

    gateway_host: str = "127.0.0.1"

    def address(self, service: str) -> str:
        return self.gateway_host if service == "gateway" else "127.0.0.1"

    def command(self, service: str, cmd: list[str]) -> list[str]:
        return cmd

    def reachable(self, service: str, host: str, port: int) -> bool:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            return False


def _on_data_plane(service: str) -> bool:
    """Whether child ``service`` serves or reaches memory regions (traffic managers, engines)."""
    return service.startswith(("traffic-manager-", "prefill-", "decode-"))


def replica_name(base: str, i: int) -> str:
    """``scheduler``, ``scheduler-1``, ...: the first replica keeps the plain name."""
    return base if i == 0 else f"{base}-{i}"


def service_names(cfg: StackConfig) -> list[str]:
    """The children a stack of ``cfg`` runs, by name, in start order."""
    names = [f"nats-{i}" for i in range(cfg.nats_cluster)] if not cfg.nats_url else []
    names += [replica_name("kv-persistence", i) for i in range(cfg.replicas)]
    names += [replica_name("scheduler", i) for i in range(cfg.replicas)]
    names += [f"traffic-manager-{node}" for node, _role in cfg.topology.nodes()]
    names += [f"{role}-{engine}" for engine, _node, role in cfg.topology.engines()]
    return [*names, "gateway"]


def stack_identities(topology: Topology, replicas: int = 1, gateway_id: str = "") -> dict[str, Identity]:
    """The NATS identity of every service of a stack of ``topology``, by the child's name
    (``service_names``): engines, traffic managers and the gateway under their own ids."""
    out = {replica_name("kv-persistence", i): Identity(Role.KV_PERSISTENCE, f"r{i}") for i in range(replicas)}
    out |= {replica_name("scheduler", i): Identity(Role.SCHEDULER, f"s{i}") for i in range(replicas)}
    out |= {f"traffic-manager-{node}": Identity(Role.TRAFFIC_MANAGER, node) for node, _role in topology.nodes()}
    for engine, node, role in topology.engines():
        out[f"{role}-{engine}"] = Identity(Role.PREFILL if role == "prefill" else Role.DECODE, engine, node)
    out["gateway"] = Identity(Role.GATEWAY, gateway_id or default_of(GatewayConfig, "gateway_id"))
    return out


class Stack:
    def __init__(self, cfg: StackConfig, on_event=None, placement: Placement | None = None) -> None:
        if cfg.replicas < 1:
            raise StackError("replicas must be at least 1")
        self.cfg = cfg
        self.placement: Placement = placement or LocalPlacement(cfg.host)
        self.namespace = cfg.namespace or f"dp{os.getpid()}x{int(time.time() * 1000) % 100000}"
        self.logs = Path(cfg.run_dir) / "logs"
        self.supervisor = Supervisor(logs=self.logs, on_event=on_event)
        self.nats_urls: list[str] = []
        local_nats = not cfg.nats_url
        self.auth = ClusterAuth(self.namespace) if cfg.nats_auth and local_nats else None
        self.tls: ClusterTls | None = None  # made with the servers (it needs their addresses)
        self._data_tls: dict[str, TlsConfig] = {}  # data-plane host -> its TLS files (data_tls)
        if self.auth is not None:
            self.auth.add_all(self.identities().values())
            self.auth.add_all(cfg.extra_identities)
            self.auth.add(Identity(OPERATOR, "launcher"))
            self.auth.add(Identity(Role.OBSERVER, "launcher"))

    @property
    def url(self) -> str:
        return f"http://{self.placement.address('gateway')}:{self.cfg.port}"

    @property
    def nats_url(self) -> str:
        return self.cfg.nats_url or ",".join(self.nats_urls)

    def identities(self) -> dict[str, Identity]:
        """The NATS identity of every service this stack runs, by child name."""
        return stack_identities(self.cfg.topology, self.cfg.replicas)

    def nats_env(self, identity: Identity) -> dict[str, str]:
        """The environment that connects a process to this stack's NATS as ``identity`` (which
        must be one of ``identities``, or the ``OPERATOR``/``OBSERVER`` identity named ``launcher``)."""
        env = self.auth.env(identity) if self.auth is not None else {}
        if self.tls is not None:
            env |= self.tls.env(identity.user)
        return env

    def nats_options(self, role: Role | str = OPERATOR) -> dict:
        """``nats.connect`` keyword arguments for the launcher's own clients: the operator (every
        subject; for tests and fault tools) or, with ``Role.OBSERVER``, read-only reports."""
        identity = Identity(role, "launcher")
        options: dict = self.auth.connect_options(identity) if self.auth is not None else {}
        if self.tls is not None:
            options["tls"] = self.tls.ssl_context(identity.user)
        return options

    def nats_violations(self) -> list[str]:
        """The NATS servers' log lines of refused publishes and subscriptions (identities that
        tried a subject their role has no rule for), oldest first."""
        out: list[str] = []
        for log in sorted(self.logs.glob("nats-*.log")):
            out += [ln for ln in log.read_text(errors="replace").splitlines() if " Violation - " in ln]
        return out

    @property
    def events(self) -> list[SupervisorEvent]:
        """Deaths and restarts seen by the supervisor, oldest first."""
        return self.supervisor.events

    @property
    def procs(self) -> list[tuple[str, subprocess.Popen]]:
        """``(name, process)`` of every running child, in start order (current processes after restarts)."""
        return [(c.name, c.proc) for c in self.supervisor.children.values() if c.proc is not None]

    @procs.setter
    def procs(self, keep: list[tuple[str, subprocess.Popen]]) -> None:
        names = {n for n, _ in keep}
        for name in [n for n in self.supervisor.children if n not in names]:
            del self.supervisor.children[name]

    def pid(self, name: str) -> int:
        """The current process id of child ``name``. Raises KeyError."""
        proc = self.supervisor.children[name].proc
        if proc is None:
            raise KeyError(name)
        return proc.pid

    def _spawn(self, name: str, module: str, args: list[str]) -> None:
        env = {**os.environ, **self.cfg.env(), "PYTHONUNBUFFERED": "1"}
        if name in (ids := self.identities()):
            env |= self.nats_env(ids[name])
        if name == "gateway" and self.cfg.api_key:
            env["DUALPATH_API_KEY"] = self.cfg.api_key  # not on its command line, which every local user can read
        if self.cfg.data_tls and _on_data_plane(name):
            env |= self._data_tls_env(name)
        cmd = [sys.executable, "-m", module, "--nats-url", self.nats_url, "--namespace", self.namespace, *args]
        self.supervisor.add(name, self.placement.command(name, cmd), env)

    def _data_tls_env(self, name: str) -> dict[str, str]:
        """The ``--data-tls`` settings of data-plane service ``name``: the certificate of the
        host it is placed on (made, with the CA, in ``<run_dir>/data-tls`` on first use)."""
        if not self._data_tls:
            from dualpath.transfer.tls_certs import make_pki

            hosts = [self.placement.address(n) for n in service_names(self.cfg) if _on_data_plane(n)]
            self._data_tls = make_pki(Path(self.cfg.run_dir) / "data-tls", hosts)
        tls = self._data_tls[self.placement.address(name)]
        return {
            "DUALPATH_DATA_TLS": "true",
            "DUALPATH_DATA_TLS_CA": tls.ca,
            "DUALPATH_DATA_TLS_CERT": tls.cert,
            "DUALPATH_DATA_TLS_KEY": tls.key,
        }

    def _start_nats(self, say) -> None:
        from dualpath.ha.natscluster import nats_servers

        n = self.cfg.nats_cluster
        hosts = [self.placement.address(f"nats-{i}") for i in range(n)]
        if self.cfg.nats_tls:
            self.tls = ClusterTls(Path(self.cfg.run_dir) / "nats" / "tls", hosts=sorted(set(hosts)))
        if len(set(hosts)) == n > 1:  # one server per host: each on the standard ports of its own host
            specs = nats_servers(n, self.cfg.run_dir, hosts=hosts, auth=self.auth, tls=self.tls)
        else:
            specs = nats_servers(n, self.cfg.run_dir, host=hosts[0], auth=self.auth, tls=self.tls)
        for spec in specs:
            self.supervisor.add(spec.name, self.placement.command(spec.name, spec.cmd), dict(os.environ), watches_parent=False)
        self.nats_urls = [s.url for s in specs]
        deadline = time.monotonic() + 15.0
        for spec in specs:
            host, port = spec.url.rsplit("/", 1)[1].split(":")
            while not self.placement.reachable(spec.name, host, int(port)):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise StackError(f"{spec.name} did not listen on {spec.url}; see {self.logs / spec.name}.log")
                time.sleep(0.05)
        lock = (", per-service identities" if self.auth else "") + (", mutual TLS" if self.tls else "")
        say(
            f"nats-server on {self.nats_url}"
            + (f" (cluster of {len(specs)}, JetStream{lock})" if len(specs) > 1 else f" (JetStream{lock})")
        )

    def start(self, timeout: float = 120.0, progress=None) -> Stack:
        """Start everything, wait for ``/health`` to report every engine, then supervise.

        Raises:
            StackError: a service died during start-up (its log tail is in the message) or timeout.
        """
        c = self.cfg
        say = progress or (lambda _msg: None)
        Path(c.storage).mkdir(mode=0o700, parents=True, exist_ok=True)  # KV blocks hold prompts: the owner's alone
        Path(c.run_dir).mkdir(parents=True, exist_ok=True)
        try:
            if not c.nats_url:
                self._start_nats(say)
            self._spawn_services()
            say(f"{len(self.supervisor.children)} processes starting (logs in {self.logs})")
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        if c.supervise:
            self.supervisor.watch()
        return self

    def _spawn_services(self) -> None:
        c = self.cfg
        model = ["--model", c.model]
        replicated = c.replicas > 1
        for i in range(c.replicas):
            args = ["--storage", c.storage]
            if replicated:
                args += ["--replication", "jetstream", "--replica-id", str(i)]
            self._spawn(replica_name("kv-persistence", i), "services.kv_persistence", args)
        for i in range(c.replicas):
            args = ["--policy", c.policy, "--read-path", c.read_path, "--prefetch", "true" if c.prefetch_mb > 0 else "false"]
            if replicated:
                args += ["--leader-lease", "true", "--scheduler-id", f"s{i}"]
            self._spawn(replica_name("scheduler", i), "services.scheduler", args)
        for node, _role in c.topology.nodes():
            self._spawn(
                f"traffic-manager-{node}",
                "services.traffic_manager",
                [
                    "--node-id",
                    node,
                    "--data-host",
                    self.placement.address(f"traffic-manager-{node}"),
                    "--storage",
                    c.storage,
                    "--buffer-mb",
                    str(c.buffer_mb),
                    "--prefetch-mb",
                    str(c.prefetch_mb),
                    "--prefetch-ttl-s",
                    str(c.prefetch_ttl_s),
                ],
            )
        for engine, node, role in c.topology.engines():
            if role == "prefill":
                self._spawn(
                    f"prefill-{engine}",
                    "services.prefill_engine",
                    [
                        *model,
                        "--engine-id",
                        engine,
                        "--node-id",
                        node,
                        "--data-host",
                        self.placement.address(f"{role}-{engine}"),
                        "--device",
                        c.device,
                        *(["--compute-quota-ms", str(c.compute_quota_ms)] if c.compute_quota_ms is not None else []),
                    ],
                )
            else:
                self._spawn(
                    f"decode-{engine}",
                    "services.decode_engine",
                    [
                        *model,
                        "--engine-id",
                        engine,
                        "--node-id",
                        node,
                        "--data-host",
                        self.placement.address(f"{role}-{engine}"),
                        "--device",
                        c.device,
                        "--kv-capacity-tokens",
                        str(c.kv_capacity_tokens),
                    ],
                )
        self._spawn(
            "gateway",
            "services.gateway",
            [
                *model,
                *("--device", c.device),  # the engines' device: their dtype, so the KV bytes /v1/models reports
                *("--host", self.placement.address("gateway"), "--port", str(c.port)),
                *("--prefix-cache", str(c.prefix_cache).lower()),  # the API key goes in the environment: see _spawn
                *(["--api-key-file", str(Path(c.api_key_file).resolve())] if c.api_key_file else []),
                *("--tenant-max-concurrency", str(c.tenant_max_concurrency)),
                *("--tenant-tokens-per-minute", str(c.tenant_tokens_per_minute)),
                *("--tool-parser", c.tool_parser, "--reasoning-parser", c.reasoning_parser),
            ],
        )

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            if self.ready():
                return
            time.sleep(0.2)
        raise StackError(f"stack not ready within {timeout:.0f}s; see logs in {self.logs}")

    def ready(self) -> bool:
        """True when the gateway's ``/health`` is 200 and counts every engine of the topology."""
        want_p = self.cfg.topology.prefill_nodes * self.cfg.topology.engines_per_node
        want_d = self.cfg.topology.decode_nodes * self.cfg.topology.engines_per_node
        try:
            r = httpx.get(self.url + "/health", timeout=2.0)
            body = r.json()
        except (httpx.HTTPError, ValueError):
            return False
        return r.status_code == 200 and body.get("prefill_engines", 0) >= want_p and body.get("decode_engines", 0) >= want_d

    def _check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = self.log_tail(name)
                raise StackError(f"service {name} exited with code {proc.returncode}:\n{tail}")

    def check_alive(self) -> None:
        """Raise ``StackError`` if any service has exited since the stack started, even one the
        supervisor has restarted (a test's "nothing crashed" check)."""
        deaths = [e for e in self.events if e.kind == "exited"]
        if deaths:
            first = deaths[0]
            raise StackError(
                f"service {first.name} exited with code {first.code} ({len(deaths)} deaths in all):\n{self.log_tail(first.name)}"
            )
        self._check_alive()

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
        self.supervisor.unwatch()
        stages = ("gateway", ("prefill-", "decode-"), "traffic-manager", "scheduler", "kv-persistence", "nats-")
        codes: dict[str, int | None] = {}
        for stage in stages:
            names = [n for n in self.supervisor.children if n.startswith(stage)]
            codes.update(self.supervisor.stop(names, timeout))
        codes.update(self.supervisor.stop(list(self.supervisor.children), 1.0))  # anything not in a stage
        return codes

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
