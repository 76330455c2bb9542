"""Directory readahead's choices (client/dirahead.py), over a reader that only records.

Which files a miss fetches ahead (the next ones in listing order, itself and
what L1 holds skipped, written and imported files alike), that a used block
starts one more, that unread prefetched bytes never pass the budget, and
that blocks evicted unread give their room back.
"""

from __future__ import annotations

import mmap
from typing import Any

import trio
import trio.lowlevel
import trio.testing

from cachefs.client.dirahead import DirReadahead
from cachefs.client.l1 import L1Cache
from cachefs.client.reader import Reader
from cachefs.ids import REPO_SLICE_BIT, BlockKey
from cachefs.layout import Slice

BS = 4 << 20
SIZE = 100_000


class FakeReader:
    def __init__(self) -> None:
        self.source: Any = type("Source", (), {"block_size": BS})()
        self.l1: set[BlockKey] = set()
        self.fetching: set[BlockKey] = set()
        self.started: list[BlockKey] = []
        self.batches: list[list[BlockKey]] = []
        self.room = 0  # L1's free bytes

    def l1_room(self) -> int:
        return self.room

    def has_or_fetching(self, key: BlockKey) -> bool:
        return key in self.l1 or key in self.fetching

    def prefetch_block(self, key: BlockKey) -> None:
        self.started.append(key)
        self.fetching.add(key)

    def prefetch_many(self, keys: list[BlockKey]) -> None:
        self.batches.append(list(keys))
        for k in keys:
            self.prefetch_block(k)

    def land(self) -> None:
        self.l1 |= self.fetching
        self.fetching.clear()


def key(i: int, imported: bool = True) -> BlockKey:
    return BlockKey((REPO_SLICE_BIT if imported else 0) + 1000 + i, 0)


def files(n: int, imported: bool = True) -> list[tuple[int, int, list[Slice]]]:
    return [(100 + i, SIZE, [Slice(key(i, imported).slice_id, 0, SIZE)]) for i in range(n)]


def test_a_miss_fetches_the_next_listed_files_and_used_ones_top_up_half_a_window() -> None:
    reader = FakeReader()
    ahead = DirReadahead(reader, budget=1 << 30, per_miss=4)  # type: ignore[arg-type]
    ahead.listed(7, files(20), restart=True)
    reader.l1.add(key(2))  # read before: skipped
    ahead.missed(100 + 1)  # itself skipped too
    assert reader.started == [key(0), key(3), key(4), key(5)]
    assert reader.batches == [[key(0), key(3), key(4), key(5)]]  # one batch
    reader.land()
    ahead.used(key(3))
    assert len(reader.started) == 4  # owed, not started alone
    ahead.used(key(3))  # counted once
    assert len(reader.started) == 4
    ahead.used(key(4))  # half the window used: topped up together
    assert reader.batches[-1] == [key(6), key(7)] and len(reader.started) == 6
    ahead.missed(999)  # a file of no listed directory: nothing
    assert len(reader.started) == 6


def test_written_files_are_fetched_ahead_as_imported_ones_and_empty_or_unlisted_ones_are_not() -> None:
    reader = FakeReader()
    ahead = DirReadahead(reader, budget=1 << 30, per_miss=4)  # type: ignore[arg-type]
    empty = [(200 + i, 0, []) for i in range(3)]
    hole = [(300, SIZE, [])]  # a size but no data (a truncated-up file): nothing to fetch
    ahead.listed(7, empty + hole + files(10, imported=False), restart=True)
    ahead.missed(100)
    assert reader.started == [key(i, imported=False) for i in (1, 2, 3, 4)]
    ahead.missed(999)  # not of a listed directory
    assert len(reader.started) == 4


def test_unread_prefetched_bytes_stay_within_the_budget_and_evicted_ones_free_it() -> None:
    reader = FakeReader()
    ahead = DirReadahead(reader, budget=3 * SIZE, per_miss=8)  # type: ignore[arg-type]
    ahead.listed(7, files(50), restart=True)
    ahead.missed(100 + 49)
    assert len(reader.started) == 3  # the budget, not per_miss
    reader.land()
    ahead.missed(100 + 48)
    assert len(reader.started) == 3  # still unread: no room
    reader.l1.discard(reader.started[0])  # evicted unread
    ahead.missed(100 + 48)
    assert len(reader.started) == 4 and ahead.window == 4  # fetched for nothing: the window halved
    ahead.used(reader.started[1])
    ahead.used(reader.started[2])
    assert len(reader.started) == 4  # owed: fewer than half the window (6 by now)
    ahead.used(reader.started[3])  # read: their room starts more, together
    assert len(reader.started) == 7 and ahead.window == 7  # the budget again


