"""``dualpath nats-auth``: NATS identities, passwords and certificates for a deployment.

    dualpath nats-auth --out DIR --topology 1P1D [--replicas 2] [--tls --host nats]
    dualpath nats-auth --out DIR --k8s --k8s-secrets secrets.yaml   (then kubectl apply -f secrets.yaml)
    dualpath nats-auth --out DIR --identity prefill:p0e0@p0 --identity gateway:gw1 ...

``dualpath up`` makes all of this itself at start-up; this command is for the forms whose
processes it does not start (Docker Compose, Kubernetes, hand-run services). It writes:

    DIR/server/auth.conf          the server's users and permissions (include it in nats.conf)
    DIR/server/{ca,server,server-key}.pem      with --tls: the server's certificate
    DIR/<user>/password           one folder per identity: mount only that folder into its service
    DIR/<user>/{ca,cert,key}.pem  with --tls: its client certificate (mutual TLS)

and prints each user. A service connects with DUALPATH_NATS_USER=<user> and
DUALPATH_NATS_PASSWORD_FILE=<its folder>/password. Passwords already in DIR are kept, so
adding an identity does not log the others out; ``--rotate`` makes new ones. ``--topology``
names identities as ``dualpath up`` does (engine, node and gateway ids: each engine may publish
only as itself). ``--roles`` makes one shared identity per role, for deployments whose ids are
known only at run time (Kubernetes pods): an engine may then publish as any engine of its role.
"""

from __future__ import annotations

import argparse
import base64
import os
import shutil
import sys
from pathlib import Path

from dualpath.bus.auth import OPERATOR, ClusterAuth, ClusterTls, Identity, write_private
from dualpath.protocol.subjects import Role

__all__ = ["main"]


def _parse_identity(text: str) -> Identity:
    """``role:name`` or ``role:name@node`` (engines need their node)."""
    role, sep, rest = text.partition(":")
    if not sep or not rest:
        raise ValueError(f"--identity {text!r}: expected ROLE:NAME or ROLE:NAME@NODE (roles: {', '.join(r.value for r in Role)})")
    name, _, node = rest.partition("@")
    return Identity(role if role == OPERATOR else Role(role), name, node)


def _identities(ns: argparse.Namespace) -> list[Identity]:
    out: list[Identity] = []
    if ns.topology:
        from dualpath.cli.launcher.stack import stack_identities
        from dualpath.cli.launcher.topology import parse_topology

        out += stack_identities(parse_topology(ns.topology, ns.engines_per_node), ns.replicas, ns.gateway_id).values()
    if ns.roles:
        out += [Identity(role, "all", shared=True) for role in Role if role is not Role.OBSERVER]
    out += [_parse_identity(t) for t in ns.identity]
    if ns.observer:
        out.append(Identity(Role.OBSERVER, ns.observer))
    if not out:
        raise ValueError("no identities: give --topology, --roles or --identity")
    return out


def _k8s_secrets(out: Path, users: list[str], tls: bool) -> str:
    """Secret manifests: the server's (auth.conf and its certificate) and one per identity."""

    def secret(name: str, folder: Path) -> str:
        data = "\n".join(f"  {p.name}: {base64.b64encode(p.read_bytes()).decode()}" for p in sorted(folder.iterdir()) if p.is_file())
        return f"apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\n  namespace: dualpath\ntype: Opaque\ndata:\n{data}\n"

    docs = [secret("dualpath-nats-server", out / "server")]
    docs += [secret(f"dualpath-nats-{user}", out / user) for user in users]
    return "---\n".join(docs)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpath nats-auth", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder to write (created 0700)")
    p.add_argument("--namespace", default="dualpath", help="the deployment's subject namespace (DUALPATH_NAMESPACE)")
    p.add_argument("--topology", default="", help="xPyD: the identities of a stack of this shape, named as dualpath up names them")
    p.add_argument("--engines-per-node", type=int, default=1)
    p.add_argument("--replicas", type=int, default=1, help="schedulers and kv-persistence replicas")
    p.add_argument("--gateway-id", default="", help="the gateway's id (DUALPATH_GATEWAY_ID; default gw0)")
    p.add_argument("--roles", action="store_true", help="one shared identity per role (ids known only at run time)")
    p.add_argument("--identity", action="append", default=[], metavar="ROLE:NAME[@NODE]", help="one more identity (repeatable)")
    p.add_argument("--observer", default="", metavar="NAME", help="a read-only identity for tools and dashboards")
    p.add_argument("--operator", action="store_true", help="also an operator identity (every subject; for debugging, keep it offline)")
    p.add_argument("--tls", action="store_true", help="also a throwaway CA, the server's certificate and one client certificate each")
    p.add_argument("--host", action="append", default=[], help="with --tls: a name or address clients reach the server at (repeatable)")
    p.add_argument(
        "--owner",
        default="",
        metavar="UID[:GID]",
        help="hand what is written to this user (run as root; e.g. the services' uid in their images)",
    )
    p.add_argument("--rotate", action="store_true", help="new passwords for every identity (default: keep the ones in --out)")
    p.add_argument("--k8s-secrets", default="", metavar="FILE", help="also write Kubernetes Secret manifests of all of it to FILE")
    p.add_argument(
        "--k8s", action="store_true", help="what deploy/k8s mounts: --roles --tls with its servers' names (then give --k8s-secrets)"
    )
    return p


