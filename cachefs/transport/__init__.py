"""Block transports between the client and cache nodes: TCP (default) and RDMA.

:func:`open_transport` picks one by mode: ``tcp``, ``rdma`` (fail clearly
when no RDMA device can be used) or ``auto`` (RDMA where a device exists,
otherwise TCP with one log line). pyverbs is imported only when RDMA is asked
for, so the client runs where it is not installed.
"""

from __future__ import annotations

import logging
import mmap
from typing import Protocol

from cachefs.errors import InvalidArgument, Unavailable
from cachefs.ids import BlockKey
from cachefs.rpc import RpcPool

from .tcp import TcpTransport

log = logging.getLogger(__name__)

MODES = ("tcp", "rdma", "auto")


class BlockTransport(Protocol):
    name: str

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
    ) -> bytes | bytearray: ...

    async def get_many(
        self, addr: str, volume: str, keys: list[BlockKey], *, timeout: float = 10.0,
        scratch: mmap.mmap | None = None,
    ) -> list[memoryview | int]: ...

    async def put(
        self, addr: str, volume: str, key: BlockKey, data: bytes, *, timeout: float = 10.0
    ) -> None: ...

    async def aclose(self) -> None: ...


class RdmaUnavailable(Unavailable):
    """No usable RDMA device (pyverbs missing, no devices, or setup failed)."""


def open_transport(mode: str, pool: RpcPool) -> BlockTransport:
    """The transport for ``mode``; ``auto`` falls back to TCP, logging why once.

    Raises:
        InvalidArgument: ``mode`` is not one of tcp, rdma, auto.
        RdmaUnavailable: ``mode`` is rdma and RDMA cannot be used here.
    """
    if mode not in MODES:
        raise InvalidArgument(f"transport must be one of {', '.join(MODES)}, got {mode!r}")
    tcp = TcpTransport(pool)
    if mode == "tcp":
        return tcp
    from . import rdma  # lazy: imports nothing from pyverbs until probed

    try:
        device = rdma.probe_device()
    except RdmaUnavailable as exc:
        if mode == "rdma":
            raise
        log.warning("RDMA not available, using TCP for block transfers: %s", exc.message)
        return tcp
    return rdma.RdmaTransport(pool, device, fallback=tcp)
