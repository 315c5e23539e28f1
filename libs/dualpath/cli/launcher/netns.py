"""A deployment's hosts as Linux network namespaces on one machine: ``NetnsNetwork``.

One namespace per host; every host's ``eth0`` is one end of a veth pair whose other end is a
port of the bridge ``br0``, which lives in a namespace of its own (``<prefix>-br``), so no
interface of the cluster network is ever in the root namespace. Addresses come from
198.18.0.0/15, the range reserved for network tests (RFC 2544): the cluster network of
deployment ``N`` is 198.18.N.0/24, and the root namespace reaches the gateway host through one
veth (198.19.N.0/30) and a route of 198.18.N.0/24 through it. Forwarding is switched off in
every namespace made here, so the root namespace reaches the gateway host and nothing else (and
never sends cluster addresses to its default route); no interface, route or rule reaches an
outside interface.

Every name starts with the deployment's prefix, so parallel deployments do not collide and
``destroy`` can remove everything a deployment made, even one half built. Link faults and
shaping happen inside the namespaces only: ``link`` sets a host's ``eth0`` down or up,
``shape`` puts ``tc`` qdiscs on both ends of its veth (netem for delay, loss and rate where the
kernel has it; without netem, htb for rate and a classic-BPF filter that sends a random share
of packets to a class that drops everything, and for a delay a relay process in the bridge
namespace that carries the link's frames, ``netns_relay``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dualpath.cli.launcher import netns_relay

__all__ = ["Host", "NetnsError", "NetnsNetwork", "plan_hosts", "service_host"]

CLUSTER_NET = "198.18.{n}.0/24"
LOCK = Path("/run/dualpath-netns.lock")  # serialises the choice of a free deployment number
_PREFIX = re.compile(r"^[a-z][a-z0-9]{1,9}$")


class NetnsError(RuntimeError):
    """Raised when an ``ip``/``tc`` command fails (its stderr is the message), when no deployment
    number is free, or when a link relay (a delay without netem) does not start."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Host:
    """One host: its short name (``gw``, ``s0``, ``p1`` ...), namespace, address, services."""

    name: str
    netns: str
    address: str
    services: tuple[str, ...]


def service_host(service: str) -> str:
    """The host a service runs on (the service names ``Stack`` gives its children): ``gateway`` ->
    ``gw``; ``scheduler``/``scheduler-1`` -> ``s0``/``s1``; ``kv-persistence[-i]`` -> ``k<i>``;
    ``nats-i`` -> ``n<i>``; a node's traffic manager and engines -> the node id."""
    if service == "gateway":
        return "gw"
    for base, short in (("scheduler", "s"), ("kv-persistence", "k")):
        if service == base:
            return f"{short}0"
        if service.startswith(base + "-"):
            return f"{short}{service.rsplit('-', 1)[1]}"
    if service.startswith("nats-"):
        return "n" + service.split("-", 1)[1]
    if service.startswith("traffic-manager-"):
        return service.removeprefix("traffic-manager-")
    if service.startswith(("prefill-", "decode-")):
        engine = service.split("-", 1)[1]  # p0e0: node p0
        return engine.split("e", 1)[0]
    raise ValueError(f"no host for service {service!r}")


def plan_hosts(services: list[str]) -> list[str]:
    """Host names in a stable order (gateway first) for the given service names."""
    seen: dict[str, None] = {}
    for s in ["gateway", *services]:
        seen.setdefault(service_host(s), None)
    return list(seen)


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def namespaces() -> list[str]:
    """Names in ``ip netns list``."""
    return [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line.strip()]


def _loss_bytecode(loss_pct: float) -> str:
    """Classic BPF: match (return -1: the filter's class) when a random u32 is below the loss share."""
    threshold = int(loss_pct / 100.0 * (1 << 32))
    # ld [SKF_AD_OFF + SKF_AD_RANDOM]; jge #threshold -> no match; ret -1 (match); ret 0 (no match)
    return f"4,32 0 0 {0xFFFFF038},53 1 0 {threshold},6 0 0 {0xFFFFFFFF},6 0 0 0"