def test_free_room_in_l1_is_fetched_into_beyond_the_budget() -> None:
    """Filling free room evicts nothing: the budget bounds only what
    prefetching may displace."""
    reader = FakeReader()
    ahead = DirReadahead(reader, budget=3 * SIZE, per_miss=8)  # type: ignore[arg-type]
    ahead.listed(7, files(50), restart=True)
    reader.room = 2 * SIZE
    ahead.missed(100 + 49)
    assert len(reader.started) == 5  # the budget and the room
    reader.land()
    reader.room = 0  # what landed took the room
    ahead.missed(100 + 48)
    assert len(reader.started) == 5


def test_a_new_listing_replaces_the_old_one_and_the_cursor_wraps() -> None:
    reader = FakeReader()
    ahead = DirReadahead(reader, budget=1 << 30, per_miss=2)  # type: ignore[arg-type]
    ahead.listed(7, files(3), restart=True)
    ahead.missed(100)
    assert reader.started == [key(1), key(2)]
    reader.land()
    reader.l1.clear()  # all evicted: a later epoch
    ahead.missed(100 + 2)
    assert reader.started[2:] == [key(0), key(1)]  # wrapped round, itself skipped
    ahead.listed(7, files(1), restart=True)
    ahead.missed(100 + 1)  # no longer listed
    assert len(reader.started) == 4


class SlowSource:
    """Blocks of ``block_size`` bytes, each fetch held until ``go`` is set."""

    block_size = BS

    def __init__(self) -> None:
        self.fetches: list[BlockKey] = []
        self.go = trio.Event()

    async def read_chunk(self, ino: int, chunk: int) -> list[Slice]:
        return []

    async def fetch(self, key: BlockKey, offset: int = 0, length: int = -1) -> bytes:
        self.fetches.append(key)
        await self.go.wait()
        return b"x" * 10


async def test_a_block_waiting_for_a_prefetch_slot_counts_as_on_its_way_and_is_fetched_once() -> None:
    source = SlowSource()
    async with trio.open_nursery() as nursery:
        reader = Reader(source, L1Cache(1 << 20), nursery=nursery, readahead_max=BS, max_parallel=1)  # type: ignore[arg-type]
        ahead = DirReadahead(reader, budget=1 << 30, per_miss=2)
        ahead.listed(7, files(3), restart=True)
        ahead.missed(100 + 2)  # one of key(0), key(1) takes the one slot, the other waits for it
        await trio.testing.wait_all_tasks_blocked()
        assert len(source.fetches) == 1 and source.fetches[0] in (key(0), key(1))  # trio picks the order
        waiting = key(1) if source.fetches[0] == key(0) else key(0)
        assert reader.has_or_fetching(waiting)  # queued: not started again
        ahead.missed(100 + 2)
        reader.prefetch_block(waiting)
        source.go.set()
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(source.fetches) == sorted([key(0), key(1)]) and waiting in reader.l1
        assert ahead.stats["dir_prefetches"] == 2


def test_directories_are_remembered_up_to_a_bound_and_known_until_forgotten() -> None:
    """Every listed directory is remembered (the mount lets the kernel keep
    only the listings of those it knows: see CacheFS.dir_cacheable), the
    ones without imported files too, but no more than MAX_DIRS of them."""
    from cachefs.client import dirahead

    reader = FakeReader()
    ahead = DirReadahead(reader, budget=1 << 30, per_miss=4)  # type: ignore[arg-type]
    ahead.listed(1, files(3), restart=True)
    assert ahead.knows(1) and not ahead.knows(2)
    for d in range(2, dirahead.MAX_DIRS + 10):
        ahead.listed(d, files(2, imported=False), restart=True)
    assert len(ahead._dirs) == dirahead.MAX_DIRS
    assert not ahead.knows(1) and ahead.knows(dirahead.MAX_DIRS + 9)


