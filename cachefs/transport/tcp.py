"""Block fetches over the RPC layer's TCP connections (the default transport)."""

from __future__ import annotations

from cachefs.ids import BlockKey
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

    async def put(
        self, addr: str, volume: str, key: BlockKey, data: bytes, *, timeout: float = 10.0
    ) -> None:
        args = {"volume": volume, "key": key.to_bytes()}
        await self.pool.call(addr, "put", args, payload=data, timeout=timeout)

    async def aclose(self) -> None:
        """The pool belongs to the caller; nothing of our own to close."""
