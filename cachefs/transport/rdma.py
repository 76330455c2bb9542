"""Block fetches over RDMA (pyverbs), with the RPC connection as control channel.

Theory of operation
-------------------
- The client opens the device once: a protection domain, a completion queue and
  one registered memory region cut into fixed slots (:class:`SlabAllocator`);
  registration is expensive, so buffers are registered once and reused.
- Per cache node it creates a reliable-connected (RC) queue pair and exchanges
  ``(qpn, psn, lid, gid)`` with the node over the ordinary TCP RPC connection
  (``rdma_connect``); both sides move their QP through INIT -> RTR -> RTS.
- ``get`` takes a slot and asks the node (``rdma_get``, over TCP) to RDMA WRITE
  the block range into that slot (address + rkey). The node replies only after
  its WRITE completed, and an RC completion means the bytes are placed in our
  memory, so on the reply the client copies the bytes out and frees the slot.
- A node that does not speak RDMA (``ENOSYS``), a range larger than a slot, or
  a failed QP setup falls back to TCP for that node, logged once per node.
  Writes (``put``) go over TCP: the write path is bound by backing storage.

:class:`RdmaResponder` is the node side: an RPC service a cache node adds to
its server, given a function that reads a block range.

The data path needs RDMA hardware to run; on machines without it (the kernel
has no RDMA support and ``get_device_list()`` fails) :func:`probe_device`
raises :class:`RdmaUnavailable` and ``--transport auto`` uses TCP.
"""

from __future__ import annotations

import logging
import mmap
import random
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
import trio.lowlevel

from cachefs.credentials import CLIENTS
from cachefs.errors import InvalidArgument, NoSuchMethod, Range
from cachefs.ids import BlockKey
from cachefs.rpc import CallContext, RpcPool, rpc_method

from . import RdmaUnavailable
from .tcp import TcpTransport

log = logging.getLogger(__name__)

DEFAULT_SLOT = 4 << 20
DEFAULT_SLOTS = 16
PORT = 1
GID_INDEX = 0
COMPLETION_TIMEOUT = 5.0


def _pyverbs() -> Any:
    """Import pyverbs on demand; its absence is an RdmaUnavailable, not a crash."""
    try:
        import pyverbs.device  # noqa: F401
        import pyverbs.enums
        import pyverbs.pyverbs_error  # noqa: F401
    except ImportError as exc:
        raise RdmaUnavailable(f"pyverbs is not installed ({exc})") from None
    return pyverbs


@dataclass(frozen=True, slots=True)
class RdmaDevice:
    name: str
    port: int = PORT
    gid_index: int = GID_INDEX


def probe_device(name: str | None = None) -> RdmaDevice:
    """The first (or the named) RDMA device.

    Raises:
        RdmaUnavailable: pyverbs is missing, the device list cannot be read, or
            there is no (such) device.
    """
    pv = _pyverbs()
    try:
        devices = pv.device.get_device_list()
    except pv.pyverbs_error.PyverbsError as exc:
        raise RdmaUnavailable(f"pyverbs could not list RDMA devices: {exc}") from None
    names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]
    if not names:
        raise RdmaUnavailable("no RDMA devices found")
    if name is not None and name not in names:
        raise RdmaUnavailable(f"RDMA device {name!r} not found (have {', '.join(names)})")
    return RdmaDevice(name or names[0])


class SlabAllocator:
    """Fixed-size slots of one registered buffer; callers wait when all are taken.

    Pure bookkeeping (no pyverbs), so the buffer management is testable without
    a device. ``slot()`` hands out ``(index, offset)``; no ``await`` sits
    between taking a free index and marking it used, so two tasks never share one.
    """

    def __init__(self, slot_size: int, count: int) -> None:
        if slot_size <= 0 or count <= 0:
            raise InvalidArgument("slot size and count must be positive")
        self.slot_size = slot_size
        self.count = count
        self._free = list(range(count - 1, -1, -1))
        self._available = trio.Semaphore(count)

    @property
    def size(self) -> int:
        return self.slot_size * self.count

    @property
    def free(self) -> int:
        return len(self._free)

    def fits(self, length: int) -> bool:
        return 0 < length <= self.slot_size

    @asynccontextmanager
    async def slot(self):  # type: ignore[no-untyped-def]
        await self._available.acquire()
        index = self._free.pop()
        try:
            yield index, index * self.slot_size
        finally:
            self._free.append(index)
            self._available.release()


