"""NATS identities and their permissions: one identity per service process, least privilege.

Each service connects as an ``Identity`` (its role and instance); the server's permissions for
it are derived from the subject table (``dualpath.protocol.subjects.RULES``, ``TM_TOPICS`` and
``STORES``), so what a role may publish and subscribe is written down once. Besides its rules
every identity may subscribe to its own reply inbox (``_INBOX.<user>.>``: the client is told to
use that prefix) and publish replies to the requests it received (``allow_responses``). A
client without credentials, or with wrong ones, is refused by the server.

``ClusterAuth`` makes a deployment's identities with fresh random passwords and writes the
server's ``authorization`` block; ``ClusterTls`` makes a throwaway certificate authority with a
server certificate and one client certificate per identity, for mutual TLS. Both are written
under a run directory, files 0600 in a 0700 folder; the passwords reach each service through
its environment (``DUALPATH_NATS_USER`` / ``DUALPATH_NATS_PASSWORD``), never its command line.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dualpath.protocol.subjects import RULES, STORES, TM_TOPICS, Role, Rule, Scope, Store, check_id

__all__ = ["OPERATOR", "ClusterAuth", "ClusterTls", "Identity", "permissions", "permissions_table", "write_private"]

OPERATOR = "operator"  # the launcher's own identity (tests, fault tools): every subject


@dataclass(frozen=True, slots=True)
class Identity:
    """One NATS user: a service process of ``role`` named ``name`` (engine, node or gateway id;
    a replica's name for the scheduler and kv-persistence); an engine also has its ``node``."""

    role: Role | str  # a Role, or OPERATOR
    name: str
    node: str = ""
    # One identity for every instance of the role, for deployments whose ids are known only at run
    # time (Kubernetes pods): its own-scope rules widen to every instance of the role.
    shared: bool = False

    def __post_init__(self) -> None:
        check_id(self.name, "identity name")
        if self.node:
            check_id(self.node, "node id")
        if self.role != OPERATOR:
            Role(self.role)  # ValueError on an unknown role

    @property
    def user(self) -> str:
        return f"{self.role}-{self.name}"

    @property
    def inbox(self) -> str:
        """The reply-inbox prefix this identity's client uses (and alone may subscribe to)."""
        return f"_INBOX.{self.user}"

    def ids(self) -> dict[str, str]:
        """The pattern fields an ``OWN`` scope fills for this identity."""
        if self.shared:
            return {}
        if self.role in (Role.PREFILL, Role.DECODE):
            return {"engine": self.name, "node": self.node}
        if self.role == Role.TRAFFIC_MANAGER:
            return {"node": self.name}
        if self.role == Role.GATEWAY:
            return {"gateway": self.name}
        return {}


_FIELD = re.compile(r"{(\w+)}")


def _pattern(rule: Rule, namespace: str, scope: Scope, identity: Identity) -> str:
    own = identity.ids() if scope is Scope.OWN else {}
    values: dict[str, str] = {}
    for f in _FIELD.findall(rule.pattern):
        if f == "ns":
            continue
        if scope is Scope.OWN and not identity.shared and f in ("engine", "node", "gateway") and not own.get(f):
            raise ValueError(f"{identity.user} has no {f} id for its own-scope rule {rule.pattern}")
        values[f] = own.get(f) or "*"
    return rule.pattern.format(ns=namespace, **values)


def _store_subjects(store: Store, namespace: str) -> list[str]:
    """What an owner of ``store`` publishes: its JetStream API calls, acks, flow control and data."""
    name = store.name.format(ns=namespace)
    stream = {"stream": name, "kv": f"KV_{name}", "object": f"OBJ_{name}"}[store.kind]
    api = [
        f"$JS.API.*.*.{stream}",  # STREAM.INFO / CREATE / UPDATE, DIRECT.GET
        f"$JS.API.*.*.{stream}.>",  # CONSUMER.CREATE / INFO / DELETE, DIRECT.GET by subject
        f"$JS.API.*.*.*.{stream}",  # STREAM.MSG.GET
        f"$JS.API.*.*.*.{stream}.>",  # CONSUMER.MSG.NEXT, CONSUMER.DURABLE.CREATE
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]
    data = {
        "stream": [store.subject.format(ns=namespace)],
        "kv": [f"$KV.{name}.>"],
        "object": [f"$O.{name}.>"],
    }[store.kind]
    return api + data


def permissions(identity: Identity, namespace: str) -> dict[str, Any]:
    """The server-side permissions of ``identity`` in ``namespace`` (a NATS ``permissions`` map).

    Raises:
        ValueError: an own-scope rule needs an id the identity lacks (e.g. an engine without a node).
    """
    check_id(namespace, "namespace")
    if identity.role == OPERATOR:
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    role = Role(identity.role)
    pub: set[str] = set()
    sub: set[str] = {f"{identity.inbox}.>"}
    for rule in [*RULES.values(), *TM_TOPICS.values()]:
        if (scope := rule.publish.get(role)) is not None:
            pub.add(_pattern(rule, namespace, scope, identity))
        if (scope := rule.subscribe.get(role)) is not None:
            sub.add(_pattern(rule, namespace, scope, identity))
    owned = [s for s in STORES.values() if role in s.owners]
    for store in owned:
        pub.update(_store_subjects(store, namespace))
    if owned:
        pub.update({"$JS.API.INFO", "$JS.API.STREAM.NAMES"})  # account limits; a stream found by its subject
    return {"publish": {"allow": sorted(pub)}, "subscribe": {"allow": sorted(sub)}, "allow_responses": True}


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable by its owner only (0600; the file is created so)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its old mode through O_CREAT
    return path


@dataclass(slots=True)
class ClusterAuth:
    """The identities of one deployment on one NATS (cluster), each with a random password."""

    namespace: str
    passwords: dict[str, str] = field(default_factory=dict)  # user -> password
    identities: dict[str, Identity] = field(default_factory=dict)  # user -> identity

    def add(self, identity: Identity) -> Identity:
        """Register ``identity`` with a fresh 192-bit password (again: the same one)."""
        if identity.user not in self.identities:
            self.identities[identity.user] = identity
            self.passwords[identity.user] = secrets.token_urlsafe(24)
        return identity

    def add_all(self, identities: Iterable[Identity]) -> None:
        for identity in identities:
            self.add(identity)

    def env(self, identity: Identity) -> dict[str, str]:
        """The environment that makes a service connect as ``identity`` (``BusConfig`` reads it)."""
        return {"DUALPATH_NATS_USER": identity.user, "DUALPATH_NATS_PASSWORD": self.passwords[identity.user]}

    def connect_options(self, identity: Identity) -> dict[str, Any]:
        """``nats.connect`` keyword arguments for ``identity`` (user, password, its inbox prefix)."""
        return {"user": identity.user, "password": self.passwords[identity.user], "inbox_prefix": identity.inbox}

    def server_config(self) -> str:
        """The server's ``authorization`` block: every identity with its permissions."""
        users = [
            {"user": user, "password": self.passwords[user], "permissions": permissions(identity, self.namespace)}
            for user, identity in sorted(self.identities.items())
        ]
        return "authorization: " + json.dumps({"users": users}, indent=1) + "\n"

    def write(self, folder: Path) -> Path:
        """Write the server's block to ``folder/auth.conf`` (0600) and return its path."""
        return write_private(Path(folder) / "auth.conf", self.server_config())


@dataclass(slots=True)
class ClusterTls:
    """A throwaway CA, a server certificate for ``hosts`` and one client certificate per user,
    as PEM files under ``folder`` (keys 0600). Valid for ``days`` days."""

    folder: Path
    hosts: list[str]
    days: int = 30
    _ca: Any = None

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        key, cert = self._issue("dualpath-nats-ca", ca=True)
        self._ca = (key, cert)
        self._write("ca", key, cert)
        self._write("server", *self._issue("nats-server", sans=self.hosts))

    @property
    def ca_file(self) -> str:
        return str(self.folder / "ca.pem")

    def server_config(self) -> str:
        """The server's ``tls`` block: its certificate, and client certificates required (mutual TLS)."""
        f = self.folder
        files = f'cert_file: "{f / "server.pem"}", key_file: "{f / "server-key.pem"}", ca_file: "{f / "ca.pem"}"'
        return f"tls {{ {files}, verify: true, timeout: 5 }}\n"

    def client(self, user: str) -> tuple[str, str]:
        """Issue (once) ``user``'s client certificate; return its (cert, key) paths."""
        cert, key = self.folder / f"{user}.pem", self.folder / f"{user}-key.pem"
        if not cert.exists():
            self._write(user, *self._issue(user))
        return str(cert), str(key)

    def env(self, user: str) -> dict[str, str]:
        cert, key = self.client(user)
        return {"DUALPATH_NATS_TLS_CA": self.ca_file, "DUALPATH_NATS_TLS_CERT": cert, "DUALPATH_NATS_TLS_KEY": key}

    def ssl_context(self, user: str):
        import ssl

        cert, key = self.client(user)
        ctx = ssl.create_default_context(cafile=self.ca_file)
        ctx.load_cert_chain(cert, key)
        return ctx

    def _write(self, stem: str, key: Any, cert: Any) -> None:
        from cryptography.hazmat.primitives import serialization

        pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        write_private(self.folder / f"{stem}-key.pem", pem_key.decode())
        (self.folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def _issue(self, common_name: str, *, ca: bool = False, sans: list[str] | None = None):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "DualPath"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.UTC)
        issuer_key, issuer = (key, name) if ca else (self._ca[0], self._ca[1].subject)
        builder = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=self.days))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            # a server's certificate also authenticates it to the other servers of a cluster (routes)
            usages = (
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                if sans is not None
                else [ExtendedKeyUsageOID.CLIENT_AUTH]
            )
            builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        if sans:
            alt: list[x509.GeneralName] = []
            for host in sans:
                try:
                    alt.append(x509.IPAddress(ipaddress.ip_address(host)))
                except ValueError:
                    alt.append(x509.DNSName(host))
            builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        return key, builder.sign(issuer_key, hashes.SHA256())


def permissions_table(namespace: str = "dualpath") -> str:
    """The subject table as Markdown: each subject, who publishes and who subscribes (``own``:
    only under the identity's own engine, node or gateway id). The security docs page holds it."""

    def roles(scopes) -> str:
        return ", ".join(f"{r.value}" + (" (own)" if s is Scope.OWN else "") for r, s in scopes.items()) or "-"

    rows = ["| subject | publish | subscribe |", "|---|---|---|"]
    for rule in [*RULES.values(), *TM_TOPICS.values()]:
        rows.append(f"| `{rule.pattern.format_map(_Keep(ns=namespace))}` | {roles(rule.publish)} | {roles(rule.subscribe)} |")
    for store in STORES.values():
        owners = ", ".join(sorted(r.value for r in store.owners))
        rows.append(f"| JetStream {store.kind} `{store.name.format(ns=namespace)}` | {owners} | {owners} |")
    return "\n".join(rows) + "\n"


class _Keep(dict):
    """``format_map`` mapping that leaves unknown fields as ``{field}``."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"
