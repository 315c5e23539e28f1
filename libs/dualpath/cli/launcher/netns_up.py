"""``dualpath netns``: the deployment across Linux network namespaces, one per host (as root).

    dualpath netns up [--topology 2P2D] [--replicas 2] [--model DIR] [--run-dir DIR] [--env K=V ...]
    dualpath netns status [--run-dir DIR] [--json]
    dualpath netns link HOST down|up [--run-dir DIR]
    dualpath netns shape HOST [--delay-ms MS] [--loss PCT] [--rate-mbit MBIT] [--run-dir DIR]
    dualpath netns down [--run-dir DIR] [--prefix PREFIX]

``up`` builds the hosts (``netns.NetnsNetwork``): the gateway alone on ``gw``; each scheduler,
kv-persistence replica and NATS server on a host of its own (``s0 s1``, ``k0 k1``,
``n0 n1 n2`` with ``--replicas 2``), so cutting one host off loses at most one of each; one
host per node (``p0 ... d0 ...``) with its traffic manager and engines. It then starts the
``Stack`` with a ``NetnsPlacement`` (every service under ``ip netns exec``, bound to its host's
address, the data plane over TCP across the veths, mutual TLS unless ``--no-data-tls``) in a
background keeper process that supervises it, and returns once ``/health`` counts every
engine, printing the gateway URL on its last line. ``<run-dir>/netns.json`` records the deployment; ``down`` stops the keeper (the
stack stops in stages), then removes every namespace and the root veth named after the
deployment's prefix, whatever state ``up`` left them in.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from dualpath.cli.launcher.netns import Host, NetnsError, NetnsNetwork, locked, plan_hosts, service_host
from dualpath.cli.launcher.stack import Stack, StackConfig, StackError, service_names
from dualpath.cli.launcher.topology import parse_topology
from dualpath.cli.launcher.up import ensure_model
from dualpath.config import GatewayConfig, default_of

__all__ = ["NetnsPlacement", "main", "read_state", "scheduler_roles"]

STATE = "netns.json"


class NetnsPlacement:
    """Each service on its own host's namespace, bound to that host's address."""

    def __init__(self, net: NetnsNetwork) -> None:
        self.net = net

    def address(self, service: str) -> str:
        return self.net.address(service_host(service))

    def command(self, service: str, cmd: list[str]) -> list[str]:
        return [*self.net.exec_prefix(service_host(service)), *cmd]

    def reachable(self, service: str, host: str, port: int) -> bool:
        probe = [*self.net.exec_prefix(service_host(service)), "bash", "-c", f"exec 3<>/dev/tcp/{host}/{port}"]
        try:
            return subprocess.run(probe, capture_output=True, timeout=2.0).returncode == 0
        except subprocess.TimeoutExpired:
            return False


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpath netns", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{up,status,link,shape,down}")  # _serve: the keeper, internal
    for name in ("up", "_serve", "status", "down", "link", "shape"):
        s = sub.add_parser(name)
        s.add_argument("--run-dir", default=".dualpath-netns", help="logs, storage and the deployment record (netns.json)")
        if name in ("up", "_serve"):
            s.add_argument("--model", default="", help="checkpoint directory; default: a tiny model made on first run")
            s.add_argument("--topology", default="2P2D", help="xPyD: prefill and decode nodes, one host each")
            s.add_argument("--engines-per-node", type=int, default=1)
            s.add_argument("--replicas", type=int, default=2, help="schedulers and kv-persistence replicas (2: NATS cluster of 3)")
            s.add_argument("--port", type=int, default=default_of(GatewayConfig, "port"), help="gateway port on its host")
            s.add_argument("--device", default="cpu")
            s.add_argument("--prefix", default="", help="names of everything made start with this (default: dp + random hex)")
            s.add_argument("--env", action="append", default=[], metavar="K=V", help="environment for every service")
            s.add_argument("--ready-timeout", type=float, default=240.0, help="seconds to wait for every engine")
            s.add_argument(
                "--nats-tls",
                action=argparse.BooleanOptionalAction,
                default=True,
                help="NATS clients and routes speak mutual TLS across the hosts (default on: traffic leaves each host)",
            )
            s.add_argument(
                "--data-tls",
                action=argparse.BooleanOptionalAction,
                default=True,
                help="the tcp data plane (KV between nodes) speaks mutual TLS across the hosts, one certificate per host (default on)",
            )
        if name == "down":
            s.add_argument("--prefix", default="", help="remove this deployment's namespaces even without a record")
        if name == "status":
            s.add_argument("--json", action="store_true")
        if name in ("link", "shape"):
            s.add_argument("host", help="host name (gw, s0, n1, p0, ...)")
        if name == "link":
            s.add_argument("state", choices=("down", "up"))
        if name == "shape":
            s.add_argument("--delay-ms", type=float, default=0.0, help="added to each direction (a round trip gets twice)")
            s.add_argument("--loss", type=float, default=0.0, help="percent of packets dropped, each direction")
            s.add_argument("--rate-mbit", type=float, default=0.0, help="each direction's rate (0: not limited)")
    return p


def read_state(run_dir: str | Path) -> dict:
    """The deployment record of ``run_dir`` ({} when there is none)."""
    path = Path(run_dir) / STATE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_state(run_dir: str | Path, state: dict) -> None:
    path = Path(run_dir) / STATE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path)


def _network(state: dict) -> NetnsNetwork:
    names = [h["name"] for h in state["hosts"]]
    return NetnsNetwork(prefix=state["prefix"], n=state["n"], host_names=names, run_dir=state.get("run_dir", ""))


def scheduler_roles(run_dir: str | Path) -> dict[str, str]:
    """Each scheduler's role from its lease events in its log (the last one wins): ``active``,
    ``standby`` or ``lost`` (it lost the lease and is stepping down)."""
    roles = {}
    kinds = {"scheduler_active": "active", "scheduler_standby": "standby", "scheduler_lease_lost": "lost"}
    for log in sorted((Path(run_dir) / "logs").glob("scheduler*.log")):
        role = ""
        for line in log.read_text(errors="replace").splitlines():
            for event, kind in kinds.items():
                if f'"{event}"' in line:
                    role = kind
        roles[log.stem] = role or "starting"
    return roles


def _serve(ns: argparse.Namespace) -> int:
    """The keeper: build the hosts, run the stack until SIGTERM, then tear everything down."""
    run_dir = Path(ns.run_dir).resolve()
    _write_state(run_dir, {**read_state(run_dir), "keeper_pid": os.getpid()})
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    topology = parse_topology(ns.topology, ns.engines_per_node)
    env = dict(kv.split("=", 1) for kv in ns.env)
    cfg = StackConfig(
        model=ensure_model(ns.model, str(run_dir)),
        topology=topology,
        storage=str(run_dir / "storage"),  # one file system seen by every host: the shared storage mount
        run_dir=str(run_dir),
        port=ns.port,
        device=ns.device,
        replicas=ns.replicas,
        nats_cluster=3 if ns.replicas > 1 else 1,
        nats_tls=ns.nats_tls,
        data_tls=ns.data_tls,
        extra_env=env,
    )
    services = service_names(cfg)
    names = plan_hosts(services)

    def build() -> NetnsNetwork:
        net = NetnsNetwork(prefix=ns.prefix, n=NetnsNetwork.choose_number(ns.prefix), host_names=names)
        hosts = [
            Host(name=h, netns=net.netns(h), address=net.address(h), services=tuple(s for s in services if service_host(s) == h))
            for h in names
        ]
        _write_state(run_dir, {**read_state(run_dir), "n": net.n, "hosts": [asdict(h) for h in hosts], "phase": "building"})
        net.create()
        return net

    net = None
    stack = None
    try:
        net = locked(build)
        stack = Stack(cfg, placement=NetnsPlacement(net))
        stack.start(timeout=ns.ready_timeout, progress=lambda msg: print(msg, flush=True))
        _write_state(run_dir, {**read_state(run_dir), "phase": "ready", "url": stack.url, "namespace": stack.namespace})
        print(f"ready: {stack.url}", flush=True)
        stop.wait()
        return 0
    except (StackError, NetnsError, OSError, ValueError) as exc:
        print(f"dualpath netns: {exc}", flush=True)
        _write_state(run_dir, {**read_state(run_dir), "phase": "failed", "error": str(exc)})
        return 1
    finally:
        if stack is not None:
            stack.stop()
        NetnsNetwork.destroy_prefix(ns.prefix)
        if read_state(run_dir).get("phase") != "failed":
            _write_state(run_dir, {**read_state(run_dir), "phase": "stopped"})


def _up(ns: argparse.Namespace, argv: list[str]) -> int:
    run_dir = Path(ns.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    old = read_state(run_dir)
    if old.get("phase") in ("building", "ready") and _alive(old.get("keeper_pid", 0)):
        print(f"dualpath netns: {run_dir} already runs deployment {old['prefix']}; `dualpath netns down` first", file=sys.stderr)
        return 2
    prefix = ns.prefix or "dp" + secrets.token_hex(3)
    log = run_dir / "netns-keeper.log"
    cmd = [sys.executable, "-m", "dualpath.cli.launcher.netns_up", "_serve", *argv[1:], "--prefix", prefix, "--run-dir", str(run_dir)]
    # recorded before anything is made, so `down` can remove a half-built deployment
    _write_state(run_dir, {"prefix": prefix, "keeper_pid": 0, "phase": "building", "run_dir": str(run_dir)})
    with open(log, "ab") as out:
        keeper = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + ns.ready_timeout + 30.0
    while time.monotonic() < deadline:
        state = read_state(run_dir)
        if state.get("phase") == "ready":
            for h in state["hosts"]:
                print(f"  {h['netns']:<14} {h['address']:<14} {' '.join(h['services'])}")
            print(state["url"], flush=True)
            return 0
        if keeper.poll() is not None or state.get("phase") == "failed":
            break
        time.sleep(0.2)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    print(f"dualpath netns up: the deployment did not become ready:\n{tail}", file=sys.stderr)
    _down(ns.run_dir, prefix)
    return 1


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _down(run_dir: str, prefix: str = "", timeout: float = 45.0) -> int:
    state = read_state(run_dir)
    prefix = prefix or state.get("prefix", "")
    if not prefix:
        print(f"dualpath netns down: no deployment recorded in {run_dir} (give --prefix)", file=sys.stderr)
        return 0
    pid = state.get("keeper_pid", 0) if state.get("prefix") == prefix else 0
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)  # the keeper stops the stack in stages and removes the hosts
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            _reap(pid)
            time.sleep(0.1)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    removed = NetnsNetwork.destroy_prefix(prefix)  # whatever a killed or half-built keeper left
    if state.get("prefix") == prefix:
        _write_state(run_dir, {**state, "phase": "down"})
    print(f"removed deployment {prefix}" + (f" (left over: {', '.join(removed)})" if removed else ""))
    return 0


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)  # our own child when up and down run in one process
    except ChildProcessError:
        pass


def _status(ns: argparse.Namespace) -> int:
    state = read_state(ns.run_dir)
    if not state.get("hosts"):
        print(json.dumps({"phase": state.get("phase", "none")}) if ns.json else "no deployment", flush=True)
        return 1
    net = _network(state)
    roles = scheduler_roles(ns.run_dir)
    active = [s for s, r in roles.items() if r == "active"]
    hosts = []
    for h in state["hosts"]:
        link = subprocess.run(["ip", "-n", h["netns"], "-br", "link", "show", "dev", "eth0"], capture_output=True, text=True)
        up = link.returncode == 0 and " UP " in f" {link.stdout} "
        sched = {s: roles.get(s, "") for s in h["services"] if s.startswith("scheduler")}
        hosts.append({**h, "link": "up" if up else "down", "schedulers": sched})
    out = {
        "prefix": state["prefix"],
        "phase": state.get("phase"),
        "url": state.get("url"),
        "bridge_netns": net.bridge_ns,
        "root_veth": net.root_veth,
        "active_scheduler": active[0] if len(active) == 1 else active,
        "hosts": hosts,
    }
    if ns.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"deployment {out['prefix']} ({out['phase']}): {out['url']}  active scheduler: {out['active_scheduler']}")
        for h in hosts:
            print(f"  {h['netns']:<14} {h['address']:<14} link {h['link']:<4}  {' '.join(h['services'])}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = _parser().parse_args(argv)
    try:
        if ns.cmd == "up":
            return _up(ns, argv)
        if ns.cmd == "_serve":
            return _serve(ns)
        if ns.cmd == "down":
            return _down(ns.run_dir, ns.prefix)
        if ns.cmd == "status":
            return _status(ns)
        state = read_state(ns.run_dir)
        if not state.get("hosts"):
            raise NetnsError(f"no deployment recorded in {ns.run_dir}")
        net = _network(state)
        if ns.host not in net.host_names:
            raise NetnsError(f"no host {ns.host!r}; hosts: {' '.join(net.host_names)}")
        if ns.cmd == "link":
            net.link(ns.host, ns.state == "up")
        else:
            net.shape(ns.host, delay_ms=ns.delay_ms, loss_pct=ns.loss, rate_mbit=ns.rate_mbit)
        return 0
    except NetnsError as exc:
        print(f"dualpath netns: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
