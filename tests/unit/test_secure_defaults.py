"""What each deployment form locks down without being asked: NATS identities everywhere, mutual
TLS one flag away on one host and on by default where traffic leaves a host (``dualpath netns
up``, Kubernetes). Compose's identities and TLS: ``test_deploy_nats_auth.py``."""

from __future__ import annotations

from pathlib import Path

import yaml

from dualpath.cli.launcher import netns_up, up
from dualpath.cli.launcher.stack import StackConfig

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"


def _k8s_docs() -> list[dict]:
    return [d for p in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def test_dualpath_up_runs_nats_with_identities_by_default_and_mutual_tls_is_one_flag_away():
    plain = up.build_parser().parse_args([])
    assert (plain.nats_open, plain.nats_tls, plain.data_tls) == (False, False, False)
    assert StackConfig.__dataclass_fields__["nats_auth"].default is True  # what `not --nats-open` gives
    flagged = up.build_parser().parse_args(["--nats-tls", "--data-tls"])
    assert (flagged.nats_tls, flagged.data_tls) == (True, True)


def test_netns_up_speaks_mutual_tls_on_nats_and_the_data_plane_unless_told_not_to():
    on = netns_up._parser().parse_args(["up"])
    assert (on.nats_tls, on.data_tls) == (True, True)
    off = netns_up._parser().parse_args(["up", "--no-nats-tls", "--no-data-tls"])
    assert (off.nats_tls, off.data_tls) == (False, False)


def test_kubernetes_nats_wants_client_certificates_on_clients_and_routes_and_every_service_dials_tls():
    config = next(d for d in _k8s_docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "nats-config")
    conf = config["data"]["nats.conf"]
    assert conf.count("verify: true") == 2  # the client port's tls block and the cluster's
    assert 'include "../nats-auth/auth.conf"' in conf  # the per-role users and permissions
    common = next(d for d in _k8s_docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "dualpath-common")["data"]
    assert all(url.startswith("tls://") for url in common["DUALPATH_NATS_URL"].split(","))
    assert common["DUALPATH_NATS_TLS_CERT"] and common["DUALPATH_NATS_TLS_KEY"]
    dualpath = [
        (d["metadata"]["name"], c)
        for d in _k8s_docs()
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
        for c in d["spec"]["template"]["spec"]["containers"]
        if str(c.get("image", "")).startswith("dualpath")
    ]
    assert dualpath
    for name, container in dualpath:
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get("DUALPATH_NATS_USER"), f"{name} connects without an identity of its own"
