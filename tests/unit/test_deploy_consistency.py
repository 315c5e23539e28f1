"""The compose and Kubernetes forms describe the same deployment: the same services, NATS
identities of the same roles, the same ports, probes and NATS limits, and the same settings
wherever both set one (differences by design are listed, each with its reason)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import yaml

from dualpath.ha.natscluster import MAX_PAYLOAD

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "deploy" / "compose"
K8S = REPO / "deploy" / "k8s"

# Settings both forms give a service, with values that differ on purpose.
BY_DESIGN = {
    "DUALPATH_NATS_USER": "compose knows every instance's id, Kubernetes pods share one identity per role",
    "DUALPATH_TRANSPORT": "tcp on one Docker host, verbs (RDMA) on GPU nodes",
    "DUALPATH_BUFFER_MB": "a dev buffer against a production node's DRAM",
    "DUALPATH_DEVICE": "CPU engines in the dev stack, GPUs on Kubernetes",
    "DUALPATH_POLICY": "compose lets the shell override it; the value is the same default",
}


@functools.cache
def _compose() -> dict[str, dict[str, str]]:
    """``dualpath service NAME`` -> the environment compose gives it (every instance merged)."""
    out: dict[str, dict[str, str]] = {}
    services = yaml.safe_load((COMPOSE / "compose.yaml").read_text())["services"]
    for svc in services.values():
        cmd = [str(c) for c in svc.get("command") or []]
        if cmd[:2] == ["dualpath", "service"]:
            out.setdefault(cmd[2], {}).update({k: str(v) for k, v in (svc.get("environment") or {}).items()})
    return out


@functools.cache
def _k8s() -> dict[str, dict]:
    """``dualpath service NAME`` -> its Kubernetes container (and the workload's pod spec)."""
    out: dict[str, dict] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") not in ("Deployment", "StatefulSet", "DaemonSet"):
                continue
            pod = doc["spec"]["template"]["spec"]
            for c in pod["containers"]:
                m = re.search(r"dualpath service ([a-z-]+)", " ".join(str(x) for x in [*c.get("command", []), *c.get("args", [])]))
                if m is None and c.get("command", [])[:2] == ["dualpath", "service"]:
                    out[c["command"][2]] = {"container": c, "pod": pod}
                elif m is not None:
                    out[m.group(1)] = {"container": c, "pod": pod}
    return out


def _k8s_env(service: str) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in _k8s()[service]["container"].get("env", []) if "value" in e}


def _k8s_common() -> dict[str, str]:
    docs = yaml.safe_load_all((K8S / "storage.yaml").read_text())
    return next(d for d in docs if d and d["kind"] == "ConfigMap" and d["metadata"]["name"] == "dualpath-common")["data"]


def test_both_forms_run_the_same_services():
    assert (
        set(_compose()) == set(_k8s()) == {"gateway", "scheduler", "kv-persistence", "traffic-manager", "prefill-engine", "decode-engine"}
    )


def test_each_service_connects_as_an_identity_of_the_same_role():
    for service, env in _compose().items():
        compose_role = env["DUALPATH_NATS_USER"].rsplit("-", 1)[0]
        k8s_role = _k8s_env(service)["DUALPATH_NATS_USER"].rsplit("-", 1)[0]
        assert compose_role == k8s_role, (service, compose_role, k8s_role)
        mounts = {v["name"]: v for v in _k8s()[service]["pod"]["volumes"]}
        assert mounts["nats-identity"]["secret"]["secretName"] == f"dualpath-nats-{_k8s_env(service)['DUALPATH_NATS_USER']}"


def test_settings_both_forms_give_agree_or_differ_by_design():
    for service, env in _compose().items():
        k8s = _k8s_env(service)
        for name in sorted(set(env) & set(k8s) - set(BY_DESIGN)):
            assert env[name] == k8s[name], f"{service}: {name} is {env[name]!r} in compose, {k8s[name]!r} on Kubernetes"


def test_ids_compose_sets_are_derived_on_kubernetes():
    """An engine and a traffic manager need their node id, an engine its own id: compose writes
    them, Kubernetes takes them from the pod (the node's name, the pod's name)."""
    for service in ("traffic-manager", "prefill-engine", "decode-engine"):
        c = _k8s()[service]["container"]
        text = " ".join(str(x) for x in [*c.get("command", []), *c.get("args", [])])
        assert "DUALPATH_NODE_ID" in _compose()[service] and "export DUALPATH_NODE_ID=" in text, service
    for service in ("prefill-engine", "decode-engine"):
        refs = {e["name"]: e.get("valueFrom", {}) for e in _k8s()[service]["container"]["env"]}
        assert refs["DUALPATH_ENGINE_ID"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_ports_and_probes_match():
    compose_text = (COMPOSE / "compose.yaml").read_text()
    metrics = _k8s_common()["DUALPATH_METRICS_PORT"]
    assert f'DUALPATH_METRICS_PORT: "{metrics}"' in compose_text
    prometheus = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    targets = [t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert {t.rsplit(":", 1)[1] for t in targets if not t.startswith("gateway:")} == {metrics}
    for service, spec in _k8s().items():
        ports = {p["name"]: p["containerPort"] for p in spec["container"]["ports"]}
        assert str(ports["metrics"]) == metrics, service
    gateway = _k8s()["gateway"]["container"]
    port = _compose()["gateway"]["DUALPATH_PORT"]
    assert {p["name"]: str(p["containerPort"]) for p in gateway["ports"]}["http"] == port == _k8s_env("gateway")["DUALPATH_PORT"]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert f"http://127.0.0.1:{port}/health" in compose_text  # compose's gateway healthcheck


def test_every_nats_server_takes_the_same_payload_limit():
    compose_conf = (COMPOSE / "nats.conf").read_text()
    k8s_conf = next(d for d in yaml.safe_load_all((K8S / "nats.yaml").read_text()) if d["kind"] == "ConfigMap")["data"]["nats.conf"]
    embedded = (REPO / "libs" / "dualpath" / "bus" / "embedded.py").read_text()
    for text in (compose_conf, k8s_conf, embedded):
        assert f"max_payload: {MAX_PAYLOAD}" in text
