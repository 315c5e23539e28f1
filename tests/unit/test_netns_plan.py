"""Where ``dualpath netns`` puts each service, and the configuration it gives NATS servers on
hosts of their own (no namespace is made here: these run anywhere)."""

from __future__ import annotations

import pytest

from dualpath.cli.launcher.netns import NetnsNetwork, _loss_bytecode, plan_hosts, service_host
from dualpath.cli.launcher.stack import LocalPlacement, StackConfig, service_names
from dualpath.cli.launcher.topology import parse_topology
from dualpath.ha.natscluster import nats_servers


def _cfg(replicas: int) -> StackConfig:
    return StackConfig(
        model="m",
        topology=parse_topology("2P2D"),
        storage="s",
        run_dir="r",
        replicas=replicas,
        nats_cluster=3 if replicas > 1 else 1,
    )


def test_redundant_2p2d_has_a_host_per_replica_and_per_node():
    services = service_names(_cfg(2))
    assert plan_hosts(services) == ["gw", "n0", "n1", "n2", "k0", "k1", "s0", "s1", "p0", "p1", "d0", "d1"]
    by_host: dict[str, list[str]] = {}
    for s in services:
        by_host.setdefault(service_host(s), []).append(s)
    assert by_host["gw"] == ["gateway"]
    assert by_host["s1"] == ["scheduler-1"] and by_host["k0"] == ["kv-persistence"]
    assert by_host["d1"] == ["traffic-manager-d1", "decode-d1e0"]


def test_single_replica_plan_keeps_one_of_each():
    assert plan_hosts(service_names(_cfg(1))) == ["gw", "n0", "k0", "s0", "p0", "p1", "d0", "d1"]


def test_unknown_service_has_no_host():
    with pytest.raises(ValueError):
        service_host("jaeger")


def test_addresses_come_from_the_network_test_range_and_names_carry_the_prefix():
    net = NetnsNetwork(prefix="dpab12", n=7, host_names=["gw", "s0"])
    assert net.address("gw") == "198.18.7.10" and net.address("s0") == "198.18.7.11"
    assert net.netns("s0") == "dpab12-s0" and net.bridge_ns == "dpab12-br"
    assert len(net.root_veth) <= 15  # IFNAMSIZ
    with pytest.raises(ValueError):
        NetnsNetwork(prefix="Bad-Prefix", n=0, host_names=["gw"])


def test_nats_servers_on_their_own_hosts_route_to_each_other_on_the_standard_ports(tmp_path):
    hosts = ["198.18.7.11", "198.18.7.12", "198.18.7.13"]
    specs = nats_servers(3, tmp_path, hosts=hosts)
    assert [s.url for s in specs] == [f"nats://{h}:4222" for h in hosts]
    conf = (tmp_path / "nats" / "nats-1.conf").read_text()
    assert "listen: 198.18.7.12:4222" in conf
    assert "nats-route://198.18.7.11:6222" in conf and "nats-route://198.18.7.13:6222" in conf
    assert "nats-route://198.18.7.12" not in conf  # no route to itself


def test_loss_filter_matches_the_asked_share_of_random_values():
    code = _loss_bytecode(1.0).split(",")
    assert code[0] == "4" and code[2] == f"53 1 0 {int(0.01 * 2**32)}"


def test_local_placement_keeps_every_service_on_loopback():
    p = LocalPlacement("0.0.0.0")
    assert p.address("gateway") == "0.0.0.0" and p.address("traffic-manager-p0") == "127.0.0.1"
    assert p.command("scheduler", ["x"]) == ["x"]
