"""L1 cache: byte bound and LRU order, checked against a simple model."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from cachefs.buffers import BufferPool
from cachefs.client.l1 import L1Cache
from cachefs.client.session import Session
from cachefs.ids import BlockKey

ops_st = st.lists(
    st.tuples(st.sampled_from(["get", "put", "discard"]), st.integers(0, 7), st.integers(0, 40)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(0, 100), ops=ops_st)
def test_lru_by_bytes_matches_model(capacity, ops) -> None:
    cache = L1Cache(capacity)
    model: OrderedDict[int, bytes] = OrderedDict()
    for op, k, size in ops:
        key = BlockKey(k, 0)
        if op == "put":
            data = bytes([k]) * size
            if size <= capacity:
                model.pop(k, None)
                while sum(map(len, model.values())) + size > capacity:
                    model.popitem(last=False)
                model[k] = data
            cache.put(key, data)
        elif op == "get":
            expect = model.get(k)
            if expect is not None:
                model.move_to_end(k)
            assert cache.get(key) == expect
        else:
            model.pop(k, None)
            cache.discard(key)
        assert cache.used == sum(map(len, model.values())) <= capacity
        assert len(cache) == len(model)


def test_recently_used_survives() -> None:
    cache = L1Cache(30)
    for i in range(3):
        cache.put(BlockKey(i, 0), b"x" * 10)
    assert cache.get(BlockKey(0, 0)) is not None  # 0 becomes most recent
    cache.put(BlockKey(3, 0), b"y" * 10)  # evicts 1, the least recent
    assert BlockKey(1, 0) not in cache and BlockKey(0, 0) in cache
    assert cache.stats.evictions == 1 and cache.stats.hits == 1


# ---------------------------------------------------------------- evicted buffers used again

MiB = 1 << 20


def test_an_evicted_block_nobody_holds_receives_the_next_one() -> None:
    pool = BufferPool()
    l1 = L1Cache(2 * MiB, recycle=pool.give)
    l1.put(BlockKey(1, 0), bytearray(MiB))
    first = id(l1.get(BlockKey(1, 0)))
    l1.put(BlockKey(1, 1), bytearray(MiB))
    l1.put(BlockKey(1, 2), bytearray(MiB))  # evicts block 0, which only L1 held
    assert pool.stats["buffers_kept"] == 1
    again = pool.take(MiB)
    assert id(again) == first and pool.stats["buffers_reused"] == 1
    assert pool.take(MiB) is not again  # the pool had one: a new buffer now
    assert len(pool.take(3 * MiB)) == 3 * MiB  # no buffer of that size: a new one


def test_an_evicted_block_someone_still_reads_is_not_used_again() -> None:
    pool = BufferPool()
    l1 = L1Cache(2 * MiB, recycle=pool.give)
    held = bytearray(MiB)
    l1.put(BlockKey(2, 0), held)  # another reference: ours
    block = bytearray(MiB)
    block[:5] = b"hello"
    l1.put(BlockKey(2, 1), block)
    view = memoryview(block)[:5]  # what a FUSE reply of it holds
    del block
    l1.put(BlockKey(2, 2), bytearray(MiB))
    l1.put(BlockKey(2, 3), bytearray(MiB))  # evicts both
    assert pool.stats["buffers_kept"] == 0
    assert pool.take(MiB) is not held and bytes(view) == b"hello"
    l1.put(BlockKey(2, 4), memoryview(bytearray(MiB)))  # an L2 read's view: never kept
    l1.put(BlockKey(2, 5), bytes(MiB))  # blocks 2 and 3 go: only L1 held them
    l1.put(BlockKey(2, 6), bytes(MiB))  # the view goes
    assert pool.stats["buffers_kept"] == 2


async def test_a_stored_block_is_copied_once_for_the_codec_and_l1() -> None:
    """The session hands the codec bytes (which it would otherwise copy itself)
    and gives L1 and L2 that same copy, not a second one."""

    class Backing:  # BackingClient.put_block's shape: records what it was given
        def __init__(self) -> None:
            self.got: list[object] = []

        async def put_block(self, volume: str, key: BlockKey, data: object) -> list[object]:
            self.got.append(data)
            return []

    backing = Backing()
    session = Session(None, "v", "s", {}, zone="z1", transport=None, backing=backing)  # type: ignore[arg-type]
    kept: list[object] = []
    session.on_block_stored = lambda key, data: kept.append(data)
    run = bytearray(b"x" * 1000)
    assert await session.store_block(BlockKey(1, 0), memoryview(run)[:500]) is False
    assert type(backing.got[0]) is bytes and kept[0] is backing.got[0] and kept[0] == b"x" * 500