K8S_HOSTS = [  # the names deploy/k8s's clients and routes reach the NATS servers at
    *(f"nats-{i}.nats-cluster" for i in range(3)),
    *(f"nats-{i}.nats-cluster.dualpath.svc.cluster.local" for i in range(3)),
    "nats",
    "nats.dualpath.svc.cluster.local",
]


def _parse_owner(text: str) -> tuple[int, int] | None:
    if not text:
        return None
    uid, _, gid = text.partition(":")
    try:
        return int(uid), int(gid or uid)
    except ValueError:
        raise ValueError(f"--owner {text!r}: expected UID or UID:GID (numbers)") from None


def _hand_over(out: Path, folders: list[str], owner: tuple[int, int]) -> None:
    """Give each identity's folder (and the server's) and what is in it to ``owner``."""
    for name in folders:
        folder = out / name
        for path in (folder, *folder.rglob("*")):
            os.chown(path, *owner)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.k8s:
        ns.roles, ns.tls, ns.host = True, True, [*ns.host, *K8S_HOSTS]
    try:
        identities = _identities(ns)
        if ns.operator:
            identities.append(Identity(OPERATOR, "admin"))
        if ns.tls and not ns.host:
            raise ValueError("--tls needs at least one --host (the server certificate's names)")
        auth = ClusterAuth(ns.namespace)
        for identity in identities:
            auth.add(identity)
        auth.server_config()  # every identity's permissions resolve (an engine needs its node)
        owner = _parse_owner(ns.owner)
    except ValueError as exc:
        print(f"dualpath nats-auth: {exc}", file=sys.stderr)
        return 2
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    for user in auth.identities:
        kept = out / user / "password"
        if kept.exists() and not ns.rotate:
            auth.passwords[user] = kept.read_text().strip()
        write_private(kept, auth.passwords[user] + "\n")
    write_private(out / "server" / "auth.conf", auth.server_config())
    if ns.tls:
        tls = ClusterTls(out / ".tls", hosts=ns.host)
        for stem in ("ca", "server", "server-key"):
            shutil.copy2(tls.folder / f"{stem}.pem", out / "server" / f"{stem}.pem")
        for user in auth.identities:
            cert, key = tls.client(user)
            shutil.copy2(tls.ca_file, out / user / "ca.pem")
            shutil.copy2(cert, out / user / "cert.pem")
            shutil.copy2(key, out / user / "key.pem")
        shutil.rmtree(tls.folder)  # the CA's key is not kept: a new run makes a new authority
    if owner is not None:
        try:
            _hand_over(out, ["server", *auth.identities], owner)
        except PermissionError as exc:
            print(f"dualpath nats-auth: --owner {ns.owner}: {exc.strerror} ({exc.filename}); it needs root", file=sys.stderr)
            return 1
    if ns.k8s_secrets:
        write_private(Path(ns.k8s_secrets), _k8s_secrets(out, sorted(auth.identities), ns.tls))
    print(f"{len(auth.identities)} identities in {out} (namespace {ns.namespace}; server: {out / 'server' / 'auth.conf'})")
    for user, identity in sorted(auth.identities.items()):
        print(f"  {user:<28} {identity.role:<16} {out / user}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