@dataclass(frozen=True, slots=True)
class QpInfo:
    """What two ends exchange to connect an RC queue pair."""

    qpn: int
    psn: int
    lid: int
    gid: str

    def to_wire(self) -> dict[str, Any]:
        return {"qpn": self.qpn, "psn": self.psn, "lid": self.lid, "gid": self.gid}

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> QpInfo:
        try:
            return cls(int(raw["qpn"]), int(raw["psn"]), int(raw["lid"]), str(raw["gid"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"malformed RDMA connection info {raw!r}: {exc}") from None


class Endpoint:
    """One opened device: context, PD, CQ and one registered slab of slots."""

    def __init__(self, device: RdmaDevice, slot_size: int, slots: int, remote_access: int) -> None:
        pv = _pyverbs()
        from pyverbs.cq import CQ
        from pyverbs.device import Context
        from pyverbs.mr import MR
        from pyverbs.pd import PD

        self.pv = pv
        self.device = device
        self.slab = SlabAllocator(slot_size, slots)
        self._completed: dict[int, int] = {}
        try:
            self.ctx = Context(name=device.name)
            self.pd = PD(self.ctx)
            self.cq = CQ(self.ctx, 4 * slots)
            access = pv.enums.IBV_ACCESS_LOCAL_WRITE | remote_access
            self.mr = MR(self.pd, self.slab.size, access)
            port_attr = self.ctx.query_port(device.port)
            self.lid = int(port_attr.lid)
            self.gid = str(self.ctx.query_gid(device.port, device.gid_index))
            self.mtu = port_attr.active_mtu
        except pv.pyverbs_error.PyverbsError as exc:
            raise RdmaUnavailable(f"could not open RDMA device {device.name}: {exc}") from None

    def new_qp(self) -> Any:
        from pyverbs.qp import QP, QPCap, QPInitAttr

        cap = QPCap(max_send_wr=self.slab.count, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=self.pv.enums.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
        return QP(self.pd, init)

    def local_info(self, qp: Any, psn: int) -> QpInfo:
        return QpInfo(qp.qp_num, psn, self.lid, self.gid)

    def connect_qp(self, qp: Any, local_psn: int, remote: QpInfo, access: int) -> None:
        """INIT -> RTR -> RTS against ``remote``."""
        from pyverbs.addr import AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        e = self.pv.enums
        gr = GlobalRoute(dgid=remote.gid, sgid_index=self.device.gid_index)
        ah = AHAttr(gr=gr, is_global=1, dlid=remote.lid, port_num=self.device.port)
        attr = QPAttr(
            qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET, port_num=self.device.port
        )
        attr.qp_access_flags = access
        attr.path_mtu = self.mtu
        attr.dest_qp_num = remote.qpn
        attr.rq_psn = remote.psn
        attr.sq_psn = local_psn
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.ah_attr = ah
        qp.to_init(attr)
        qp.to_rtr(attr)
        qp.to_rts(attr)

    async def wait_completion(self, wr_id: int) -> None:
        """Poll the CQ cooperatively until ``wr_id`` completes (no worker threads).

        Several tasks may wait at once; whoever polls records every completion
        it sees in ``_completed``, so none is lost to another waiter.
        """
        e = self.pv.enums
        with trio.fail_after(COMPLETION_TIMEOUT):
            while wr_id not in self._completed:
                npolled, wcs = self.cq.poll(num_entries=8)
                for wc in wcs[:npolled]:
                    self._completed[wc.wr_id] = wc.status
                if wr_id not in self._completed:
                    await trio.lowlevel.checkpoint()
        status = self._completed.pop(wr_id)
        if status != e.IBV_WC_SUCCESS:
            raise RdmaUnavailable(f"RDMA work request {wr_id} failed with status {status}")

    def close(self) -> None:
        for obj in (self.mr, self.cq, self.pd, self.ctx):
            obj.close()


class RdmaTransport:
    """Block ``get`` over RDMA WRITE into registered client slots; TCP for the rest."""

    name = "rdma"

    def __init__(
        self,
        pool: RpcPool,
        device: RdmaDevice,
        *,
        fallback: TcpTransport,
        slot_size: int = DEFAULT_SLOT,
        slots: int = DEFAULT_SLOTS,
    ) -> None:
        self.pool = pool
        self.device = device
        self.fallback = fallback
        self._slot_size = slot_size
        self._slots = slots
        self._endpoint: Endpoint | None = None
        self._qps: dict[str, Any] = {}
        self._tcp_only: set[str] = set()
        self._connecting: dict[str, trio.Lock] = {}

    def _ep(self) -> Endpoint:
        if self._endpoint is None:
            e = _pyverbs().enums
            self._endpoint = Endpoint(
                self.device, self._slot_size, self._slots, e.IBV_ACCESS_REMOTE_WRITE
            )
        return self._endpoint

    def _use_tcp(self, addr: str, why: str) -> None:
        if addr not in self._tcp_only:
            self._tcp_only.add(addr)
            log.warning("RDMA to %s not possible, using TCP for it: %s", addr, why)

    async def _qp_for(self, addr: str) -> Any | None:
        if addr in self._tcp_only:
            return None
        qp = self._qps.get(addr)
        if qp is not None:
            return qp
        async with self._connecting.setdefault(addr, trio.Lock()):
            if addr in self._qps or addr in self._tcp_only:
                return self._qps.get(addr)
            try:
                ep = self._ep()
                qp = ep.new_qp()
                psn = random.getrandbits(24)
                reply = await self.pool.call(
                    addr, "rdma_connect", ep.local_info(qp, psn).to_wire(), timeout=5.0
                )
                remote = QpInfo.from_wire(reply.result)
                e = ep.pv.enums
                ep.connect_qp(qp, psn, remote, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
            except NoSuchMethod:
                self._use_tcp(addr, "the node does not speak RDMA")
                return None
            except (RdmaUnavailable, InvalidArgument) as exc:
                self._use_tcp(addr, exc.message)
                return None
            except _pyverbs().pyverbs_error.PyverbsError as exc:
                self._use_tcp(addr, f"queue pair setup failed: {exc}")
                return None
            self._qps[addr] = qp
            return qp

    async def get(
        self,
        addr: str,
        volume: str,
        key: BlockKey,
        offset: int = 0,
        length: int = -1,
        *,
        policy: str = "wait",
        timeout: float = 10.0,
    ) -> bytes | bytearray:
        want = self._slot_size if length < 0 else length
        qp = await self._qp_for(addr) if want <= self._slot_size else None
        if qp is None:
            return await self.fallback.get(
                addr, volume, key, offset, length, policy=policy, timeout=timeout
            )
        ep = self._ep()
        async with ep.slab.slot() as (_index, slot_off):
            args = {
                "volume": volume,
                "key": key.to_bytes(),
                "offset": offset,
                "length": length,
                "policy": policy,
                "raddr": ep.mr.buf + slot_off,
                "rkey": ep.mr.rkey,
                "max_length": ep.slab.slot_size,
            }
            try:
                reply = await self.pool.call(addr, "rdma_get", args, timeout=timeout)
            except Range:
                # Larger than a slot (a bigger block size than we assumed).
                return await self.fallback.get(
                    addr, volume, key, offset, length, policy=policy, timeout=timeout
                )
            size = int(reply.result["size"])
            return ep.mr.read(size, slot_off)

    async def get_many(
        self, addr: str, volume: str, keys: list[BlockKey], *, timeout: float = 10.0,
        scratch: mmap.mmap | None = None,
    ) -> list[memoryview | int]:
        """Over TCP: a batch of small blocks is one reply, not one slot each."""
        return await self.fallback.get_many(addr, volume, keys, timeout=timeout, scratch=scratch)

    async def put(
        self, addr: str, volume: str, key: BlockKey, data: bytes, *, timeout: float = 10.0
    ) -> None:
        await self.fallback.put(addr, volume, key, data, timeout=timeout)

    async def aclose(self) -> None:
        for qp in self._qps.values():
            qp.close()
        self._qps.clear()
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None


ReadRange = Callable[[str, BlockKey, int, int, str], Awaitable[bytes | bytearray]]


class RdmaResponder:
    """The cache node side: ``rdma_connect`` and ``rdma_get`` RPC methods.

    A cache node adds it to its RPC server (``server.add_service(...)``) with
    ``read_range(volume, key, offset, length, policy)``, the same function that
    serves its TCP ``get``.
    """

    def __init__(
        self,
        device: RdmaDevice,
        read_range: ReadRange,
        *,
        slot_size: int = DEFAULT_SLOT,
        slots: int = DEFAULT_SLOTS,
    ) -> None:
        self.read_range = read_range
        self.endpoint = Endpoint(device, slot_size, slots, 0)
        self._qps: dict[int, Any] = {}  # by RPC connection id
        self._wr_ids = iter(range(1, 1 << 62))

    @rpc_method(roles=CLIENTS)  # like the cache node's get: the volume is checked on rdma_get
    async def rdma_connect(self, ctx: CallContext, qpn: int, psn: int, lid: int, gid: str) -> dict:
        ep = self.endpoint
        qp = ep.new_qp()
        my_psn = random.getrandbits(24)
        e = ep.pv.enums
        try:
            ep.connect_qp(qp, my_psn, QpInfo(qpn, psn, lid, gid), e.IBV_ACCESS_LOCAL_WRITE)
        except ep.pv.pyverbs_error.PyverbsError as exc:
            qp.close()
            raise RdmaUnavailable(f"queue pair setup failed: {exc}") from None
        old = self._qps.pop(ctx.conn_id, None)
        if old is not None:
            old.close()
        self._qps[ctx.conn_id] = qp
        return ep.local_info(qp, my_psn).to_wire()

    @rpc_method(roles=CLIENTS)
    async def rdma_get(
        self,
        ctx: CallContext,
        volume: str,
        key: bytes,
        offset: int,
        length: int,
        policy: str,
        raddr: int,
        rkey: int,
        max_length: int,
    ) -> dict:
        from pyverbs.wr import SGE, SendWR

        qp = self._qps.get(ctx.conn_id)
        if qp is None:
            raise InvalidArgument("rdma_get before rdma_connect on this connection")
        data = await self.read_range(volume, BlockKey.from_bytes(key), offset, length, policy)
        if len(data) > max_length or len(data) > self.endpoint.slab.slot_size:
            raise Range(f"{len(data)} bytes do not fit the client's {max_length}-byte slot")
        if not data:
            return {"size": 0}
        ep = self.endpoint
        async with ep.slab.slot() as (_index, slot_off):
            ep.mr.write(bytes(data), len(data), slot_off)
            wr_id = next(self._wr_ids)
            sge = SGE(ep.mr.buf + slot_off, len(data), ep.mr.lkey)
            wr = SendWR(
                wr_id=wr_id,
                opcode=ep.pv.enums.IBV_WR_RDMA_WRITE,
                num_sge=1,
                sg=[sge],
                send_flags=ep.pv.enums.IBV_SEND_SIGNALED,
            )
            wr.set_wr_rdma(rkey, raddr)
            qp.post_send(wr)
            await ep.wait_completion(wr_id)
        return {"size": len(data)}
