"""The cache node service over real RPC: hits, misses, ranges, single flight, limits, prefetch."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import trio
from prometheus_client import REGISTRY

from cachefs.blockstore import BlockStore
from cachefs.cachenode.admission import SecondMissAdmission
from cachefs.cachenode.service import CacheLimits
from cachefs.errors import Busy, CacheMiss, InvalidArgument, NotFound
from cachefs.ids import BlockKey
from cachefs.pagecache import WouldBlock
from cachefs.rpc import RpcPool

from .blockserver import cache_setup

SIZE = 256 * 1024 + 17


async def _until_cached(store: BlockStore, key: BlockKey) -> None:
    """Replies go out before the flash write ends; wait for it."""
    with trio.fail_after(5):
        while key not in store:  # noqa: ASYNC110 - polling the real store
            await trio.sleep(0.005)


def _blocks(n: int, size: int = SIZE) -> dict[BlockKey, bytes]:
    rng = random.Random(n)
    return {BlockKey(100 + i, i % 3): rng.randbytes(size) for i in range(n)}


async def test_miss_then_hit_with_ranges(tmp_path: Path) -> None:
    blocks = _blocks(2)
    key, data = next(iter(blocks.items()))
    async with cache_setup(tmp_path, blocks) as c:
        reply = await c.get(key, 1000, 5000)
        assert reply.result == {"size": SIZE, "hit": False}
        assert bytes(reply.payload) == data[1000:6000]
        for off, ln in [
            (0, -1),
            (0, 1),
            (SIZE - 1, 10),
            (SIZE, 5),
            (16 * 1024 - 3, 128 * 1024),
            (77, 0),
        ]:
            reply = await c.get(key, off, ln)
            assert reply.result["hit"] is True
            assert bytes(reply.payload or b"") == (data[off:] if ln == -1 else data[off : off + ln])
        with pytest.raises(InvalidArgument):
            await c.get(key, SIZE + 1, 1)
        stats = await c.pool.call(c.addr, "stats")
        assert stats.result["hits"] == 6 and stats.result["misses"] == 1
        assert stats.result["backing_fetches"] == 1 and c.backing.fetches[key] == 1
        # the RDMA responder's entry point serves the same bytes
        assert bytes(await c.service.read_range("v", key, 10, 20, "wait")) == data[10:30]
        with pytest.raises(NotFound):
            await c.get(BlockKey(9, 9))
        with pytest.raises(InvalidArgument):
            await c.pool.call(c.addr, "get", {"volume": "v", "key": b"short"})
        with pytest.raises(InvalidArgument):
            await c.get(key, policy="sometimes")


async def test_hundred_concurrent_readers_one_backing_fetch(tmp_path: Path) -> None:
    blocks = _blocks(1)
    key, data = next(iter(blocks.items()))
    async with cache_setup(tmp_path, blocks, delay=0.2) as c:
        results: list[bytes] = []

        async def reader(i: int) -> None:
            off = (i * 997) % SIZE
            reply = await c.get(key, off, 4096)
            results.append(bytes(reply.payload) == data[off : off + 4096])

        async with trio.open_nursery() as n:
            for i in range(100):
                n.start_soon(reader, i)
        assert results == [True] * 100
        assert c.backing.fetches[key] == 1
        await _until_cached(c.store, key)
        stats = (await c.pool.call(c.addr, "stats")).result
        # Readers that a stalled machine lets in after the fill count as hits.
        assert stats["misses"] + stats["hits"] == 100 and stats["misses"] >= 1
        assert stats["backing_fetches"] == 1 and stats["blocks"] == 1
        labels = {"node": c.service.node}
        assert REGISTRY.get_sample_value("cachefs_cache_misses_total", labels) == stats["misses"]
        assert REGISTRY.get_sample_value("cachefs_cache_filled_bytes_total", labels) == SIZE
        assert REGISTRY.get_sample_value("cachefs_cache_served_bytes_total", labels) == 100 * 4096
        assert REGISTRY.get_sample_value("cachefs_cache_backing_fetch_seconds_count", labels) == 1
        assert REGISTRY.get_sample_value("cachefs_cache_fill_seconds_count", labels) == 1
        assert REGISTRY.get_sample_value("cachefs_cache_admissions_total", {**labels, "decision": "admitted"}) == 1
        assert REGISTRY.get_sample_value("cachefs_cache_used_bytes", labels) == c.store.used >= SIZE
        assert REGISTRY.get_sample_value("cachefs_cache_capacity_bytes", labels) == c.store.capacity > 0
        await c.get(key)
        assert REGISTRY.get_sample_value("cachefs_cache_hits_total", labels) == stats["hits"] + 1


async def test_backing_fetches_are_bounded(tmp_path: Path) -> None:
    blocks = _blocks(12, 1000)
    limits = CacheLimits(max_backing_fetches=3)
    async with cache_setup(tmp_path, blocks, delay=0.05, limits=limits) as c:
        async with trio.open_nursery() as n:
            for key in blocks:
                n.start_soon(c.get, key)
        assert c.backing.max_in_flight == 3
        assert sum(c.backing.fetches.values()) == 12


async def test_fast_fail_answers_miss_and_fills_in_background(tmp_path: Path) -> None:
    blocks = _blocks(1)
    key, data = next(iter(blocks.items()))
    async with cache_setup(tmp_path, blocks, delay=0.05) as c:
        with pytest.raises(CacheMiss):
            await c.get(key, policy="fast-fail")
        with pytest.raises(CacheMiss):
            await c.get(key, policy="fast-fail")  # still filling: no second fetch
        await _until_cached(c.store, key)
        reply = await c.get(key, 10, 20, policy="fast-fail")
        assert reply.result["hit"] and bytes(reply.payload) == data[10:30]
        assert c.backing.fetches[key] == 1


@pytest.mark.allow_log("cachefs.blockstore", match=r"failed its checksum, dropped")
async def test_corrupt_cached_block_is_refetched(tmp_path: Path) -> None:
    blocks = _blocks(1)
    key, data = next(iter(blocks.items()))
    async with cache_setup(tmp_path, blocks) as c:
        await c.get(key)
        await _until_cached(c.store, key)
        path = c.store.path(key)
        raw = bytearray(path.read_bytes())
        raw[-100] ^= 0xFF
        path.write_bytes(bytes(raw))
        reply = await c.get(key)
        assert bytes(reply.payload) == data and reply.result["hit"] is False
        assert c.backing.fetches[key] == 2
        stats = (await c.pool.call(c.addr, "stats")).result
        assert stats["corrupt"] == 1 and stats["corrupt_refetched"] == 1
        reply = await c.get(key, SIZE - 200, 200)
        assert reply.result["hit"] and bytes(reply.payload) == data[-200:]


async def test_a_block_on_the_disk_is_asked_of_the_page_cache_once(tmp_path: Path) -> None:
    """A hit that the page cache does not hold goes to a thread after one
    RWF_NOWAIT try, not a second one on the way there."""
    blocks = _blocks(1)
    key, data = next(iter(blocks.items()))
    async with cache_setup(tmp_path, blocks) as c:
        await c.get(key)
        await _until_cached(c.store, key)
        fd = os.open(c.store.path(key), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the block is on the disk only
        finally:
            os.close(fd)
        tries: list[bool] = []  # per page-cache try: whether it found the bytes
        read = c.store.read

        def spy(key: BlockKey, offset: int = 0, length: int = -1, *, nowait: bool = False) -> memoryview | None:
            try:
                data = read(key, offset, length, nowait=nowait)
            except WouldBlock:
                tries.append(False)
                raise
            if nowait:
                tries.append(True)
            return data

        c.store.read = spy  # type: ignore[method-assign]
        reply = await c.get(key, 4096, 4096)
        assert reply.result["hit"] and bytes(reply.payload) == data[4096:8192]
        assert tries == [False]


async def test_request_limits_answer_busy(tmp_path: Path) -> None:
    blocks = _blocks(6, 1000)
    keys = list(blocks)
    limits = CacheLimits(max_requests=3, max_per_client=2)
    async with cache_setup(tmp_path, blocks, delay=2.0, limits=limits) as c:  # fetches outlast the arrivals
        outcomes: list[str] = []

        async def reader(key: BlockKey, pool: RpcPool | None) -> None:
            try:
                await c.get(key, pool=pool)
                outcomes.append("ok")
            except Busy:
                outcomes.append("busy")

        async with RpcPool(secret=None) as other, trio.open_nursery() as n:
            for key in keys[:3]:  # the same connection: only two fit
                n.start_soon(reader, key, None)
            await trio.sleep(0.1)
            n.start_soon(reader, keys[3], other)  # another client still gets the last slot
            await trio.sleep(0.05)
            n.start_soon(reader, keys[4], other)  # the node is full
        assert sorted(outcomes) == ["busy", "busy", "ok", "ok", "ok"]
        assert (await c.pool.call(c.addr, "stats")).result["busy"] == 2


async def test_put_write_through_then_hits(tmp_path: Path) -> None:
    key = BlockKey(5, 0)
    data = random.randbytes(SIZE)
    async with cache_setup(tmp_path, {}, admission=SecondMissAdmission()) as c:
        reply = await c.pool.call(
            c.addr, "put", {"volume": "v", "key": key.to_bytes()}, payload=data
        )
        assert reply.result == {"stored": True}
        reply = await c.get(key, 5, 10)
        assert reply.result["hit"] and bytes(reply.payload) == data[5:15]
        assert sum(c.backing.fetches.values()) == 0


async def test_admission_caches_on_second_miss(tmp_path: Path) -> None:
    blocks = _blocks(1)
    key, data = next(iter(blocks.items()))
    async with cache_setup(tmp_path, blocks, admission=SecondMissAdmission(window=60)) as c:
        assert bytes((await c.get(key)).payload) == data
        assert key not in c.store
        assert bytes((await c.get(key)).payload) == data
        await _until_cached(c.store, key)
        assert (await c.get(key)).result["hit"]
        assert c.backing.fetches[key] == 2
        labels = {"node": c.service.node}
        for decision in ("admitted", "refused"):
            assert REGISTRY.get_sample_value("cachefs_cache_admissions_total", {**labels, "decision": decision}) == 1


async def test_prefetch_then_reads_hit_and_rerun_is_cached(tmp_path: Path) -> None:
    blocks = _blocks(10)
    keys = [k.to_bytes() for k in blocks]
    missing = BlockKey(999, 0).to_bytes()
    async with cache_setup(tmp_path, blocks, admission=SecondMissAdmission()) as c:
        reply = await c.pool.call(
            c.addr, "prefetch", {"volume": "v", "keys": keys + [missing], "wait": True}
        )
        assert reply.result == {
            "queued": 11,
            "cached": 0,
            "done": 10,
            "failed": 1,
            "bytes": 10 * SIZE,
        }
        for key, data in blocks.items():
            got = await c.get(key)
            assert got.result["hit"] and bytes(got.payload) == data
        reply = await c.pool.call(c.addr, "prefetch", {"volume": "v", "keys": keys, "wait": True})
        assert reply.result == {"queued": 0, "cached": 10, "done": 0, "failed": 0, "bytes": 0}
        reply = await c.pool.call(c.addr, "prefetch", {"volume": "v", "keys": [missing]})
        assert reply.result == {"queued": 1, "cached": 0}
        with trio.fail_after(5):
            while (await c.pool.call(c.addr, "prefetch_status")).result["queued"]:  # noqa: ASYNC110
                await trio.sleep(0.01)
        status = (await c.pool.call(c.addr, "prefetch_status")).result
        assert status == {"done": 10, "failed": 2, "queued": 0, "cached": 10}
        assert sum(c.backing.fetches.values()) == 12


async def test_eviction_under_small_capacity_over_rpc(tmp_path: Path) -> None:
    blocks = _blocks(20, 50_000)
    async with cache_setup(tmp_path, blocks, capacity=5 * 51_000) as c:
        rng = random.Random(3)
        keys = list(blocks)
        for _ in range(80):
            key = rng.choice(keys)
            off = rng.randrange(50_000)
            reply = await c.get(key, off, 3000)
            assert bytes(reply.payload) == blocks[key][off : off + 3000]
            assert c.store.used <= c.store.capacity
        # A get answers once its block is fetched; the fill stores it (and evicts) after that.
        with trio.fail_after(30):
            while (stats := (await c.pool.call(c.addr, "stats")).result)["fills_in_flight"]:
                await trio.sleep(0.01)
        assert stats["evictions"] > 0 and stats["blocks"] <= 5
        labels = {"node": c.service.node}
        for cause, want in (("capacity", stats["evictions"]), ("expired", 0), ("corrupt", 0)):
            assert REGISTRY.get_sample_value("cachefs_cache_evictions_total", {**labels, "cause": cause}) == want
        assert REGISTRY.get_sample_value("cachefs_cache_capacity_bytes", labels) == 5 * 51_000
        assert REGISTRY.get_sample_value("cachefs_cache_used_bytes", labels) == c.store.used > 0


class _BrokenSource:
    """A backing source with a bug: it returns something that is not bytes."""

    def __init__(self) -> None:
        self.calls = 0

    async def get_block(self, volume: str, key: BlockKey) -> bytes:
        self.calls += 1
        return 42  # type: ignore[return-value]


@pytest.mark.allow_log("cachefs.cachenode.service", match=r"fill of .* failed unexpectedly")
async def test_a_broken_backing_source_fails_readers_not_the_node(tmp_path: Path) -> None:
    from cachefs.cachenode.service import CacheService
    from cachefs.errors import IOFailure

    source = _BrokenSource()
    async with trio.open_nursery() as nursery:
        service = CacheService(
            BlockStore.open(tmp_path, 1 << 20), source, nursery=nursery, node="broken"
        )
        for _ in range(2):
            with pytest.raises(IOFailure):
                await service.read("v", BlockKey(1, 0))
        answer = await service.prefetch_keys("v", [BlockKey(2, 0)], wait=True)
        assert answer["failed"] == 1
        assert source.calls == 3
        nursery.cancel_scope.cancel()


async def test_ttl_blocks_expire_in_the_background(tmp_path: Path) -> None:
    from cachefs.cachenode.service import CacheService

    store = BlockStore.open(tmp_path, 1 << 20, ttl={"scratch": 0.2})
    async with trio.open_nursery() as nursery:
        service = CacheService(
            store, _BrokenSource(), nursery=nursery, node="ttl", expire_interval=0.05
        )
        await service.put("scratch", BlockKey(1, 0).to_bytes(), payload=b"x" * 100)
        await service.put("keep", BlockKey(2, 0).to_bytes(), payload=b"y" * 100)
        assert len(store) == 2
        with trio.fail_after(5):
            while len(store) == 2:  # noqa: ASYNC110 - waiting for the node's expiry task
                await trio.sleep(0.05)
        assert store.cached_keys() == [BlockKey(2, 0)]
        assert store.stats()["expired"] == 1
        assert REGISTRY.get_sample_value("cachefs_cache_evictions_total", {"node": "ttl", "cause": "expired"}) == 1
        nursery.cancel_scope.cancel()
