"""What a node's traffic manager owns: the DRAM buffer (``buffer``) and the storage I/O queue (``storage_io``)."""

from dualpath.node.buffer import BufferFullError, BufferPool, Slot
from dualpath.node.storage_io import StorageIO

__all__ = ["BufferFullError", "BufferPool", "Slot", "StorageIO"]
