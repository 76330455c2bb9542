"""The cache node reading through the real backing-storage client and real datanode processes."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from cachefs.backing.client import BackingClient
from cachefs.backing.policy import VolumePolicy
from cachefs.blockstore import BlockStore
from cachefs.cachenode.service import CacheService
from cachefs.errors import NotFound
from cachefs.ids import BlockKey
from cachefs.rpc import RpcPool, RpcServer
from cachefs.testing.datanodes import SECRET, Datanodes


@pytest.fixture(scope="module")
def datanodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Datanodes]:
    nodes = Datanodes(tmp_path_factory.mktemp("cache-datanodes"), ["a", "b", "c"], capacity="1G")
    nodes.start()
    try:
        yield nodes
    finally:
        nodes.stop_all()


async def test_read_through_real_datanodes_then_hits_survive_backing_loss(
    tmp_path: Path, datanodes: Datanodes
) -> None:
    view = datanodes.view({"ec": VolumePolicy.parse("ec:2+1")}, pg_count=4)
    rng = random.Random(21)
    blocks = {BlockKey(3000 + i, i): rng.randbytes(rng.randrange(1, 1 << 20)) for i in range(6)}
    store = BlockStore.open(tmp_path / "cache", 64 << 20)
    try:
        async with RpcPool(secret=SECRET) as pool, trio.open_nursery() as nursery:
            backing = BackingClient(pool, view)
            for key, data in blocks.items():
                await backing.put_block("ec", key, data)
            service = CacheService(store, backing, nursery=nursery, node="cn-backing")
            port = await nursery.start(
                RpcServer(service, name="cachenode", secret=SECRET).serve, "127.0.0.1", 0
            )
            addr = f"127.0.0.1:{port}"

            async def get(key: BlockKey, offset: int = 0, length: int = -1):  # type: ignore[no-untyped-def]
                return await pool.call(
                    addr,
                    "get",
                    {"volume": "ec", "key": key.to_bytes(), "offset": offset, "length": length},
                )

            first = next(iter(blocks))
            results = []

            async def reader() -> None:
                results.append(bytes((await get(first, 100, 1000)).payload))

            async with trio.open_nursery() as readers:
                for _ in range(20):
                    readers.start_soon(reader)
            assert results == [blocks[first][100:1100]] * 20
            stats = (await pool.call(addr, "stats")).result
            # One fetch from backing storage however many wait; readers that
            # arrive after the fill landed count as hits, not misses.
            assert stats["backing_fetches"] == 1
            assert stats["misses"] >= 1 and stats["misses"] + stats["hits"] == 20
            for key, data in blocks.items():
                off = len(data) // 3
                reply = await get(key, off, 5000)
                assert bytes(reply.payload) == data[off : off + 5000]
                assert reply.result["size"] == len(data)
            with pytest.raises(NotFound):
                await get(BlockKey(9999, 0))
            with trio.fail_after(5):
                while len(store) < len(blocks):  # noqa: ASYNC110 - flash writes finish after replies
                    await trio.sleep(0.01)
            datanodes.kill(0)
            datanodes.kill(1)  # below the EC quorum: backing storage cannot serve any more
            for key, data in blocks.items():
                reply = await get(key)
                assert reply.result["hit"] and bytes(reply.payload) == data
            nursery.cancel_scope.cancel()
    finally:
        datanodes.ensure_running()
