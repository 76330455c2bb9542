"""A small real backing source for cache tests: an RPC server serving blocks from a dict.

It counts fetches per key and the most fetches it ever had in flight, which
is what the single-flight and the backing-limit tests check. The cache node
talks to it through :class:`RpcBlockSource`, over real TCP on 127.0.0.1.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from cachefs.blockstore import BlockStore
from cachefs.cachenode.admission import SecondMissAdmission
from cachefs.cachenode.service import CacheLimits, CacheService
from cachefs.errors import NotFound
from cachefs.ids import BlockKey
from cachefs.rpc import Reply, RpcPool, RpcServer, rpc_method

_node_ids = itertools.count(1)  # a fresh metrics label per node


class MemoryBlockService:
    def __init__(self, blocks: dict[BlockKey, bytes], delay: float = 0.0) -> None:
        self.blocks = blocks
        self.delay = delay
        self.fetches: Counter[BlockKey] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0

    @rpc_method
    async def get_block(self, volume: str, key: bytes, offset: int = 0, length: int = -1) -> Reply:
        block_key = BlockKey.from_bytes(key)
        self.fetches[block_key] += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await trio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        data = self.blocks.get(block_key)
        if data is None:
            raise NotFound(f"no block {block_key.hex()} in volume {volume}")
        end = len(data) if length == -1 else offset + length
        return Reply({"size": len(data)}, payload=data[offset:end])


class RpcBlockSource:
    """``get_block(volume, key)`` over RPC, the shape of ``cachefs.backing.client.BackingClient``."""

    def __init__(self, pool: RpcPool, addr: str) -> None:
        self.pool = pool
        self.addr = addr

    async def get_block(
        self, volume: str, key: BlockKey, offset: int = 0, length: int = -1
    ) -> bytes | bytearray:
        reply = await self.pool.call(
            self.addr,
            "get_block",
            {"volume": volume, "key": key.to_bytes(), "offset": offset, "length": length},
        )
        return reply.payload if reply.payload is not None else b""


@dataclass
class CacheSetup:
    pool: RpcPool
    addr: str
    service: CacheService
    backing: MemoryBlockService
    backing_addr: str
    store: BlockStore

    async def get(
        self,
        key: BlockKey,
        offset: int = 0,
        length: int = -1,
        policy: str = "wait",
        volume: str = "v",
        pool: RpcPool | None = None,
    ) -> Reply:
        args: dict[str, Any] = {
            "volume": volume,
            "key": key.to_bytes(),
            "offset": offset,
            "length": length,
            "policy": policy,
        }
        return await (pool or self.pool).call(self.addr, "get", args, timeout=10)


@asynccontextmanager
async def cache_setup(
    root: Path,
    blocks: dict[BlockKey, bytes],
    *,
    capacity: int = 64 << 20,
    delay: float = 0.0,
    limits: CacheLimits | None = None,
    admission: SecondMissAdmission | None = None,
    memory: int = 0,
) -> AsyncIterator[CacheSetup]:
    """A backing block server and a cache node, each a real RPC server on 127.0.0.1."""
    backing = MemoryBlockService(blocks, delay)
    backing_server = RpcServer(backing, name="blocks", secret=None)
    async with trio.open_nursery() as nursery, RpcPool(secret=None) as pool:
        backing_port = await nursery.start(backing_server.serve, "127.0.0.1", 0)
        backing_addr = f"127.0.0.1:{backing_port}"
        store = BlockStore.open(root, capacity, memory_capacity=memory, segment_size=16 * 1024)
        service = CacheService(
            store,
            RpcBlockSource(pool, backing_addr),
            nursery=nursery,
            limits=limits or CacheLimits(),
            admission=admission,
            node=f"test-{next(_node_ids)}",
        )
        server = RpcServer(service, name="cachenode", secret=None)
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        yield CacheSetup(pool, f"127.0.0.1:{port}", service, backing, backing_addr, store)
        nursery.cancel_scope.cancel()
