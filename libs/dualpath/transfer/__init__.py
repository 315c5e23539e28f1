"""The data plane: memory regions, transports (tcp, shm, verbs) and emulated NICs.

Bulk bytes move here, never over NATS: a transport registers ``MemoryRegion``s, hands out
``RegionDescriptor``s (plain dicts on the wire) for the control plane to deliver, and does
one-sided batched ``read``/``write`` of ``TransferEntry`` lists with a ``TrafficClass`` per
batch. Every region has a random key that only its descriptor hands out and every request
must present (``AccessDeniedError`` otherwise); tcp can run over mutual TLS (``tls``). An
``EmulatedNic`` shapes traffic to a link rate with two priorities; a ``DuplexNic`` is a
full-duplex pair of them. ``create_transport`` (``factory``) builds a transport by name.
"""

from dualpath.transfer.base import Transport
from dualpath.transfer.errors import (
    AccessDeniedError,
    OutOfBoundsError,
    PeerLostError,
    RegionExistsError,
    RegionInUseError,
    TransferError,
    TransferTimeoutError,
    TransportUnavailableError,
    UnknownRegionError,
)
from dualpath.transfer.factory import TRANSPORT_NAMES, create_transport
from dualpath.transfer.nic import DuplexNic, EmulatedNic, split_entries
from dualpath.transfer.region import MemoryRegion
from dualpath.transfer.types import RegionDescriptor, TrafficClass, TransferEntry

__all__ = [
    "TRANSPORT_NAMES",
    "AccessDeniedError",
    "DuplexNic",
    "EmulatedNic",
    "MemoryRegion",
    "OutOfBoundsError",
    "PeerLostError",
    "RegionDescriptor",
    "RegionExistsError",
    "RegionInUseError",
    "TrafficClass",
    "TransferEntry",
    "TransferError",
    "TransferTimeoutError",
    "Transport",
    "TransportUnavailableError",
    "UnknownRegionError",
    "available_transports",
    "create_transport",
    "split_entries",
]


def available_transports() -> dict[str, str]:
    """Map every transport name to ``""`` when it can run here, else to the reason why not."""
    from dualpath.transfer.verbs import verbs_available

    ok, reason = verbs_available()
    return {"tcp": "", "shm": "", "verbs": "" if ok else reason}
