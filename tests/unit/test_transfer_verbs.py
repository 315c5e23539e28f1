"""The verbs transport's logic on a simulated HCA, plus its skip reason on this host.

The real transport needs pyverbs and an RDMA device (the contract tests run it there). Here
a stand-in ``pyverbs`` with the same classes and call signatures (rdma-core's pyverbs:
Context, PD, MR(pd, length, access, address=), CQ.poll, QP.to_rts, QP.post_send of a
``next_wr`` chain, SendWR.set_wr_rdma, AHAttr/GlobalRoute) executes work requests with
memmove, so the batching, signalling, traffic-class mapping, completion and error paths of
``VerbsTransport`` are exercised on every machine.
"""

from __future__ import annotations

import ctypes
import itertools
import sys
import types
import uuid
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest

from dualpath.transfer import (
    MemoryRegion,
    PeerLostError,
    TrafficClass,
    TransferEntry,
    UnknownRegionError,
)
from dualpath.transfer.peer import pattern
from dualpath.transfer.verbs import VerbsTransport, verbs_available

pytestmark = pytest.mark.anyio

E = SimpleNamespace(  # the values of rdma-core's enums
    IBV_ACCESS_LOCAL_WRITE=1,
    IBV_ACCESS_REMOTE_WRITE=2,
    IBV_ACCESS_REMOTE_READ=4,
    IBV_WR_RDMA_WRITE=0,
    IBV_WR_RDMA_READ=4,
    IBV_SEND_SIGNALED=2,
    IBV_QPT_RC=2,
    IBV_WC_SUCCESS=0,
    IBV_WC_WR_FLUSH_ERR=5,
    IBV_WC_REM_INV_REQ_ERR=9,
    IBV_WC_REM_ACCESS_ERR=10,
    IBV_WC_RETRY_EXC_ERR=12,
    IBV_WC_RNR_RETRY_EXC_ERR=13,
    IBV_LINK_LAYER_INFINIBAND=1,
    IBV_LINK_LAYER_ETHERNET=2,
    IBV_GID_TYPE_SYSFS_ROCE_V2=1,
)


class Hca:
    """The simulated fabric: every MR and QP of the process."""

    def __init__(self, roce: bool) -> None:
        self.roce = roce
        self.mrs: dict[int, MR] = {}
        self.qps: dict[int, QP] = {}
        self.keys = itertools.count(0x100)
        self.posts: list[list[tuple[int, int]]] = []  # per post_send: (opcode, send_flags)


HCA = Hca(roce=True)


class PyverbsError(Exception):
    pass


class Context:
    def __init__(self, name: str) -> None:
        self.name = name

    def query_port(self, port: int):
        layer = E.IBV_LINK_LAYER_ETHERNET if HCA.roce else E.IBV_LINK_LAYER_INFINIBAND
        return SimpleNamespace(
            lid=0 if HCA.roce else 7,
            active_mtu=5,
            link_layer=layer,
            max_msg_sz=1 << 31,
            gid_tbl_len=3,
        )

    def query_device(self):
        return SimpleNamespace(max_qp_rd_atom=16, max_cqe=1 << 22)

    def query_gid(self, port: int, index: int) -> str:
        return [
            "fe80:0000:0000:0000:0000:0000:0000:0001",
            "0000:0000:0000:0000:0000:ffff:0a00:0001",
            "0000:0000:0000:0000:0000:0000:0000:0000",
        ][index]

    def query_gid_type(self, port: int, index: int) -> int:
        return E.IBV_GID_TYPE_SYSFS_ROCE_V2 if index == 1 else 0

    def close(self) -> None:
        pass


class PD:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx


class CQ:
    def __init__(self, ctx: Context, cqe: int) -> None:
        self.wcs: deque = deque()

    def poll(self, num_entries: int = 1):
        out = [self.wcs.popleft() for _ in range(min(num_entries, len(self.wcs)))]
        return len(out), out


class MR:
    def __init__(self, pd: PD, length: int, access: int, address: int | None = None) -> None:
        assert address, "the transport registers existing memory"
        self.addr, self.length, self.access = address, length, access
        self.lkey = self.rkey = next(HCA.keys)
        HCA.mrs[self.rkey] = self

    def close(self) -> None:
        HCA.mrs.pop(self.rkey, None)


class QPCap:
    def __init__(self, max_send_wr=1, max_recv_wr=10, max_send_sge=1, max_recv_sge=1) -> None:
        self.max_send_wr = max_send_wr


class QPInitAttr:
    def __init__(self, qp_type, scq=None, rcq=None, cap=None, sq_sig_all=1) -> None:
        self.qp_type, self.scq, self.cap, self.sq_sig_all = qp_type, scq, cap, sq_sig_all


class QPAttr:
    def __init__(self, port_num=1, path_mtu=3) -> None:
        self.port_num, self.path_mtu = port_num, path_mtu


class GID:
    def __init__(self, val: str) -> None:
        self.gid = val


class GlobalRoute:
    def __init__(self, dgid, flow_label=0, sgid_index=0, hop_limit=1, traffic_class=0) -> None:
        self.dgid, self.sgid_index, self.traffic_class = dgid, sgid_index, traffic_class


