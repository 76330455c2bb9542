"""Block fetches over the RPC layer's TCP connections (the default transport)."""

from __future__ import annotations

import mmap

from cachefs.ids import BlockKey
from cachefs.messages import BlockBatch
from cachefs.rpc import RpcPool


class TcpTransport:
    """Calls the cache node's ``get``/``put``; the block rides as the bulk payload."""

    name = "tcp"

    def __init__(self, pool: RpcPool) -> None:
        self.pool = pool

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
        args = {
            "volume": volume,
            "key": key.to_bytes(),
            "offset": offset,
            "length": length,
            "policy": policy,
        }
        reply = await self.pool.call(addr, "get", args, timeout=timeout)
        return reply.payload if reply.payload is not None else b""

    async def get_many(
        self, addr: str, volume: str, keys: list[BlockKey], *, timeout: float = 10.0,
        scratch: mmap.mmap | None = None,
    ) -> list[memoryview | int]:
        """Whole blocks of ``keys`` from one cache node in one call: per key, a
        view of its block in the reply's payload, or a ``BlockBatch`` marker.
        ``scratch``: where the reply may land (see ``RpcPool.call``).

        Raises:
            IOFailure: a malformed reply.
        """
        args = {"volume": volume, "keys": [k.to_bytes() for k in keys]}
        reply = await self.pool.call(addr, "get_many", args, timeout=timeout,
                                     scratch=None if scratch is None else memoryview(scratch))
        payload = reply.payload if reply.payload is not None else b""
        return BlockBatch.from_wire(reply.result, len(keys), len(payload)).split(payload)

    async def put(
        self, addr: str, volume: str, key: BlockKey, data: bytes, *, timeout: float = 10.0
    ) -> None:
        args = {"volume": volume, "key": key.to_bytes()}
        await self.pool.call(addr, "put", args, payload=data, timeout=timeout)

    async def aclose(self) -> None:
        """The pool belongs to the caller; nothing of our own to close."""
