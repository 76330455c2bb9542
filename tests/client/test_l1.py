"""L1 cache: byte bound and LRU order, checked against a simple model."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from cachefs.client.l1 import L1Cache
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
