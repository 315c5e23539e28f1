"""The compose and Kubernetes forms' NATS identities: what their files name is what
``dualpath nats-auth`` makes, and a real nats-server run with compose's own nats.conf lets each
service in as itself and nobody in without credentials.

No Docker engine runs here, so the server runs as a process with the compose form's files in
the layout its volumes give them (``/etc/nats/dualpath.conf`` beside ``auth/``).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from pathlib import Path

import nats
import pytest
import yaml

from dualpath.bus.embedded import free_port, nats_server_binary
from dualpath.cli import nats_auth
from dualpath.config import BusConfig

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "deploy" / "compose"

# nats.py leaves the socket of a refused connection to the garbage collector (a ResourceWarning).
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _compose_services() -> dict[str, dict]:
    return yaml.safe_load((COMPOSE / "compose.yaml").read_text())["services"]


def _auth_args(svc: dict, out: Path) -> list[str]:
    argv = [str(a) for a in svc["command"]]
    assert argv[:2] == ["dualpath", "nats-auth"], argv
    args = argv[2:]
    args[args.index("--out") + 1] = str(out)
    del args[args.index("--owner") : args.index("--owner") + 2]  # compose runs it as root; this test does not
    return [a.replace("${DUALPATH_NAMESPACE:-dualpath}", "dualpath") for a in args]


def _mounted_identity(svc: dict) -> str | None:
    """The identity whose volume (``nats-<user>``) the service mounts where its settings look."""
    mounts = [v for v in svc.get("volumes") or [] if isinstance(v, dict) and v.get("target") == "/run/dualpath/nats"]
    if not mounts:
        return None
    assert len(mounts) == 1 and mounts[0].get("read_only") is True and mounts[0]["source"].startswith("nats-"), mounts
    return mounts[0]["source"].removeprefix("nats-")


def test_the_auth_job_writes_each_identity_into_a_volume_of_its_own() -> None:
    """Each folder nats-auth writes is its own volume there, mounted nowhere else but its service
    (and the server's in nats): no service can read another identity's password."""
    services = _compose_services()
    job = {v["target"]: v["source"] for v in services["nats-auth"]["volumes"]}
    assert job == {f"/auth/{v.removeprefix('nats-')}": v for v in job.values()}, job
    mounted_by: dict[str, list[str]] = {}
    for name, svc in services.items():
        for v in svc.get("volumes") or []:
            if isinstance(v, dict) and v.get("source") in job.values():
                mounted_by.setdefault(v["source"], []).append(name)
    assert mounted_by.pop("nats-server") == ["nats-auth", "nats"]
    assert all(len(users) == 2 and users[0] == "nats-auth" for users in mounted_by.values()), mounted_by


def test_every_compose_service_mounts_only_its_own_identity(tmp_path):
    services = _compose_services()
    assert nats_auth.main(_auth_args(services["nats-auth"], tmp_path)) == 0
    made = {p.name for p in tmp_path.iterdir() if p.is_dir()} - {"server"}
    users = {}
    for name, svc in services.items():
        env = svc.get("environment") or {}
        if "command" in svc and list(svc["command"])[:2] == ["dualpath", "service"]:
            user = env.get("DUALPATH_NATS_USER")
            assert user, f"{name} has no NATS identity"
            assert _mounted_identity(svc) == user, f"{name} mounts another identity's folder"
            users[name] = user
            if "DUALPATH_ENGINE_ID" in env:  # an engine publishes as itself: its ids are its identity's
                assert user.endswith("-" + env["DUALPATH_ENGINE_ID"]), (name, user)
            if name.startswith("traffic-manager-"):
                assert user == f"traffic-manager-{env['DUALPATH_NODE_ID']}", (name, user)
    assert set(users.values()) == made, (users, made)  # nothing made that no service uses, nothing missing


def _serve(conf_dir: Path) -> tuple[subprocess.Popen, int, Path]:
    port = free_port()
    conf = conf_dir / "dualpath.conf"
    lines = [ln for ln in (COMPOSE / "nats.conf").read_text().splitlines() if not ln.startswith(("port:", "http_port:"))]
    conf.write_text("\n".join([f"listen: 127.0.0.1:{port}", *lines]) + "\n")  # loopback, a free port, no monitoring
    log = conf_dir / "nats.log"
    with log.open("w") as out:
        proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port, log
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)


def test_compose_nats_conf_with_the_generated_users_admits_each_service_and_no_one_else(tmp_path):
    services = _compose_services()
    auth = tmp_path / "auth-volume"
    assert nats_auth.main(_auth_args(services["nats-auth"], auth)) == 0
    etc = tmp_path / "etc-nats"
    etc.mkdir()
    shutil.copytree(auth / "server", etc / "auth")  # the nats service's mount (the nats-server volume)
    proc, port, log = _serve(etc)
    try:

        async def go():
            url = f"nats://127.0.0.1:{port}"
            for svc in services.values():
                user = (svc.get("environment") or {}).get("DUALPATH_NATS_USER")
                if not user:
                    continue
                # the service's own settings, with its folder where compose mounts it
                cfg = BusConfig(nats_user=user, nats_password_file=str(auth / user / "password"))
                nc = await nats.connect(url, allow_reconnect=False, connect_timeout=3, **cfg.connect_options())
                await nc.flush()
                await nc.close()
            with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                await nats.connect(url, allow_reconnect=False, connect_timeout=3)

        asyncio.run(go())
    finally:
        proc.terminate()
        proc.wait(5)


def test_passwords_are_kept_across_runs_unless_rotated(tmp_path):
    args = ["--out", str(tmp_path), "--identity", "gateway:gw0", "--identity", "decode:d0e0@d0"]
    assert nats_auth.main(args) == 0
    first = (tmp_path / "gateway-gw0" / "password").read_text()
    assert nats_auth.main([*args, "--identity", "gateway:gw1"]) == 0
    assert (tmp_path / "gateway-gw0" / "password").read_text() == first
    assert nats_auth.main([*args, "--rotate"]) == 0
    assert (tmp_path / "gateway-gw0" / "password").read_text() != first
    assert oct((tmp_path / "gateway-gw0" / "password").stat().st_mode & 0o777) == "0o600"
    assert oct(tmp_path.stat().st_mode & 0o777) == "0o700"


def test_bad_identities_are_refused_with_a_clear_error(tmp_path, capsys):
    assert nats_auth.main(["--out", str(tmp_path), "--identity", "root:x"]) == 2
    assert "root" in capsys.readouterr().err
    assert nats_auth.main(["--out", str(tmp_path), "--identity", "decode:d0e0"]) == 2  # an engine needs its node
    assert "node" in capsys.readouterr().err
    assert nats_auth.main(["--out", str(tmp_path)]) == 2


def test_kubernetes_secrets_are_one_per_role_and_valid(tmp_path):
    manifest = tmp_path / "secrets.yaml"
    assert nats_auth.main(["--out", str(tmp_path / "auth"), "--k8s", "--k8s-secrets", str(manifest)]) == 0
    docs = list(yaml.safe_load_all(manifest.read_text()))
    names = {d["metadata"]["name"] for d in docs}
    assert "dualpath-nats-server" in names and "dualpath-nats-prefill-all" in names
    assert all(d["kind"] == "Secret" and d["data"] for d in docs)
    workloads = "\n".join(p.read_text() for p in (REPO / "deploy" / "k8s").glob("*.yaml"))
    for name in names:  # every secret the generator makes is one a manifest mounts, and back
        assert f"secretName: {name}" in workloads, name


def test_the_kubernetes_nats_config_is_valid_with_the_generated_secret(tmp_path):
    """nats-server itself checks deploy/k8s's config (``-t``), with the secret where the pod mounts it."""
    assert nats_auth.main(["--out", str(tmp_path / "auth"), "--k8s"]) == 0
    etc = tmp_path / "etc"
    (etc / "nats").mkdir(parents=True)
    shutil.copytree(tmp_path / "auth" / "server", etc / "nats-auth")  # the pod's secret mount
    docs = yaml.safe_load_all((REPO / "deploy" / "k8s" / "nats.yaml").read_text())
    conf = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["nats.conf"]
    conf = conf.replace("/etc/", f"{etc}/").replace("/data/", f"{tmp_path}/data/")
    (etc / "nats" / "nats.conf").write_text(conf)
    check = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(etc / "nats" / "nats.conf")],
        capture_output=True,
        text=True,
        env={"POD_NAME": "nats-0"},
        timeout=30,
    )
    assert check.returncode == 0 and "is valid" in check.stderr, check.stderr
