"""``dualpath up`` and a service run alone agree on every default they share: the config dataclasses'."""

from __future__ import annotations

import pytest

from dualpath.cli.launcher.up import build_parser
from dualpath.config import EmulationConfig, EngineConfig, GatewayConfig, ModelConfigSpec, NodeConfig, SchedulerConfig, default_of

SHARED = [
    ("port", GatewayConfig, "port"),
    ("host", GatewayConfig, "host"),
    ("policy", SchedulerConfig, "policy"),
    ("read_path", SchedulerConfig, "read_path"),
    ("device", ModelConfigSpec, "device"),
    ("buffer_mb", NodeConfig, "buffer_mb"),
    ("compute", EmulationConfig, "compute"),
    ("target", EmulationConfig, "target"),
    ("scale", EmulationConfig, "scale"),
    ("snic_gbps", EmulationConfig, "snic_gbps"),
    ("cnic_gbps", EmulationConfig, "cnic_gbps"),
    ("gpus_per_node", EmulationConfig, "gpus_per_node"),
    ("compute_quota_ms", EngineConfig, "compute_quota_ms"),
]


@pytest.mark.parametrize(("flag", "cls", "name"), SHARED, ids=[s[0] for s in SHARED])
def test_dualpath_up_takes_its_default_from_the_config_dataclass(flag, cls, name) -> None:
    assert getattr(build_parser().parse_args([]), flag) == default_of(cls, name) == getattr(cls(), name)


def test_the_buffer_and_scale_defaults_are_the_services_ones() -> None:
    ns = build_parser().parse_args([])
    assert ns.buffer_mb == NodeConfig().buffer_mb and ns.scale == EmulationConfig().scale
