"""RDMA plumbing for the verbs transport, on pyverbs (rdma-core's Python binding).

``VerbsDevice`` opens one HCA port: its context, protection domain, a completion queue and
the port's addressing (LID, GID, MTU). ``RcLink`` is the connection to one remote transport:
two RC queue pairs, one per traffic class, because the service level (InfiniBand: SL, mapped
to a virtual lane) and the GRH traffic class (RoCE: DSCP << 2) are properties of a QP's
address vector, not of a work request. Every pyverbs import happens inside functions, so
this module loads on hosts without rdma-core.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping
from types import ModuleType, SimpleNamespace
from typing import Any

from dualpath.transfer.types import TrafficClass

__all__ = ["RcLink", "VerbsDevice", "enums", "load_pyverbs"]

ACCESS = ("IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_READ", "IBV_ACCESS_REMOTE_WRITE")
_RTS = {"timeout": 14, "retry_cnt": 7, "rnr_retry": 7, "min_rnr_timer": 12}
# timeout 14 is 4.096 us * 2^14 = 67 ms per try; 7 retries: a dead peer fails a WR in ~0.5 s.


class _FlatEnums:
    """``pyverbs.enums`` constants (``e.IBV_WR_RDMA_READ``) on rdma-core versions that moved
    them into enum classes of ``pyverbs.libibverbs_enums`` (Cython 3 builds)."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        if hasattr(self._module, name):
            return getattr(self._module, name)
        for holder in vars(self._module).values():
            if isinstance(holder, type) and hasattr(holder, name):
                return getattr(holder, name)
        raise AttributeError(f"pyverbs has no constant {name}")


def enums() -> Any:
    """The verbs constants namespace of the installed pyverbs.

    Raises:
        ImportError: pyverbs is not installed.
    """
    try:
        import pyverbs.enums as e  # rdma-core up to v56

        return e
    except ImportError:
        import pyverbs.libibverbs_enums as e  # rdma-core v57+

        return _FlatEnums(e)


def load_pyverbs() -> SimpleNamespace:
    """The pyverbs classes this transport uses.

    Raises:
        ImportError: pyverbs is not installed.
    """
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsError
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, SendWR

    return SimpleNamespace(
        GID=GID,
        AHAttr=AHAttr,
        GlobalRoute=GlobalRoute,
        CQ=CQ,
        Context=Context,
        MR=MR,
        PD=PD,
        PyverbsError=PyverbsError,
        QP=QP,
        QPAttr=QPAttr,
        QPCap=QPCap,
        QPInitAttr=QPInitAttr,
        SGE=SGE,
        SendWR=SendWR,
        e=enums(),
    )


class VerbsDevice:
    """One opened HCA port: context, protection domain, completion queue, addressing."""

    def __init__(
        self,
        device: str,
        *,
        port_num: int = 1,
        gid_index: int | None = None,
        cq_depth: int = 1 << 16,
    ) -> None:
        """Open ``device``'s port ``port_num``. The CQ is deep because a failed queue pair
        flushes every outstanding request, signalled or not, into it.

        Raises:
            PyverbsError: the device cannot be opened or queried.
        """
        self.pv = pv = load_pyverbs()
        e = pv.e
        self.name = device
        self.port_num = port_num
        self.ctx = pv.Context(name=device)
        self.pd = pv.PD(self.ctx)
        port = self.ctx.query_port(port_num)
        attr = self.ctx.query_device()
        self.cq = pv.CQ(self.ctx, min(cq_depth, int(attr.max_cqe)))
        self.lid = int(port.lid)
        self.mtu = int(port.active_mtu)
        self.roce = int(port.link_layer) == int(e.IBV_LINK_LAYER_ETHERNET)
        self.max_rd_atomic = max(1, min(16, int(attr.max_qp_rd_atom)))
        self.max_msg = int(port.max_msg_sz)
        self.gid_index = self._pick_gid(port) if gid_index is None else gid_index
        self.gid = str(self.ctx.query_gid(port_num, self.gid_index))
        self.access = 0
        for flag in ACCESS:
            self.access |= int(getattr(e, flag))

    def _pick_gid(self, port: Any) -> int:
        """InfiniBand: index 0. RoCE: a RoCE v2 GID, IPv4-mapped if there is one (it routes
        across subnets and carries the DSCP that selects the traffic class)."""
        if not self.roce:
            return 0
        best, best_rank = 0, -1
        for idx in range(int(port.gid_tbl_len)):
            try:
                gid = str(self.ctx.query_gid(self.port_num, idx))
                v2 = int(self.ctx.query_gid_type(self.port_num, idx)) == int(self.pv.e.IBV_GID_TYPE_SYSFS_ROCE_V2)
            except self.pv.PyverbsError:
                continue
            if set(gid) <= {"0", ":"}:
                continue
            rank = 2 * v2 + gid.startswith("0000:0000:0000:0000:0000:ffff")
            if rank > best_rank:
                best, best_rank = idx, rank
        return best

    def register(self, address: int, length: int) -> Any:
        """Register ``length`` bytes at ``address`` for local and remote read/write."""
        return self.pv.MR(self.pd, length, self.access, address=address)

    def close(self) -> None:
        """Destroy the context and everything created on it."""
        self.ctx.close()


