"""What a node's traffic manager owns: the DRAM buffer (``buffer``: first-fit placement;
``slots``: the slots of request attempts and their lifecycle; ``prefetch``: staged runs beside
them) and the storage I/O queue (``storage_io``)."""

from dualpath.node.buffer import BufferFullError, BufferPool, Slot
from dualpath.node.slots import NodeBuffer, slot_key
from dualpath.node.storage_io import StorageIO

__all__ = ["BufferFullError", "BufferPool", "NodeBuffer", "Slot", "StorageIO", "slot_key"]