class AHAttr:
    def __init__(self, dlid=0, sl=0, src_path_bits=0, static_rate=0, is_global=0, port_num=1, gr=None) -> None:
        self.dlid, self.sl, self.is_global, self.gr = dlid, sl, is_global, gr


class SGE:
    def __init__(self, addr: int, length: int, lkey: int) -> None:
        self.addr, self.length, self.lkey = addr, length, lkey


class SendWR:
    def __init__(self, wr_id=0, opcode=0, num_sge=0, imm_data=0, sg=None, send_flags=E.IBV_SEND_SIGNALED) -> None:
        assert num_sge == 1 and len(sg) == 1
        self.wr_id, self.opcode, self.sge, self.send_flags = wr_id, opcode, sg[0], send_flags
        self.chained = None

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey, self.remote_addr = rkey, addr

    @property
    def next_wr(self):
        raise AssertionError("pyverbs cannot read next_wr back")

    @next_wr.setter
    def next_wr(self, wr: SendWR) -> None:
        self.chained = wr


class QP:
    def __init__(self, pd: PD, init: QPInitAttr) -> None:
        self.qp_num = next(HCA.keys)
        self.cq, self.init, self.attr, self.alive, self.failed = init.scq, init, None, True, False
        HCA.qps[self.qp_num] = self

    def to_rts(self, attr: QPAttr) -> None:
        self.attr = attr

    def close(self) -> None:
        self.alive = False
        HCA.qps.pop(self.qp_num, None)

    def post_send(self, wr: SendWR) -> None:
        chain = []
        while wr is not None:
            chain.append(wr)
            wr = wr.chained
        assert len(chain) <= self.init.cap.max_send_wr, "send queue overflow"
        HCA.posts.append([(w.opcode, w.send_flags) for w in chain])
        for w in chain:  # a QP that failed a request is in the error state: it flushes the rest
            status = E.IBV_WC_WR_FLUSH_ERR if self.failed else self._execute(w)
            self.failed = self.failed or status != E.IBV_WC_SUCCESS
            if status != E.IBV_WC_SUCCESS or w.send_flags & E.IBV_SEND_SIGNALED:
                self.cq.wcs.append(SimpleNamespace(wr_id=w.wr_id, status=status))

    def _execute(self, w: SendWR) -> int:
        peer = HCA.qps.get(self.attr.dest_qp_num)
        if peer is None or not peer.alive:
            return E.IBV_WC_RETRY_EXC_ERR
        mr, local = HCA.mrs.get(w.rkey), HCA.mrs.get(w.sge.lkey)
        n = w.sge.length
        if mr is None or not mr.addr <= w.remote_addr <= mr.addr + mr.length - n:
            return E.IBV_WC_REM_ACCESS_ERR
        assert local is not None and local.addr <= w.sge.addr <= local.addr + local.length - n
        if w.opcode == E.IBV_WR_RDMA_READ:
            ctypes.memmove(w.sge.addr, w.remote_addr, n)
        else:
            ctypes.memmove(w.remote_addr, w.sge.addr, n)
        return E.IBV_WC_SUCCESS


