"""Throwaway certificates for data-plane TLS: a CA and one certificate per host.

For tests, the benchmark and ``dualpath up --data-tls`` (a stack on one machine, or on the
network namespaces of ``dualpath netns``), where nobody has a deployment CA to hand. A real
deployment brings its own CA and passes the files with ``--data-tls-ca/-cert/-key``.

Keys are ECDSA P-256 (a fast handshake), written mode 0600; each host certificate names its
host (an IP address or a DNS name) as its only subject alternative name and may serve and
dial (server and client auth), since every data-plane endpoint does both. Needs the
``cryptography`` package (the ``tls`` extra): import this module only to make certificates.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
except ImportError as exc:
    raise ImportError("making data-plane TLS certificates needs the cryptography package (pip install 'dualpath[tls]')") from exc

from dualpath.transfer.tls import TlsConfig

__all__ = ["make_pki"]


def make_pki(
    directory: str | os.PathLike[str], hosts: Sequence[str], *, days: int = 7, ca_name: str = "dualpath data-plane CA"
) -> dict[str, TlsConfig]:
    """Write a new CA (``ca.pem``) and a certificate and key for every host of ``hosts``
    into ``directory``; return each host's ``TlsConfig``.

    Raises:
        OSError: ``directory`` cannot be written.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_subject = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, ca_name)])
    ca = _builder(ca_subject, ca_subject, ca_key.public_key(), days).add_extension(
        x509.BasicConstraints(ca=True, path_length=0), critical=True
    )
    ca = ca.add_extension(
        x509.KeyUsage(
            digital_signature=False,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            key_cert_sign=True,
            crl_sign=True,
            encipher_only=False,
            decipher_only=False,
        ),
        critical=True,
    )
    ca_cert = _sign(ca, ca_key)
    ca_path = out / "ca.pem"
    ca_path.write_bytes(_pem(ca_cert))
    configs: dict[str, TlsConfig] = {}
    for host in dict.fromkeys(hosts):  # each once, in order
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, host)])
        cert = _builder(subject, ca_subject, key.public_key(), days)
        cert = cert.add_extension(x509.SubjectAlternativeName([_san(host)]), critical=False)
        cert = cert.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        cert = cert.add_extension(
            x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH, x509.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        stem = host.replace(":", "_")  # an IPv6 address as a file name
        cert_path, key_path = out / f"{stem}.pem", out / f"{stem}-key.pem"
        cert_path.write_bytes(_pem(_sign(cert, ca_key)))
        _write_private(key_path, _private_pem(key))
        configs[host] = TlsConfig(ca=str(ca_path), cert=str(cert_path), key=str(key_path))
    return configs


def _builder(subject: Any, issuer: Any, public_key: Any, days: int) -> Any:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks of a host's namespaces agree; others may not quite
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _sign(builder: Any, key: Any) -> Any:
    return builder.sign(key, hashes.SHA256())


def _san(host: str) -> Any:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _pem(cert: Any) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _private_pem(key: Any) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` readable by its owner only (created so, never widened)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