class BatchSource:
    """Blocks from two fake cache nodes, by key parity; ``cached``: what they hold."""

    block_size = BS

    def __init__(self, cached: set[BlockKey]) -> None:
        self.cached = cached
        self.batches: list[tuple[str, list[BlockKey]]] = []
        self.fetches: list[BlockKey] = []

    def owner(self, key: BlockKey) -> str:
        return f"node{key.slice_id % 2}"

    async def read_chunk(self, ino: int, chunk: int) -> list[Slice]:
        return []

    async def fetch_many(self, addr: str, keys: list[BlockKey]) -> dict[BlockKey, bytes]:
        self.batches.append((addr, list(keys)))
        await trio.lowlevel.checkpoint()
        return {k: k.to_bytes() for k in keys if k in self.cached}

    async def fetch(self, key: BlockKey, offset: int = 0, length: int = -1) -> bytes:
        self.fetches.append(key)
        return key.to_bytes()


async def test_a_miss_fetches_ahead_in_one_batch_per_cache_node_and_misses_go_one_at_a_time() -> None:
    source = BatchSource({key(i) for i in range(10) if i != 4})
    async with trio.open_nursery() as nursery:
        reader = Reader(source, L1Cache(1 << 20), nursery=nursery, readahead_max=BS)  # type: ignore[arg-type]
        ahead = DirReadahead(reader, budget=1 << 30, per_miss=8)
        ahead.listed(7, files(10), restart=True)
        ahead.missed(100 + 9)
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(addr for addr, _ in source.batches) == ["node0", "node1"]
        assert sorted(k for _, keys in source.batches for k in keys) == [key(i) for i in range(8)]
        assert source.fetches == [key(4)]  # not cached there: the single path (which reads through)
        for i in range(8):
            assert bytes(reader.l1.get(key(i)) or b"") == key(i).to_bytes()
        assert reader.stats["batch_blocks"] == 7 and reader.stats["prefetches"] == 8
        assert await reader.block(key(3)) == key(3).to_bytes()  # in L1: no fetch
        assert source.fetches == [key(4)]


def test_blocks_evicted_unread_shrink_the_window_and_used_ones_grow_it_back() -> None:
    reader = FakeReader()
    ahead = DirReadahead(reader, budget=8 * SIZE, per_miss=8)  # type: ignore[arg-type]
    ahead.listed(7, files(100), restart=True)
    ahead.missed(100 + 99)
    assert len(reader.started) == 8 and ahead.window == 8
    reader.fetching.clear()  # all 8 evicted unread (a shuffled epoch larger than L1)
    ahead.missed(100 + 98)  # the budget is full: reclaiming finds the waste
    assert ahead.stats["dir_prefetches_wasted"] == 8 and ahead.window == 4
    assert len(reader.started) == 8 + 4
    reader.land()
    for k in reader.started[8:12]:
        ahead.used(k)
    assert ahead.window == 8  # read: grown back, by one a block


async def test_session_fetch_many_asks_again_for_what_a_reply_left_out_and_remembers_old_nodes() -> None:
    from cachefs.client.session import Session
    from cachefs.errors import NoSuchMethod
    from cachefs.messages import MANY_MISS, MANY_NOT_SERVED

    class Transport:  # a node that serves two blocks a reply and misses key(1)
        def __init__(self) -> None:
            self.calls: list[tuple[str, list[BlockKey]]] = []

        async def get_many(self, addr: str, volume: str, keys: list[BlockKey], *, timeout: float,
                           scratch: mmap.mmap | None = None) -> list[Any]:
            self.calls.append((addr, list(keys)))
            if addr == "old":
                raise NoSuchMethod("no method get_many")
            out: list[Any] = []
            for k in keys:
                if k == key(1):
                    out.append(MANY_MISS)
                elif sum(isinstance(o, memoryview) for o in out) < 2:
                    out.append(memoryview(k.to_bytes()))
                else:
                    out.append(MANY_NOT_SERVED)
            return out

    transport = Transport()
    session = Session(None, "v", "s", {}, zone="z1", transport=transport, backing=None)  # type: ignore[arg-type]
    keys = [key(i) for i in range(6)]
    got = await session.fetch_many("new", keys)
    assert got == {k: k.to_bytes() for k in keys if k != key(1)}
    assert all(type(v) is bytes for v in got.values())
    assert [len(ks) for _, ks in transport.calls] == [6, 3, 1]  # the rest asked again, the miss not
    assert await session.fetch_many("old", keys) == {}
    assert "old" in session._no_get_many