def _module(name: str, **attrs: object) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=[True, False], ids=["roce", "infiniband"])
def fake_pyverbs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Hca:
    global HCA
    HCA = Hca(roce=request.param)
    modules = {
        "pyverbs": _module("pyverbs"),
        "pyverbs.enums": _module("pyverbs.enums", **vars(E)),
        "pyverbs.device": _module(
            "pyverbs.device",
            Context=Context,
            get_device_list=lambda: [SimpleNamespace(name=b"sim_0")],
        ),
        "pyverbs.pd": _module("pyverbs.pd", PD=PD),
        "pyverbs.mr": _module("pyverbs.mr", MR=MR),
        "pyverbs.cq": _module("pyverbs.cq", CQ=CQ),
        "pyverbs.qp": _module("pyverbs.qp", QP=QP, QPAttr=QPAttr, QPCap=QPCap, QPInitAttr=QPInitAttr),
        "pyverbs.wr": _module("pyverbs.wr", SGE=SGE, SendWR=SendWR),
        "pyverbs.addr": _module("pyverbs.addr", GID=GID, AHAttr=AHAttr, GlobalRoute=GlobalRoute),
        "pyverbs.pyverbs_error": _module("pyverbs.pyverbs_error", PyverbsError=PyverbsError),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return HCA


@pytest.fixture
async def verbs_pair(fake_pyverbs: Hca):
    initiator = VerbsTransport(node_id="engine", max_send_wr=128, timeout_s=5.0)
    target = VerbsTransport(node_id="buffer")
    tag = uuid.uuid4().hex[:10]
    local = MemoryRegion(f"test-verbs-l-{tag}", 4 << 20)
    remote = MemoryRegion(f"test-verbs-r-{tag}", 4 << 20)
    try:
        await initiator.start()
        await target.start()
        await initiator.connect(target.register(remote))
        yield initiator, target, local, remote
    finally:
        await initiator.close()
        await target.close()
        for region in (local, remote):
            region.close()
            region.unlink()


def test_without_pyverbs_or_a_device_verbs_reports_why() -> None:
    ok, reason = verbs_available()
    if ok:
        pytest.skip("this host has RDMA; the contract tests cover it")
    assert "pyverbs" in reason or "RDMA device" in reason


async def test_a_300_entry_read_goes_out_as_three_lists_with_one_signalled_request_each(
    verbs_pair,
) -> None:
    initiator, _, local, remote = verbs_pair
    remote.as_array()[:] = pattern(remote.size, 5)
    entries = [TransferEntry(i * 8192, remote.region_id, (299 - i) * 8192, 8192) for i in range(300)]
    HCA.posts.clear()

    assert await initiator.read(local, entries) == 300 * 8192

    assert [len(p) for p in HCA.posts] == [128, 128, 44]  # doorbell batching, max_send_wr=128
    for posted in HCA.posts:
        assert all(op == E.IBV_WR_RDMA_READ for op, _ in posted)
        assert [bool(f & E.IBV_SEND_SIGNALED) for _, f in posted] == [False] * (len(posted) - 1) + [True]
    src, dst = remote.as_array(), local.as_array()
    for e in entries:
        assert np.array_equal(
            dst[e.local_offset : e.local_offset + e.length],
            src[e.remote_offset : e.remote_offset + e.length],
        )


async def test_a_write_lands_and_each_traffic_class_uses_its_own_service_level(verbs_pair) -> None:
    initiator, _, local, remote = verbs_pair
    local.as_array()[:] = pattern(local.size, 6)
    rid = remote.region_id

    await initiator.write(local, [TransferEntry(0, rid, 1 << 20, 1 << 20)], traffic_class=TrafficClass.MODEL)
    await initiator.write(local, [TransferEntry(1 << 20, rid, 0, 1 << 20)], traffic_class=TrafficClass.KV)

    assert np.array_equal(remote.as_array(1 << 20, 1 << 20), local.as_array(0, 1 << 20))
    assert np.array_equal(remote.as_array(0, 1 << 20), local.as_array(1 << 20, 1 << 20))
    (link,) = initiator._links.values()
    model, kv = link.qps[TrafficClass.MODEL].attr.ah_attr, link.qps[TrafficClass.KV].attr.ah_attr
    assert (model.sl, kv.sl) == (0, 2)
    if HCA.roce:  # RoCE: DSCP in the GRH traffic class, on a RoCE v2 IPv4 GID
        assert (model.gr.traffic_class, kv.gr.traffic_class) == (26 << 2, 10 << 2)
        assert model.is_global == 1 and model.gr.sgid_index == 1
    else:
        assert model.is_global == 0 and model.dlid == 7


async def test_a_region_deregistered_at_the_target_fails_with_unknown_region_and_then_reconnects(
    verbs_pair,
) -> None:
    initiator, target, local, remote = verbs_pair
    other = MemoryRegion(f"test-verbs-o-{uuid.uuid4().hex[:10]}", 1 << 20)
    try:
        await initiator.connect(target.register(other))
        target.deregister(remote.region_id)  # its rkey is gone at the HCA

        with pytest.raises(UnknownRegionError, match=remote.region_id):
            await initiator.read(local, [TransferEntry(0, remote.region_id, 0, 4096)])
        # The failed QP was dropped; a new pair of queue pairs serves the next batch.
        assert await initiator.read(local, [TransferEntry(0, other.region_id, 0, 4096)]) == 4096
    finally:
        other.close()
        other.unlink()


async def test_a_target_that_went_away_fails_the_batch_with_peer_lost(verbs_pair) -> None:
    initiator, target, local, remote = verbs_pair
    await target.close()  # destroys its queue pairs: our requests exhaust their retries
    with pytest.raises(PeerLostError):
        await initiator.write(local, [TransferEntry(0, remote.region_id, 0, 4096)])


async def test_queue_pairs_can_be_connected_through_a_control_plane_handshake(
    fake_pyverbs: Hca,
) -> None:
    target = VerbsTransport(node_id="buffer")
    offers = []

    async def over_nats(remote, offer):  # what the services do with a NATS request/reply
        offers.append(offer)
        return await target.accept(offer)

    initiator = VerbsTransport(node_id="engine", handshake=over_nats)
    tag = uuid.uuid4().hex[:10]
    local, remote = (
        MemoryRegion(f"test-verbs-l-{tag}", 65536),
        MemoryRegion(f"test-verbs-r-{tag}", 65536),
    )
    try:
        await target.start()
        await initiator.start()
        remote.buf[:5] = b"hello"
        await initiator.connect(target.register(remote))
        assert await initiator.read(local, [TransferEntry(0, remote.region_id, 0, 5)]) == 5
        assert bytes(local.buf[:5]) == b"hello"
        assert len(offers) == 1 and len(offers[0]["qpns"]) == len(TrafficClass)
    finally:
        await initiator.close()
        await target.close()
        for region in (local, remote):
            region.close()
            region.unlink()
