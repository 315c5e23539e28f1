"""The link relay on real namespaces: ``NetnsNetwork.shape`` with a delay on a network of two
hosts (``gw`` and ``a``, no services). Where the kernel has netem, shape uses netem and these
tests run the relay directly through ``_start_relay``; the figures go to docs/netns.md."""

from __future__ import annotations

import json
import re
import socket
import statistics
import subprocess
import time
import uuid

import pytest
from faultkit import ip_state, netns_unusable, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.faults]
_WHY = netns_unusable()
pytestmark.append(pytest.mark.skipif(bool(_WHY), reason=_WHY or "ok"))

DELAY_MS = 50.0


@pytest.fixture()
def net(tmp_path):
    """Two hosts on a bridge, removed afterwards; the root namespace checked to be as before."""
    from dualpath.cli.launcher.netns import NetnsNetwork, locked

    before = ip_state()
    prefix = f"dpr{uuid.uuid4().hex[:5]}"

    def build() -> NetnsNetwork:
        made = NetnsNetwork(prefix=prefix, n=NetnsNetwork.choose_number(prefix), host_names=["gw", "a"], run_dir=str(tmp_path))
        made.create()
        return made

    try:
        yield locked(build)
    finally:
        NetnsNetwork.destroy_prefix(prefix)
        after = ip_state()
        for key in before:
            assert not [line for line in after[key] if prefix in line], (key, after[key])
            changed = set(before[key]) ^ set(after[key])
            assert all(re.search(r"dp[0-9a-z]+-|198\.1[89]\.", line) for line in changed), (key, changed)


def _gone(pid: int) -> bool:
    from dualpath.cli.launcher.netns import _gone

    return _gone(pid)


def _socket(netns: str, kind: int) -> socket.socket:
    from dualpath.cli.launcher.netns_relay import in_netns

    with in_netns(netns):
        return socket.socket(socket.AF_INET, kind)


def _connect_rtt(net, k: int = 7) -> float:
    """Median seconds of ``k`` TCP connects from host ``a`` to a listener on ``gw``."""
    srv = _socket(net.netns("gw"), socket.SOCK_STREAM)
    with srv:
        srv.bind((net.address("gw"), 0))
        srv.listen(k)
        took = []
        for _ in range(k):
            with _socket(net.netns("a"), socket.SOCK_STREAM) as c:
                c.settimeout(10)
                t = time.monotonic()
                c.connect(srv.getsockname())
                took.append(time.monotonic() - t)
            srv.accept()[0].close()
    return statistics.median(took)


def _udp_loss(net, n: int = 2000) -> float:
    """The share of ``n`` datagrams from ``a`` that never reach ``gw``.

    The path is warmed first (neighbour entries resolved through the relay), and the datagrams
    are paced, received as they come: bursts would also measure how fast the relay process
    gets the CPU back on a busy host, which overflows its socket buffers, not the link's loss."""
    rx, tx = _socket(net.netns("gw"), socket.SOCK_DGRAM), _socket(net.netns("a"), socket.SOCK_DGRAM)
    with rx, tx:
        rx.bind((net.address("gw"), 0))
        rx.settimeout(0.2)
        for _ in range(50):  # warm-up: until one datagram gets through
            tx.sendto(b"w", rx.getsockname())
            try:
                if rx.recv(128) == b"w":
                    break
            except TimeoutError:
                continue
        else:
            raise AssertionError("no datagram crossed the relay in 50 tries")
        rx.setblocking(False)
        got = 0
        for i in range(n):
            tx.sendto(b"d" * 64, rx.getsockname())
            time.sleep(0.0002)
            if i % 20 == 19:
                got += _drain(rx)
        deadline = time.monotonic() + 0.5  # the last ones are still in the relay's 2 ms queue
        while time.monotonic() < deadline:
            got += _drain(rx)
            time.sleep(0.01)
    return 1 - got / n


def _drain(sock: socket.socket) -> int:
    """Datagrams of the measurement waiting on ``sock`` (warm-up stragglers are not counted)."""
    count = 0
    while True:
        try:
            if sock.recv(128) != b"w":
                count += 1
        except BlockingIOError:
            return count


def _bridge_ports(net) -> dict[str, str]:
    """Each device of the bridge namespace and its master ('' when none)."""
    links = json.loads(subprocess.run(["ip", "-n", net.bridge_ns, "-j", "link"], capture_output=True, text=True, check=True).stdout)
    return {link["ifname"]: link.get("master", "") for link in links}


def _relay_on(net, **spec) -> None:
    """What ``shape`` does for a delay without netem, on a kernel with netem too."""
    net._stop_relay("a")
    net._start_relay("a", **{"delay_ms": 0.0, "loss_pct": 0.0, "rate_mbit": 0.0, **spec})


def test_the_relay_adds_its_delay_each_way_and_clearing_puts_the_port_back_on_the_bridge(net, tmp_path):
    base = _connect_rtt(net)
    _relay_on(net, delay_ms=DELAY_MS)
    pid = int((tmp_path / "relay-a.pid").read_text())
    ports = _bridge_ports(net)
    assert (ports["v-a"], ports["t-a"], ports["v-gw"]) == ("", "br0", "br0")  # the TAP stands in for a's port
    shaped = _connect_rtt(net)
    print(f"\nTCP connect round trip gw <- a: {base * 1000:.3f} ms; relay with {DELAY_MS:g} ms each way: {shaped * 1000:.1f} ms")
    assert base < 0.005
    assert 2 * DELAY_MS / 1000 <= shaped < 2 * DELAY_MS / 1000 + 0.025
    net.shape("a")  # clear
    assert _gone(pid) and not (tmp_path / "relay-a.pid").exists()
    ports = _bridge_ports(net)
    assert ports["v-a"] == "br0" and "t-a" not in ports
    assert _connect_rtt(net) < 0.005
    assert "relay a stopped" in (tmp_path / "logs" / "relay-a.log").read_text()


def test_the_relay_drops_its_loss_share_and_destroy_removes_a_running_relay(net, tmp_path):
    _relay_on(net, delay_ms=2.0, loss_pct=20.0)
    loss = _udp_loss(net)
    print(f"\nUDP one way through the relay at 20% loss: {loss:.1%} lost")
    assert 0.14 <= loss <= 0.26  # 2000 datagrams: 20% within 6 standard deviations
    pid = int((tmp_path / "relay-a.pid").read_text())
    net.destroy()  # what `dualpath netns down` does last
    wait_until(lambda: _gone(pid), 5)  # SIGKILLed: gone a moment later
