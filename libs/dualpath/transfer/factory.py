"""``create_transport``: build a transport by name.

The one module that knows every concrete transport (the base class knows none of them, as
httpx's ``BaseTransport`` knows none of its transports); each is imported only when asked
for, so a host without pyverbs never imports the verbs module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dualpath.transfer.base import Transport
from dualpath.transfer.errors import TransportUnavailableError
from dualpath.transfer.nic import DuplexNic, EmulatedNic

if TYPE_CHECKING:
    from dualpath.transfer.tls import TlsConfig

__all__ = ["TRANSPORT_NAMES", "create_transport"]

TRANSPORT_NAMES = ("tcp", "shm", "verbs")


def create_transport(
    name: str,
    *,
    node_id: str,
    host: str = "127.0.0.1",
    nic: DuplexNic | EmulatedNic | None = None,
    data_tls: TlsConfig | None = None,
    **kw: Any,
) -> Transport:
    """Build the transport ``name`` ("tcp", "shm" or "verbs"); call ``start()`` next.

    ``host`` is the address the tcp server (or the verbs connection manager) listens on;
    ``nic`` the emulated NIC its traffic goes through (testbed); ``data_tls`` runs tcp over
    mutual TLS with these certificates (``--data-tls``); extra keywords go to the
    transport's constructor (e.g. ``timeout_s``, ``port``).

    Raises:
        TransportUnavailableError: unknown name, verbs without pyverbs / an RDMA device, or
            ``data_tls`` for a transport other than tcp (shm never leaves the host; RDMA
            traffic is the fabric's to protect).
    """
    if data_tls is not None and name != "tcp":
        raise TransportUnavailableError(name, "data-plane TLS is for the tcp transport only")
    if name == "tcp":
        from dualpath.transfer.tcp import TcpTransport

        return TcpTransport(node_id=node_id, host=host, nic=nic, tls=data_tls, **kw)
    if name == "shm":
        from dualpath.transfer.shm import ShmTransport

        return ShmTransport(node_id=node_id, nic=nic, **kw)
    if name == "verbs":
        from dualpath.transfer.verbs import VerbsTransport, verbs_available

        ok, reason = verbs_available()
        if not ok:
            raise TransportUnavailableError("verbs", reason)
        return VerbsTransport(node_id=node_id, host=host, nic=nic, **kw)
    raise TransportUnavailableError(name, f"unknown transport; choose one of {TRANSPORT_NAMES}")
