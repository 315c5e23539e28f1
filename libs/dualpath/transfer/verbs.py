"""The verbs transport: one-sided RDMA READ/WRITE over RC queue pairs (pyverbs).

A batch becomes lists of work requests, each list posted with one ``post_send`` (one
doorbell) and only its last request signalled; RC completes a QP's requests in order, so
that one completion says the whole list landed. The traffic class picks the queue pair, and
with it the InfiniBand service level or the RoCE DSCP (see ``verbs_qp``). Completions are
polled by one task that spins briefly, then backs off, and sleeps while nothing is in flight.

pyverbs ships with rdma-core (``apt install python3-pyverbs``), not on PyPI; it is imported
only when this transport starts, so every other transport works without it.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from dualpath.transfer._tasks import TaskSet
from dualpath.transfer.base import Transport, check_entries
from dualpath.transfer.errors import (
    PeerLostError,
    TransferError,
    TransferTimeoutError,
    TransportUnavailableError,
    UnknownRegionError,
)
from dualpath.transfer.nic import DuplexNic, EmulatedNic
from dualpath.transfer.region import MemoryRegion
from dualpath.transfer.types import RegionDescriptor, TrafficClass, TransferEntry
from dualpath.transfer.verbs_cm import CmListener, request_answer
from dualpath.transfer.verbs_qp import RcLink, VerbsDevice

__all__ = ["DEFAULT_DSCP", "DEFAULT_SERVICE_LEVELS", "VerbsTransport", "verbs_available"]

# The paper's IB settings put VL2 only in the low-priority arbitration table; with the
# identity SL→VL map, SL 2 is the KV lane and SL 0 a high-priority one.
DEFAULT_SERVICE_LEVELS = {TrafficClass.MODEL: 0, TrafficClass.KV: 2}
DEFAULT_DSCP = {TrafficClass.MODEL: 26, TrafficClass.KV: 10}  # AF31 / AF11
_SPIN_POLLS = 200  # empty polls answered with a bare yield before backing off
_BACKOFF_S = 0.0002

Handshake = Callable[[RegionDescriptor, dict[str, Any]], Awaitable[dict[str, Any]]]


def verbs_available(device: str | None = None) -> tuple[bool, str]:
    """Whether the verbs transport can run here, and why (not)."""
    try:
        from pyverbs.device import get_device_list
    except ImportError as exc:
        return False, (f"pyverbs is not installed ({exc}); it ships with rdma-core (apt install python3-pyverbs), there is no PyPI wheel")
    try:
        names = [d.name.decode() for d in get_device_list()]
    except Exception as exc:  # noqa: BLE001 - pyverbs raises PyverbsRDMAError when no device node exists
        return False, f"no RDMA device: listing devices failed ({exc})"
    if not names:
        return False, "no RDMA device found"
    if device is not None and device not in names:
        return False, f"RDMA device {device!r} not found (have {', '.join(names)})"
    return True, f"RDMA devices: {', '.join(names)}"


@dataclass(slots=True)
class _Inflight:
    future: asyncio.Future[None]
    link: RcLink
    cls: TrafficClass
    n_wrs: int
    peer: str
    region_id: str


class VerbsTransport(Transport):
    """One-sided transfers with RDMA verbs on one HCA port."""

    name = "verbs"

    def __init__(
        self,
        *,
        node_id: str,
        host: str = "127.0.0.1",
        nic: DuplexNic | EmulatedNic | None = None,
        device: str | None = None,
        port_num: int = 1,
        gid_index: int | None = None,
        service_levels: Mapping[TrafficClass, int] | None = None,
        dscp: Mapping[TrafficClass, int] | None = None,
        timeout_s: float = 30.0,
        max_send_wr: int = 256,
        cm_port: int = 0,
        handshake: Handshake | None = None,
    ) -> None:
        """``handshake(remote, offer) -> answer`` carries a QP offer to the remote
        transport's ``accept`` (over NATS in the services); without it a built-in TCP
        listener on ``host:cm_port`` does."""
        super().__init__(node_id=node_id, nic=nic)
        self.host = host
        self.device_name = device
        self.port_num = port_num
        self.gid_index = gid_index
        self.service_levels = dict(service_levels or DEFAULT_SERVICE_LEVELS)
        self.dscp = dict(dscp or DEFAULT_DSCP)
        self.timeout_s = timeout_s
        self.max_send_wr = max_send_wr
        self.endpoint = uuid.uuid4().hex
        self._handshake = handshake
        self._cm = CmListener(self.accept, host=host, port=cm_port)
        self._dev: VerbsDevice | None = None
        self._mrs: dict[str, Any] = {}  # region id -> MR (registered or used locally)
        self._links: dict[str, RcLink] = {}  # remote endpoint -> link we initiated
        self._accepted: dict[str, RcLink] = {}  # remote endpoint -> link it initiated
        self._dialing: dict[str, asyncio.Lock] = {}
        self._inflight: dict[int, _Inflight] = {}
        self._wr_ids = itertools.count(1)
        self._work = asyncio.Event()
        self._credit_freed = asyncio.Event()
        self._tasks = TaskSet(f"verbs-transport-{node_id}")

    async def start(self) -> None:
        """Open the device, start the completion poller and the QP listener.

        Raises:
            TransportUnavailableError: pyverbs is missing or no (such) RDMA device exists.
        """
        if self._dev is not None:
            return
        ok, reason = verbs_available(self.device_name)
        if not ok:
            raise TransportUnavailableError(self.name, reason)
        from pyverbs.device import get_device_list

        name = self.device_name or get_device_list()[0].name.decode()
        self._dev = VerbsDevice(name, port_num=self.port_num, gid_index=self.gid_index)
        if self._handshake is None:
            await self._cm.start()
        self._tasks.spawn(self._poll_completions(), name="poll-cq")

    async def close(self) -> None:
        """Fail work in flight, destroy queue pairs and memory registrations (idempotent)."""
        self._fail_inflight(None, PeerLostError("*", "transport closed"))
        await self._tasks.aclose()
        await self._cm.close()
        for link in [*self._links.values(), *self._accepted.values()]:
            link.close()
        self._links.clear()
        self._accepted.clear()
        for mr in self._mrs.values():
            mr.close()
        self._mrs.clear()
        if self._dev is not None:
            self._dev.close()
            self._dev = None

    def register(self, region: MemoryRegion) -> RegionDescriptor:
        """Register ``region`` with the HCA for remote read/write.

        Raises:
            ValueError: another region with the same id is registered.
            RuntimeError: the transport is not started.
        """
        self._add_local(region)
        mr = self._mr(region)
        return RegionDescriptor(
            region_id=region.region_id,
            node_id=self.node_id,
            size=region.size,
            transport=self.name,
            address={
                "endpoint": self.endpoint,
                "cm_host": self.host,
                "cm_port": self._cm.port,
                "addr": region.address,
                "rkey": int(mr.rkey),
            },
            # The HCA checks the rkey on every request; the region's key travels as for any
            # transport, so a same-node peer that maps the region through shm can check it.
            key=region.key,
        )

    def deregister(self, region_id: str) -> None:
        """Stop serving ``region_id``: its rkey becomes invalid at the HCA (idempotent)."""
        super().deregister(region_id)
        mr = self._mrs.pop(region_id, None)
        if mr is not None:
            mr.close()

    async def connect(self, remote: RegionDescriptor) -> None:
        """Learn ``remote`` and connect queue pairs to its transport if not yet connected.

        Raises:
            PeerLostError: the QP handshake failed.
        """
        await super().connect(remote)
        await self._link(remote)

    async def accept(self, offer: dict[str, Any]) -> dict[str, Any]:
        """Responder side of the QP handshake: connect new queue pairs to the offer's and
        return our answer (what a NATS handler calls with a peer's offer).

        Raises:
            RuntimeError: the transport is not started.
            PyverbsError: the queue pairs could not be connected.
        """
        link = self._new_link()
        try:
            link.connect(offer)
        except BaseException:
            link.close()
            raise
        old = self._accepted.pop(str(offer["endpoint"]), None)
        if old is not None:
            old.close()  # the peer restarted its side: its old QPs are gone
        self._accepted[str(offer["endpoint"])] = link
        return {"endpoint": self.endpoint, **link.local_info()}

    async def _transfer(
        self,
        local: MemoryRegion,
        entries: Sequence[TransferEntry],
        cls: TrafficClass,
        *,
        read: bool,
        links: tuple[EmulatedNic, ...] = (),
    ) -> int:
        """RDMA READ (``read``) or WRITE work requests; see ``Transport.read``/``write``."""
        total = check_entries(self, local, entries)
        if total == 0:
            return 0
        dev = self._device()
        opcode = getattr(dev.pv.e, "IBV_WR_RDMA_READ" if read else "IBV_WR_RDMA_WRITE")
        mr = self._mr(local)
        base = local.address
        futures: list[asyncio.Future[None]] = []

        async def move() -> None:
            for region_id, pieces in self._pieces(list(entries), base, dev.max_msg).items():
                remote = self._remote[region_id]
                link = await self._link(remote)
                for start in range(0, len(pieces), self.max_send_wr):
                    part = pieces[start : start + self.max_send_wr]
                    futures.append(await self._post(link, cls, opcode, mr, part, remote))
            await asyncio.gather(*futures)

        try:
            with anyio.fail_after(self.timeout_s):
                await self._paced(links, total, cls, move())
        except TimeoutError:
            # A QP whose requests never complete is unusable: drop it (its MR stays valid).
            stuck = {id(i.link): i for i in self._inflight.values() if i.future in futures}
            for item in stuck.values():
                self._drop_link(item.link, TransferTimeoutError(item.peer, self.timeout_s))
            raise TransferTimeoutError(", ".join(sorted({e.remote_region for e in entries})), self.timeout_s) from None
        return total

    def _pieces(self, chunk: list[TransferEntry], base: int, max_msg: int) -> dict[str, list[tuple[int, int, int, int]]]:
        """Group a chunk's entries by remote region id as (local addr, remote addr, rkey,
        length): one work request per piece of a strided entry, cutting pieces longer than
        the port's largest message."""
        out: dict[str, list[tuple[int, int, int, int]]] = {}
        for e in chunk:
            address = self._remote[e.remote_region].address
            raddr, rkey = int(address["addr"]), int(address["rkey"])
            pieces = out.setdefault(e.remote_region, [])
            for local_offset, remote_offset, length in e.pieces():
                for off in range(0, length, max_msg):
                    n = min(max_msg, length - off)
                    pieces.append((base + local_offset + off, raddr + remote_offset + off, rkey, n))
        return out

    async def _post(
        self,
        link: RcLink,
        cls: TrafficClass,
        opcode: int,
        mr: Any,
        part: list,
        remote: RegionDescriptor,
    ) -> asyncio.Future[None]:
        while link.credits[cls] < len(part):  # the send queue is full: wait for completions
            if link.closed:
                raise PeerLostError(self._peer_name(remote), "queue pair closed")
            self._credit_freed.clear()
            await self._credit_freed.wait()
        link.credits[cls] -= len(part)
        wr_id = next(self._wr_ids)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._inflight[wr_id] = _Inflight(future, link, cls, len(part), self._peer_name(remote), remote.region_id)
        try:
            link.post(cls, wr_id, opcode, int(mr.lkey), part)
        except Exception as exc:
            del self._inflight[wr_id]
            link.credits[cls] += len(part)
            raise TransferError(f"posting work requests failed: {exc}") from exc
        self._work.set()
        return future

    async def _poll_completions(self) -> None:
        dev = self._device()
        e = dev.pv.e
        empty = 0
        while True:
            if not self._inflight:
                self._work.clear()
                await self._work.wait()
                empty = 0
                continue
            count, wcs = dev.cq.poll(64)
            if not count:
                empty += 1
                await asyncio.sleep(0 if empty < _SPIN_POLLS else _BACKOFF_S)
                continue
            empty = 0
            for wc in wcs:
                self._complete(int(wc.wr_id), int(wc.status), e)
            self._credit_freed.set()
            await asyncio.sleep(0)

    def _complete(self, wr_id: int, status: int, e: Any) -> None:
        item = self._inflight.pop(wr_id, None)
        if item is None:
            return  # a flushed WR of a batch that already failed
        item.link.credits[item.cls] += item.n_wrs
        if status == int(e.IBV_WC_SUCCESS):
            if not item.future.done():
                item.future.set_result(None)
            return
        if status in (int(e.IBV_WC_RETRY_EXC_ERR), int(e.IBV_WC_RNR_RETRY_EXC_ERR)):
            error: TransferError = PeerLostError(item.peer, "RDMA retries exhausted")
        elif status in (int(e.IBV_WC_REM_ACCESS_ERR), int(e.IBV_WC_REM_INV_REQ_ERR)):
            error = UnknownRegionError(item.region_id, f"remote access refused (status {status})")
        elif status == int(e.IBV_WC_WR_FLUSH_ERR):
            error = PeerLostError(item.peer, "queue pair flushed after an earlier error")
        else:
            error = TransferError(f"{item.peer}: work request failed with status {status}")
        if not item.future.done():
            item.future.set_exception(error)
        self._drop_link(item.link, error)

    def _drop_link(self, link: RcLink, error: TransferError) -> None:
        """A QP in error state stays there: fail its work and forget the link."""
        self._fail_inflight(link, error)
        for table in (self._links, self._accepted):
            for key in [k for k, v in table.items() if v is link]:
                del table[key]
        link.close()
        self._credit_freed.set()  # senders waiting for this link's credits must fail now

    def _fail_inflight(self, link: RcLink | None, error: TransferError) -> None:
        for wr_id in [w for w, i in self._inflight.items() if link is None or i.link is link]:
            item = self._inflight.pop(wr_id)
            if not item.future.done():
                item.future.set_exception(error)

    async def _link(self, remote: RegionDescriptor) -> RcLink:
        endpoint = str(remote.address["endpoint"])
        link = self._links.get(endpoint)
        if link is not None:
            return link
        async with self._dialing.setdefault(endpoint, asyncio.Lock()):
            link = self._links.get(endpoint)
            if link is not None:
                return link
            link = self._new_link()
            offer = {"endpoint": self.endpoint, **link.local_info()}
            try:
                with anyio.fail_after(self.timeout_s):
                    if self._handshake is not None:
                        answer = await self._handshake(remote, offer)
                    else:
                        host, port = str(remote.address["cm_host"]), int(remote.address["cm_port"])
                        answer = await request_answer(host, port, offer)
                link.connect(answer)
            except Exception as exc:
                link.close()
                raise PeerLostError(self._peer_name(remote), f"QP handshake failed: {exc}") from exc
            self._links[endpoint] = link
            return link

    def _new_link(self) -> RcLink:
        return RcLink(
            self._device(),
            service_levels=self.service_levels,
            dscp=self.dscp,
            max_send_wr=self.max_send_wr,
        )

    def _mr(self, region: MemoryRegion) -> Any:
        mr = self._mrs.get(region.region_id)
        if mr is None:
            mr = self._mrs[region.region_id] = self._device().register(region.address, region.size)
        return mr

    def _device(self) -> VerbsDevice:
        if self._dev is None:
            raise RuntimeError("start() the verbs transport first")
        return self._dev

    @staticmethod
    def _peer_name(remote: RegionDescriptor) -> str:
        return f"{remote.node_id}@{remote.address.get('cm_host')}:{remote.address.get('cm_port')}"
