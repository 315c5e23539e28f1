"""Configuration of local ``nats-server`` processes with JetStream: one server, or a cluster of N.

The launcher runs each server as a supervised child (so a killed server is restarted on the
same port with the same JetStream store, and clients reconnect to it); this module only
writes their configuration files and builds their command lines. A cluster of three is the
smallest one in which JetStream keeps working (R3 streams and KV buckets) with one server
down.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dualpath.bus.auth import ClusterAuth, ClusterTls
from dualpath.bus.embedded import free_port, nats_server_binary

__all__ = ["NatsServerSpec", "nats_servers"]

MAX_PAYLOAD = 8 << 20  # long prompts (token ids + block hashes) exceed NATS's 1 MiB default


@dataclass(frozen=True, slots=True, kw_only=True)
class NatsServerSpec:
    """One server: its name, client URL and the command that runs it."""

    name: str
    url: str
    cmd: list[str]


CLIENT_PORT, CLUSTER_PORT = 4222, 6222  # a server alone on its host takes NATS's standard ports


def _conf(
    name: str, host: str, port: int, store: Path, cluster_port: int | None, routes: list[tuple[str, int]], auth: Path | None, tls: str
) -> str:
    lines = [
        f"server_name: {name}",
        f"listen: {host}:{port}",
        f"max_payload: {MAX_PAYLOAD}",
        f'jetstream {{ store_dir: "{store}", max_memory_store: 268435456, max_file_store: 4294967296 }}',
    ]
    if auth is not None:
        lines.append(f'include "{auth.name}"')  # relative to this file: the users and their permissions
    if tls:
        lines.append(tls.strip())
    if cluster_port is not None:
        route_list = ", ".join(f"nats-route://{h}:{p}" for h, p in routes)
        route_tls = f", {tls.strip()}" if tls else ""  # routes between servers are mutual TLS too
        # A server drops a route (and the subscriptions it carried) after 3 PINGs 2 s apart go
        # unanswered; by default, 2 x 2 minutes, during which the survivors of a partition still
        # route requests to queue subscribers behind the cut server, and lose them. Routes only:
        # a client pings its server itself, and a server that pinged clients this often would
        # drop one whose event loop is busy for a few seconds (a service starting on a loaded host).
        pings = "ping_interval: 2s, ping_max: 3"
        lines.append(f"cluster {{ name: dualpath, listen: {host}:{cluster_port}, routes: [{route_list}], {pings}{route_tls} }}")
    return "\n".join(lines) + "\n"


def nats_servers(
    n: int,
    run_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    hosts: list[str] | None = None,
    auth: ClusterAuth | None = None,
    tls: ClusterTls | None = None,
) -> list[NatsServerSpec]:
    """Write the configuration of ``n`` servers (1 = standalone, >= 3 = a JetStream cluster)
    under ``<run_dir>/nats`` and return how to run each. All listen on ``host`` (free ports),
    or server ``i`` alone on ``hosts[i]`` (a host of its own: the standard ports 4222 and 6222).
    ``auth``: only its identities may connect, each with its permissions; ``tls``: clients and
    routes speak mutual TLS with certificates of its authority (URLs are then ``tls://``).

    Raises:
        ValueError: ``n`` is 2 (JetStream needs a majority: two servers do not survive a loss) or < 1.
        FileNotFoundError: no ``nats-server`` binary.
    """
    if n < 1 or n == 2:
        raise ValueError(f"a NATS cluster needs 1 or at least 3 servers, not {n}")
    binary = nats_server_binary()
    root = Path(run_dir) / "nats"
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    auth_file = auth.write(root) if auth is not None else None
    tls_conf = tls.server_config() if tls is not None else ""
    scheme = "tls" if tls is not None else "nats"
    if hosts is not None:
        if len(hosts) != n:
            raise ValueError(f"{n} NATS servers need {n} hosts, got {len(hosts)}")
        ports, cluster_ports = [CLIENT_PORT] * n, [CLUSTER_PORT] * n if n > 1 else []
    else:
        hosts = [host] * n
        ports = [free_port(host) for _ in range(n)]
        cluster_ports = [free_port(host) for _ in range(n)] if n > 1 else []
    specs = []
    for i in range(n):
        name = f"nats-{i}"
        store = (root / name).resolve()
        store.mkdir(parents=True, exist_ok=True)
        conf = root / f"{name}.conf"
        cport = cluster_ports[i] if n > 1 else None
        routes = [(hosts[j], p) for j, p in enumerate(cluster_ports) if j != i]
        conf.write_text(_conf(name, hosts[i], ports[i], store, cport, routes, auth_file, tls_conf))
        specs.append(NatsServerSpec(name=name, url=f"{scheme}://{hosts[i]}:{ports[i]}", cmd=[binary, "-c", str(conf)]))
    return specs