@dataclass(slots=True, kw_only=True)
class NetnsNetwork:
    """The namespaces, veths and bridge of one deployment (prefix ``prefix``, number ``n``);
    ``run_dir`` keeps a link relay's pid file and log (``shape`` with a delay, without netem)."""

    prefix: str
    n: int
    host_names: list[str]
    run_dir: str = ""

    def __post_init__(self) -> None:
        if not _PREFIX.match(self.prefix):
            raise ValueError(f"netns prefix {self.prefix!r}: 2-10 lower-case letters and digits, starting with a letter")

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}-br"

    @property
    def root_veth(self) -> str:
        return f"{self.prefix}-root"

    @property
    def root_address(self) -> str:
        return f"198.19.{self.n}.1"

    def netns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        return f"198.18.{self.n}.{10 + self.host_names.index(host)}"

    def exec_prefix(self, host: str) -> list[str]:
        """The command prefix that runs a program on ``host``."""
        return ["ip", "netns", "exec", self.netns(host)]

    # ---- building and removing ---------------------------------------------------------------

    @staticmethod
    def choose_number(prefix: str) -> int:
        """A deployment number whose 198.18.N and 198.19.N appear nowhere in the root namespace
        (call under ``LOCK``). Raises NetnsError when all 256 are taken."""
        used = _run("ip", "-4", "addr").stdout + _run("ip", "-4", "route").stdout
        start = int(hashlib.sha1(prefix.encode()).hexdigest(), 16) % 256
        for k in range(256):
            n = (start + k) % 256
            if f"198.18.{n}." not in used and f"198.19.{n}." not in used:
                return n
        raise NetnsError("no free 198.18.N.0/24 left for another deployment")

    def create(self) -> None:
        """Make the bridge namespace, one namespace per host, the veths and the root link.

        Raises:
            NetnsError: an ``ip`` command failed (the caller should ``destroy``).
        """
        br = self.bridge_ns
        self._new_ns(br)
        _run("ip", "-n", br, "link", "add", "name", "br0", "type", "bridge")
        _run("ip", "-n", br, "link", "set", "dev", "br0", "up")
        for host in self.host_names:
            ns = self.netns(host)
            self._new_ns(ns)
            _run("ip", "-n", br, "link", "add", "name", f"v-{host}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "-n", br, "link", "set", "dev", f"v-{host}", "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "dev", "eth0", "up")
        gw = self.netns("gw")
        _run("ip", "link", "add", "name", self.root_veth, "type", "veth", "peer", "name", "front", "netns", gw)
        _run("ip", "addr", "add", f"{self.root_address}/30", "dev", self.root_veth)
        _run("ip", "link", "set", "dev", self.root_veth, "up")
        _run("ip", "-n", gw, "addr", "add", f"198.19.{self.n}.2/30", "dev", "front")
        _run("ip", "-n", gw, "link", "set", "dev", "front", "up")
        # the whole cluster network through the gateway host, which forwards nothing: the root
        # namespace reaches the gateway's address and nothing else (never the default route)
        _run("ip", "route", "add", CLUSTER_NET.format(n=self.n), "via", f"198.19.{self.n}.2", "dev", self.root_veth)

    def _new_ns(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        _run("ip", "-n", ns, "link", "set", "dev", "lo", "up")
        # nothing is forwarded between a namespace's interfaces (the gateway host's front link
        # must not lead anywhere but to the gateway itself)
        _run("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=0", "net.ipv6.conf.all.forwarding=0")

    @classmethod
    def destroy_prefix(cls, prefix: str) -> list[str]:
        """Remove everything named after ``prefix``: processes left in its namespaces (SIGKILL),
        the namespaces (their veths and routes go with them) and the root veth. Idempotent.

        Returns the namespaces removed.
        """
        removed = []
        for ns in namespaces():
            if ns.startswith(prefix + "-"):
                pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
                for pid in pids:
                    _run("kill", "-9", pid, check=False)
                _run("ip", "netns", "del", ns, check=False)
                removed.append(ns)
        if _run("ip", "link", "show", "dev", f"{prefix}-root", check=False).returncode == 0:
            _run("ip", "link", "del", "dev", f"{prefix}-root", check=False)
        return removed

    def destroy(self) -> list[str]:
        return self.destroy_prefix(self.prefix)

    # ---- faults and shaping ------------------------------------------------------------------

    def link(self, host: str, up: bool) -> None:
        """Cut ``host`` off (its ``eth0`` down, inside its namespace) or heal it."""
        _run("ip", "-n", self.netns(host), "link", "set", "dev", "eth0", "up" if up else "down")

    def shape(self, host: str, *, delay_ms: float = 0.0, loss_pct: float = 0.0, rate_mbit: float = 0.0) -> None:
        """Set ``host``'s link (both directions: its ``eth0`` and its bridge port) to add
        ``delay_ms`` each way, drop ``loss_pct`` percent of packets each way and carry at most
        ``rate_mbit``; all zero clears the shaping. netem does it where the kernel has it;
        elsewhere loss and rate are made with htb and a BPF filter, and a delay (with the loss
        and rate asked with it) by a relay process (``netns_relay``) on the bridge side.

        Raises:
            NetnsError: a ``tc`` command failed, or the relay did not start.
        """
        self._stop_relay(host)
        ends = [(["ip", "netns", "exec", ns, "tc"], dev) for ns, dev in self._link_ends(host)]
        for tc, dev in ends:
            _run(*tc, "qdisc", "del", "dev", dev, "root", check=False)
        if not (delay_ms or loss_pct or rate_mbit):
            return
        spec = ["delay", f"{delay_ms}ms"] if delay_ms else []
        spec += ["loss", f"{loss_pct}%"] if loss_pct else []
        spec += ["rate", f"{rate_mbit}mbit"] if rate_mbit else []
        if _netem(*ends[0], spec):
            _netem(*ends[1], spec)
        elif delay_ms:
            self._start_relay(host, delay_ms=delay_ms, loss_pct=loss_pct, rate_mbit=rate_mbit)
        else:
            for tc, dev in ends:
                _shape_without_netem(tc, dev, loss_pct=loss_pct, rate_mbit=rate_mbit)

    def _link_ends(self, host: str) -> list[tuple[str, str]]:
        return [(self.netns(host), "eth0"), (self.bridge_ns, netns_relay.port_name(host))]

    def _relay_files(self, host: str) -> tuple[Path, Path]:
        """The relay's pid file and log."""
        return Path(self.run_dir) / f"relay-{host}.pid", Path(self.run_dir) / "logs" / f"relay-{host}.log"

    def _start_relay(self, host: str, *, delay_ms: float, loss_pct: float, rate_mbit: float) -> int:
        """Start the relay that carries ``host``'s link; its pid once the link runs through it."""
        if not self.run_dir:
            raise NetnsError("a link delay without netem runs a relay process, which needs the deployment's run dir")
        pid_file, log = self._relay_files(host)
        log.parent.mkdir(parents=True, exist_ok=True)
        start = log.stat().st_size if log.exists() else 0
        cmd = ["ip", "netns", "exec", self.bridge_ns, sys.executable, "-m", netns_relay.__name__]
        cmd += ["--bridge-netns", self.bridge_ns, "--host-netns", self.netns(host), "--host", host]
        cmd += ["--delay-ms", str(delay_ms), "--loss", str(loss_pct), "--rate-mbit", str(rate_mbit)]
        with open(log, "ab") as out:
            relay = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        _RELAYS[relay.pid] = relay  # reaped when stopped (a CLI that started it exits first: init reaps it)
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline and relay.poll() is None:
            with open(log, "rb") as f:
                f.seek(start)
                if netns_relay.READY.encode() in f.read():
                    pid_file.write_text(f"{relay.pid}\n")
                    return relay.pid
            time.sleep(0.05)
        relay.kill()
        relay.wait()
        del _RELAYS[relay.pid]
        netns_relay.restore(self.bridge_ns, self.netns(host), host)
        tail = log.read_bytes()[start:].decode(errors="replace").strip().splitlines()[-5:]
        raise NetnsError(f"the link relay of {host} did not start: {' / '.join(tail) or 'no output'}")

    def _stop_relay(self, host: str) -> None:
        """Stop ``host``'s relay, if one runs (SIGTERM; SIGKILL after 5 s), and restore its link."""
        pid_file, _ = self._relay_files(host)
        try:
            pid = int(pid_file.read_text()) if self.run_dir else 0
        except (OSError, ValueError):
            pid = 0
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not pid or not _is_relay(pid, host) or _gone(pid):
                break
            with contextlib.suppress(ProcessLookupError):  # it exited in between
                os.kill(pid, sig)
            deadline = time.monotonic() + 5.0
            while not _gone(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
        if pid:
            pid_file.unlink(missing_ok=True)
        netns_relay.restore(self.bridge_ns, self.netns(host), host)  # also after a relay that died


_RELAYS: dict[int, subprocess.Popen] = {}  # relays this process started, by pid


def _is_relay(pid: int, host: str) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return netns_relay.__name__.encode() in argv and host.encode() in argv


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a relay this process started is reaped)."""
    if pid in _RELAYS:
        if _RELAYS[pid].poll() is None:
            return False
        del _RELAYS[pid]
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _netem(tc: list[str], dev: str, spec: list[str]) -> bool:
    """netem with ``spec`` as ``dev``'s root qdisc; False when the kernel has no netem.
    Raises NetnsError when netem refuses the request."""
    r = _run(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", *spec, check=False)
    if r.returncode != 0 and "unknown" not in r.stderr.lower():
        raise NetnsError(f"tc netem {' '.join(spec)} on {dev}: {r.stderr.strip()}")
    return r.returncode == 0


def _shape_without_netem(tc: list[str], dev: str, *, loss_pct: float, rate_mbit: float) -> None:
    """htb at ``rate_mbit`` (10 Gbit/s when 0) for every packet but a random ``loss_pct``
    percent, which a classic-BPF filter sends to a class whose queue holds none (dropped)."""
    rate = f"{rate_mbit}mbit" if rate_mbit else "10gbit"
    _run(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10", "r2q", "1000")
    _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", rate)
    if loss_pct:
        _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", "1mbit")
        _run(*tc, "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", "pfifo", "limit", "0")
        bpf = ["bpf", "bytecode", _loss_bytecode(loss_pct), "classid", "1:20"]
        _run(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "all", "prio", "1", *bpf)


def locked(fn):
    """Run ``fn()`` holding the machine-wide netns lock (deployment numbers are chosen under it)."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            return fn()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
