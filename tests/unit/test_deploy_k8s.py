"""The Kubernetes manifests of the redundant form: valid against the Kubernetes schemas (strict,
offline), no single point of failure, probes everywhere, and only configuration the services read."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dualpath.config import (
    BusConfig,
    EmulationConfig,
    EngineConfig,
    GatewayConfig,
    KvPersistenceConfig,
    ModelConfigSpec,
    NodeConfig,
    SchedulerConfig,
    env_vars,
)

kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.37.0"


def _docs() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _by(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in _docs() if d["kind"] == kind}


def _containers() -> list[tuple[str, dict]]:
    out = []
    for d in _docs():
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
            out += [(d["metadata"]["name"], c) for c in d["spec"]["template"]["spec"]["containers"]]
    return out


@pytest.mark.parametrize("doc", [d for d in _docs() if d["kind"] != "Kustomization"], ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_is_valid_against_the_kubernetes_schema(doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_lists_every_manifest_file():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def test_no_role_runs_a_single_copy_and_nats_is_a_jetstream_cluster():
    nats = _by("StatefulSet")["nats"]
    assert nats["spec"]["replicas"] == 3
    conf = _by("ConfigMap")["nats-config"]["data"]["nats.conf"]
    assert "jetstream" in conf and conf.count("nats-cluster.dualpath.svc") == 3
    deployments = _by("Deployment")
    assert deployments["scheduler"]["spec"]["replicas"] >= 2
    assert "--leader-lease" in deployments["scheduler"]["spec"]["template"]["spec"]["containers"][0]["args"]
    kvp = deployments["kv-persistence"]
    assert kvp["spec"]["replicas"] >= 2
    env = {e["name"]: e.get("value") for e in kvp["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["DUALPATH_INDEX_REPLICATION"] == "jetstream"
    assert deployments["gateway"]["spec"]["replicas"] >= 2
    assert "traffic-manager" in _by("DaemonSet")
    assert {"prefill-engine", "decode-engine"} <= set(_by("StatefulSet"))
    for name in ("nats", "scheduler", "kv-persistence", "gateway"):
        assert name in _by("PodDisruptionBudget")


def test_every_container_has_liveness_and_readiness_probes():
    for name, c in _containers():
        assert "livenessProbe" in c and "readinessProbe" in c, name
    gateway = dict(_containers())["gateway"]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"


def test_every_dualpath_variable_set_is_one_the_services_read():
    known = set(
        env_vars(BusConfig, ModelConfigSpec, NodeConfig, EngineConfig, EmulationConfig, SchedulerConfig, KvPersistenceConfig, GatewayConfig)
    ) | {"DUALPATH_LOG_LEVEL"}
    used = set(_by("ConfigMap")["dualpath-common"]["data"])
    for _name, c in _containers():
        used |= {e["name"] for e in c.get("env", [])}
    unknown = {v for v in used if v.startswith("DUALPATH_")} - known
    assert not unknown, unknown