class RcLink:
    """Two connected RC queue pairs to one remote transport, one per traffic class."""

    def __init__(
        self,
        dev: VerbsDevice,
        *,
        service_levels: Mapping[TrafficClass, int],
        dscp: Mapping[TrafficClass, int],
        max_send_wr: int,
    ) -> None:
        """Create the queue pairs (state RESET until ``connect``)."""
        pv, e = dev.pv, dev.pv.e
        self.dev = dev
        self.service_levels = dict(service_levels)
        self.dscp = dict(dscp)
        self.max_send_wr = max_send_wr
        cap = pv.QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        # sq_sig_all=0: only the last WR of a posted list asks for a completion.
        init = pv.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=dev.cq, rcq=dev.cq, cap=cap, sq_sig_all=0)
        self.qps = {cls: pv.QP(dev.pd, init) for cls in TrafficClass}
        self.psns = {cls: random.randrange(1 << 24) for cls in TrafficClass}
        self.credits = {cls: max_send_wr for cls in TrafficClass}
        self.closed = False

    def local_info(self) -> dict[str, Any]:
        """What the remote side needs to connect its queue pairs to ours (msgpack-able)."""
        return {
            "lid": self.dev.lid,
            "gid": self.dev.gid,
            "mtu": self.dev.mtu,
            "roce": self.dev.roce,
            "qpns": [int(self.qps[c].qp_num) for c in TrafficClass],
            "psns": [self.psns[c] for c in TrafficClass],
        }

    def connect(self, remote: Mapping[str, Any]) -> None:
        """Move both queue pairs RESET → INIT → RTR → RTS towards ``remote``'s.

        Raises:
            PyverbsError: a state transition was refused.
        """
        pv, dev = self.dev.pv, self.dev
        for cls in TrafficClass:
            attr = pv.QPAttr(port_num=dev.port_num, path_mtu=min(dev.mtu, int(remote["mtu"])))
            attr.qp_access_flags = dev.access
            attr.dest_qp_num = int(remote["qpns"][cls])
            attr.rq_psn = int(remote["psns"][cls])
            attr.sq_psn = self.psns[cls]
            attr.max_rd_atomic = dev.max_rd_atomic
            attr.max_dest_rd_atomic = dev.max_rd_atomic
            for key, value in _RTS.items():
                setattr(attr, key, value)
            attr.ah_attr = self._address_vector(cls, remote)
            self.qps[cls].to_rts(attr)

    def _address_vector(self, cls: TrafficClass, remote: Mapping[str, Any]) -> Any:
        pv, dev = self.dev.pv, self.dev
        sl = self.service_levels[cls]
        if not (dev.roce or remote.get("roce")):
            return pv.AHAttr(dlid=int(remote["lid"]), sl=sl, port_num=dev.port_num)
        route = pv.GlobalRoute(
            dgid=pv.GID(str(remote["gid"])),
            sgid_index=dev.gid_index,
            hop_limit=64,
            traffic_class=(self.dscp[cls] & 0x3F) << 2,  # DSCP is the top 6 bits of TOS
        )
        return pv.AHAttr(dlid=int(remote["lid"]), sl=sl, is_global=1, port_num=dev.port_num, gr=route)

    def post(
        self,
        cls: TrafficClass,
        wr_id: int,
        opcode: int,
        lkey: int,
        pieces: list[tuple[int, int, int, int]],
    ) -> None:
        """Post one list of RDMA work requests (one doorbell); only the last is signalled.

        ``pieces`` holds ``(local_addr, remote_addr, rkey, length)`` per WR; the caller has
        taken ``len(pieces)`` send credits of ``cls``.

        Raises:
            PyverbsError: the send queue refused the list.
        """
        pv, e = self.dev.pv, self.dev.pv.e
        wrs = []
        for local_addr, remote_addr, rkey, length in pieces:
            sge = pv.SGE(local_addr, length, lkey)
            wr = pv.SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=0)
            wr.set_wr_rdma(rkey, remote_addr)
            wrs.append(wr)
        wrs[-1].send_flags = e.IBV_SEND_SIGNALED
        for first, second in itertools.pairwise(wrs):
            first.next_wr = second  # a C pointer: ``wrs`` keeps every WR alive until posted
        self.qps[cls].post_send(wrs[0])

    def close(self) -> None:
        """Destroy the queue pairs (idempotent)."""
        self.closed = True
        for qp in self.qps.values():
            qp.close()
