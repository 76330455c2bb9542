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
from cachefs.buffers import BufferPool
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


async def test_a_fill_buffer_is_used_again_only_once_nobody_holds_it(tmp_path: Path, datanodes: Datanodes) -> None:
    """A finished fill's buffer receives a later block, never while a reader
    still holds a view of it (the view keeps its bytes)."""
    view = datanodes.view({"ec": VolumePolicy.parse("ec:2+1")}, pg_count=4)
    rng = random.Random(22)
    blocks = {BlockKey(4000 + i, 0): rng.randbytes(2 << 20) for i in range(3)}
    store = BlockStore.open(tmp_path / "cache", 64 << 20)
    buffers = BufferPool()
    async with RpcPool(secret=SECRET) as pool, trio.open_nursery() as nursery:
        backing = BackingClient(pool, view, buffers=buffers)
        for key, data in blocks.items():
            await backing.put_block("ec", key, data)
        service = CacheService(store, backing, nursery=nursery, node="cn-buffers", buffers=buffers)

        async def read_settled(key: BlockKey) -> memoryview:
            """The block as a miss serves it (a view of the fill's buffer), once the fill is over."""
            data, _size, hit = await service.read("ec", key)
            assert not hit
            flight = service._fills.get(key)
            if flight is not None:
                await flight.finished.wait()
            del flight  # it holds the buffer too
            return data

        (k1, b1), (k2, b2), (k3, b3) = blocks.items()
        v1 = await read_settled(k1)
        first = id(v1.obj)  # not the buffer itself: a reference would keep it from reuse
        v2 = await read_settled(k2)  # k1's buffer is retired, but v1 still sees it
        second = id(v2.obj)
        assert second != first and bytes(v1) == b1 and bytes(v2) == b2
        del v1, v2
        reused = buffers.stats["buffers_reused"]
        v3 = await read_settled(k3)
        assert id(v3.obj) in (first, second) and bytes(v3) == b3
        assert buffers.stats["buffers_reused"] > reused
        assert len(store) == 3 and bytes(store.read(k1) or b"") == b1  # what went to flash is intact
        nursery.cancel_scope.cancel()
