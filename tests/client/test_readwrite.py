"""Reader and FileWriter against the real metanode state machine.

Metadata goes through ``MetaState`` (the namespace the metanodes replicate),
applied in-process; blocks live in a dict. That makes the read/write paths
testable in milliseconds: random writes, flushes, truncates and reads compared
with a bytearray, plus the readahead, single-flight and backpressure rules.
The same paths run over real processes in test_mount.py.
"""

from __future__ import annotations

import itertools
import random

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.client.inodes import Inode
from cachefs.client.l1 import L1Cache
from cachefs.client.l2 import CachedBlocks, L2Cache
from cachefs.client.reader import Readahead, Reader
from cachefs.client.writer import FileWriter, WriteBudget
from cachefs.errors import FileTooLarge, IOFailure, NotFound, QuotaExceeded, Unavailable
from cachefs.ids import BlockKey
from cachefs.layout import Slice
from cachefs.messages import Attr
from cachefs.metanode.namespace import Failure, MetaState

VOL = "vol"
BLOCK = 64 * 1024


class InProcess:
    """BlockSource + BlockSink over a MetaState and a dict of blocks."""

    def __init__(self, block_size: int = BLOCK, delay: float = 0.0) -> None:
        self.block_size = block_size
        self.state = MetaState()
        self.blocks: dict[BlockKey, bytes] = {}
        self.delay = delay
        self.fetches: list[tuple[BlockKey, int, int]] = []
        self.fail_puts = False
        self._seq = itertools.count(1)
        self._index = itertools.count(1)
        self.do(C.CreateVolume, VOL, "replica:3", "none", block_size, 8)

    def do(self, cls: type[C.Command], *args: object) -> object:
        cmd = cls(*args, client_id="test", seq=next(self._seq), now_ns=1_000_000)
        result = self.state.apply(next(self._index), cmd.encode())
        if isinstance(result, Failure):
            raise result.error()
        return result

    def new_file(self, name: bytes = b"f") -> Inode:
        return Inode(Attr.from_wire(self.do(C.Mknod, VOL, 1, name, 0o100644, 0, 0, 0)))

    def truncate(self, inode: Inode, size: int) -> None:
        inode.set_attr(Attr.from_wire(self.do(C.SetAttr, VOL, inode.ino, None, None, None, size)))

    async def read_chunk(self, ino: int, chunk: int) -> list[Slice]:
        return [Slice.from_wire(r) for r in self.state.read_chunk(VOL, ino, chunk)]

    async def fetch(self, key: BlockKey, offset: int = 0, length: int = -1) -> bytes:
        self.fetches.append((key, offset, length))
        await trio.sleep(self.delay)
        data = self.blocks.get(key)
        if data is None:
            raise NotFound(key.hex())
        return data[offset:] if length < 0 else data[offset : offset + length]

    async def alloc_slice(self) -> int:
        return int(self.do(C.AllocSlices, 1))

    async def store_block(self, key: BlockKey, data: bytes | memoryview) -> bool:
        await trio.sleep(self.delay * random.random())
        if self.fail_puts:
            raise Unavailable("datanodes down")
        self.blocks[key] = bytes(data)
        return False

    async def write_through(self, key: BlockKey, data: bytes | memoryview) -> None:
        pass

    async def write_slice(self, ino, chunk, slice_id, pos, length, offset, mtime_ns, short=()) -> Attr:
        return Attr.from_wire(
            self.do(C.WriteSlice, VOL, ino, chunk, slice_id, pos, length, offset, mtime_ns, short)
        )


def _writer(
    src: InProcess, inode: Inode, nursery: trio.Nursery, limit: int = 4 * BLOCK,
    budget: WriteBudget | None = None,
) -> FileWriter:
    inode.writer = FileWriter(
        src, inode, nursery=nursery, buffer_limit=limit, upload_limit=trio.Semaphore(4), budget=budget
    )
    return inode.writer


ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(0, 6 * BLOCK), st.integers(1, 2 * BLOCK)),
        st.tuples(st.just("read"), st.integers(0, 7 * BLOCK), st.integers(1, 3 * BLOCK)),
        st.tuples(st.just("flush"), st.just(0), st.just(0)),
        st.tuples(st.just("truncate"), st.integers(0, 6 * BLOCK), st.just(0)),
    ),
    min_size=1,
    max_size=20,
)


@settings(max_examples=40, deadline=None)
@given(ops=ops_st, seed=st.integers(0, 1000))
def test_random_io_matches_model(ops, seed) -> None:
    """Reads see every earlier write (committed or still buffered) and truncate."""
    rng = random.Random(seed)

    async def main() -> None:
        src = InProcess(delay=0.0005)
        inode = src.new_file()
        model = bytearray()
        async with trio.open_nursery() as n:
            reader = Reader(src, L1Cache(3 * BLOCK), nursery=n, readahead_max=4 * BLOCK)
            ra = reader.new_readahead()
            writer = _writer(src, inode, n)
            for op, a, b in ops:
                if op == "write":
                    data = rng.randbytes(b)
                    await writer.write(a, data)
                    if len(model) < a + b:
                        model.extend(bytes(a + b - len(model)))
                    model[a : a + b] = data
                elif op == "read":
                    assert await reader.read(inode, a, b, ra) == bytes(model[a : a + b])
                elif op == "flush":
                    await writer.flush()
                    assert inode.attr.size == len(model)
                else:
                    await writer.flush()
                    src.truncate(inode, a)
                    del model[a:]
                    model.extend(bytes(a - len(model)))
            await writer.flush()
            assert not writer.dirty
            assert await reader.read(inode, 0, len(model) + 10, None) == bytes(model)
            n.cancel_scope.cancel()

    trio.run(main)


async def test_sequential_reader_prefetches_whole_blocks(nursery) -> None:
    src = InProcess(delay=0.001)
    inode = src.new_file()
    data = random.randbytes(16 * BLOCK)
    writer = _writer(src, inode, nursery, limit=32 * BLOCK)
    await writer.write(0, data)
    await writer.flush()
    reader = Reader(src, L1Cache(64 * BLOCK), nursery=nursery, readahead_max=8 * BLOCK)
    ra = reader.new_readahead()
    step = 16 * 1024
    for off in range(0, 4 * BLOCK, step):
        assert await reader.read(inode, off, step, ra) == data[off : off + step]
    await trio.sleep(0.1)
    assert ra.window == 8 * BLOCK  # grew to the maximum
    assert reader.stats["prefetches"] >= 4
    assert all(length == -1 for _, _, length in src.fetches)  # whole blocks only
    # Each block fetched once, however many reads touched it.
    keys = [k for k, _, _ in src.fetches]
    assert len(keys) == len(set(keys))
    before = len(src.fetches)
    for off in range(4 * BLOCK, 8 * BLOCK, step):
        assert await reader.read(inode, off, step, ra) == data[off : off + step]
    assert reader.stats["l1_hit_bytes"] > 0
    assert len(src.fetches) - before <= 4
    # Readahead efficiency: the blocks read so far were prefetched, and used.
    assert 4 <= reader.stats["prefetches_used"] <= reader.stats["prefetches"]


def test_readahead_is_started_once_per_block_the_window_reaches() -> None:
    """A stream of small reads asks for each block once, when the window's end
    first reaches it; a random read starts over; a grown file gets its new blocks."""
    ra = Readahead(BLOCK, 4 * BLOCK)
    size = 64 * BLOCK
    started = []
    for off in range(0, 8 * BLOCK, 16 * 1024):
        assert ra.on_read(off, 16 * 1024)
        due = ra.due(off + 16 * 1024, size)
        if due is not None:
            started.append(due)
    assert started[0] == (16 * 1024, 2 * BLOCK)  # the first read: the window is one block
    assert all(a[1] == b[0] for a, b in itertools.pairwise(started))  # no block asked for twice
    assert started[-1][1] == 12 * BLOCK  # the last read's end plus the 4-block window, rounded up
    assert len(started) <= 8 + 3  # about one per block read, not one per read (256)
    assert not ra.on_read(40 * BLOCK, 4096) and ra.due(40 * BLOCK + 4096, size) is None  # random: none
    assert ra.on_read(40 * BLOCK + 4096, 4096) and ra.due(40 * BLOCK + 8192, size) == (40 * BLOCK + 8192, 42 * BLOCK)
    ra = Readahead(BLOCK, 4 * BLOCK)
    assert ra.on_read(0, BLOCK) and ra.due(BLOCK, 2 * BLOCK) == (BLOCK, 2 * BLOCK)  # stops at the end
    assert ra.on_read(BLOCK, 100) and ra.due(BLOCK + 100, 2 * BLOCK) is None
    assert ra.due(BLOCK + 100, 3 * BLOCK) == (2 * BLOCK, 3 * BLOCK)  # the file grew: its new block
    small = Readahead(BLOCK, 8 * BLOCK)  # a file smaller than a block, read whole: nothing to read ahead
    assert small.on_read(0, 128 * 1024) and small.due(110 * 1024, 110 * 1024) is None


async def test_random_reader_fetches_only_its_ranges(nursery) -> None:
    src = InProcess()
    inode = src.new_file()
    data = random.randbytes(8 * BLOCK)
    writer = _writer(src, inode, nursery, limit=16 * BLOCK)
    await writer.write(0, data)
    await writer.flush()
    reader = Reader(src, L1Cache(64 * BLOCK), nursery=nursery, readahead_max=8 * BLOCK)
    ra = reader.new_readahead()
    for off in (5 * BLOCK + 100, BLOCK + 7, 7 * BLOCK + 4000, 3 * BLOCK):
        assert await reader.read(inode, off, 4096, ra) == data[off : off + 4096]
    assert [length for _, _, length in src.fetches] == [4096] * 4
    assert reader.stats["prefetches"] == reader.stats["prefetches_used"] == 0 and len(reader.l1) == 0


async def test_concurrent_readers_share_one_fetch(nursery) -> None:
    src = InProcess(delay=0.01)
    inode = src.new_file()
    await _writer(src, inode, nursery).write(0, b"z" * BLOCK)
    await inode.writer.flush()
    reader = Reader(src, L1Cache(8 * BLOCK), nursery=nursery, readahead_max=BLOCK)
    (slice_,) = await src.read_chunk(inode.ino, 0)
    got: list[bytes] = []

    async def one() -> None:
        got.append(await reader.block(BlockKey(slice_.id, 0)))

    async with trio.open_nursery() as n:
        for _ in range(10):
            n.start_soon(one)
    assert got == [b"z" * BLOCK] * 10
    assert len(src.fetches) == 1


async def test_write_buffer_applies_backpressure(nursery) -> None:
    src = InProcess(delay=0.005)
    inode = src.new_file()
    limit = 4 * BLOCK
    writer = _writer(src, inode, nursery, limit=limit)
    peak = 0
    for i in range(40):
        await writer.write(i * BLOCK // 2, b"q" * (BLOCK // 2))
        peak = max(peak, writer.buffered)
    assert peak <= limit
    await writer.flush()
    assert inode.attr.size == 20 * BLOCK and not writer.dirty
    stats = writer.stats
    assert stats.written == stats.bytes == 20 * BLOCK and stats.blocks >= 20
    assert stats.slices >= 5 and sum(stats.commits.counts["commit"]) == stats.slices
    assert stats.commits.sums["commit"] > 0


async def test_files_written_at_once_share_one_write_budget(nursery) -> None:
    """Eight files, each allowed 4 blocks, under a budget of 4 blocks in all:
    the client never holds more than that (plus one write), and every byte lands."""
    src = InProcess(delay=0.005)
    budget = WriteBudget(4 * BLOCK)
    inodes = [src.new_file(b"f%d" % i) for i in range(8)]
    writers = [_writer(src, inode, nursery, limit=4 * BLOCK, budget=budget) for inode in inodes]
    peak = 0

    async def fill(writer: FileWriter) -> None:
        nonlocal peak
        for i in range(8):
            await writer.write(i * BLOCK // 2, b"q" * (BLOCK // 2))
            peak = max(peak, budget.used)
        await writer.flush()

    async with trio.open_nursery() as n:
        for writer in writers:
            n.start_soon(fill, writer)
    assert peak <= 4 * BLOCK + BLOCK // 2
    assert budget.used == 0 and all(inode.attr.size == 4 * BLOCK for inode in inodes)


async def test_a_write_waiting_for_the_budget_goes_on_when_another_file_commits(nursery) -> None:
    src = InProcess()
    budget = WriteBudget(2 * BLOCK)
    first, second = src.new_file(b"a"), src.new_file(b"b")
    holder = _writer(src, first, nursery, limit=8 * BLOCK, budget=budget)
    waiter = _writer(src, second, nursery, limit=8 * BLOCK, budget=budget)
    await holder.write(0, b"h" * 2 * BLOCK)  # an open extent: nothing uploads it yet
    done = trio.Event()

    async def write() -> None:
        await waiter.write(0, b"w" * BLOCK)
        done.set()

    nursery.start_soon(write)
    await trio.sleep(0.05)
    assert not done.is_set() and budget.waiting == 1
    await holder.flush()
    with trio.fail_after(5):
        await done.wait()
    await waiter.flush()
    assert budget.used == 0 and second.attr.size == BLOCK


async def test_small_random_writes_do_not_rewrite_blocks(nursery) -> None:
    src = InProcess()
    inode = src.new_file()
    writer = _writer(src, inode, nursery, limit=64 * BLOCK)
    await writer.write(0, b"a" * 8 * BLOCK)
    await writer.flush()
    stored = sum(map(len, src.blocks.values()))
    for off in (3 * BLOCK + 5, 6 * BLOCK + 77, 100):
        await writer.write(off, b"b" * 512)
    await writer.flush()
    assert sum(map(len, src.blocks.values())) - stored == 3 * 512


@pytest.mark.allow_log("cachefs.client.writer", match=r"failed: \[EUNAVAIL\] datanodes down")
async def test_failed_upload_is_reported_on_flush(nursery) -> None:
    src = InProcess()
    inode = src.new_file()
    writer = _writer(src, inode, nursery)
    src.fail_puts = True
    await writer.write(0, b"x" * 100)
    with pytest.raises(IOFailure, match="datanodes down"):
        await writer.flush()
    with pytest.raises(IOFailure):
        await writer.write(100, b"y")


@pytest.mark.allow_log("cachefs.client.writer", match=r"failed: \[ESLICEEXPIRED\]")
async def test_a_run_whose_slice_is_sealed_before_its_commit_is_stored_again(nursery) -> None:
    """The collector sealed the run's slice id while its blocks were stored (the
    writer held the id past the grace): the commit answers SliceExpired and the
    writer stores the run again under a new id, so nothing acknowledged refers to
    blocks the collector may delete. A run sealed at every try fails, as EIO."""
    src = InProcess()
    sealed: list[int] = []
    store = src.store_block

    async def store_then_seal(key: BlockKey, data: bytes | memoryview) -> bool:
        short = await store(key, data)
        if len(sealed) < seal_times and key.slice_id not in sealed:
            sealed.append(key.slice_id)
            src.do(C.SealSlices, src.state.next_slice)
        return short

    src.store_block = store_then_seal  # type: ignore[method-assign]
    seal_times = 1
    inode = src.new_file()
    data = random.randbytes(3 * BLOCK)
    writer = _writer(src, inode, nursery)
    await writer.write(0, data)
    await writer.flush()
    (piece,) = await src.read_chunk(inode.ino, 0)
    assert len(sealed) == 1 and piece.id > sealed[0]
    reader = Reader(src, L1Cache(4 * BLOCK), nursery=nursery, readahead_max=4 * BLOCK)
    assert await reader.read(inode, 0, len(data), reader.new_readahead()) == data
    assert src.state.unreferenced(VOL, tuple(sealed)).slice_ids == sealed  # garbage for the collector

    seal_times = 1 + 3  # every try of the next run
    other = src.new_file(b"g")
    writer = _writer(src, other, nursery)
    await writer.write(0, b"z" * 100)
    with pytest.raises(IOFailure, match="sealed"):
        await writer.flush()
    assert len(sealed) == 4 and other.attr.size == 0


async def test_a_commit_over_quota_is_edquot_at_a_later_write_and_at_flush(nursery) -> None:
    """The commit of a full buffer fails over quota: the write that waits for
    room, and the flush, say EDQUOT (not EIO), so the kernel tells the truth."""
    src = InProcess(delay=0.001)
    src.do(C.SetQuota, VOL, 1, 2 * BLOCK, None)
    inode = src.new_file()
    writer = _writer(src, inode, nursery, limit=4 * BLOCK)
    with pytest.raises(QuotaExceeded):
        for i in range(64):
            await writer.write(i * BLOCK // 2, b"q" * (BLOCK // 2))
    assert i < 63  # a write failed, not only the flush
    with pytest.raises(QuotaExceeded, match="byte quota"):
        await writer.flush()
    assert inode.attr.size <= 2 * BLOCK


async def test_a_write_past_the_largest_file_is_efbig(nursery) -> None:
    src = InProcess()
    inode = src.new_file()
    writer = _writer(src, inode, nursery)
    with pytest.raises(FileTooLarge):
        await writer.write(C.MAX_FILE_SIZE - 1, b"xy")
    await writer.write(C.MAX_FILE_SIZE - 1, b"x")  # the last byte a file can hold
    await writer.flush()
    assert inode.attr.size == C.MAX_FILE_SIZE


compact_ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(0, 6 * BLOCK), st.integers(1, 2 * BLOCK)),
        st.tuples(st.just("read"), st.integers(0, 7 * BLOCK), st.integers(1, 3 * BLOCK)),
        st.tuples(st.just("flush"), st.just(0), st.just(0)),
        st.tuples(st.just("compact"), st.just(0), st.just(0)),
        st.tuples(st.just("truncate"), st.integers(0, 6 * BLOCK), st.just(0)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(ops=compact_ops_st, seed=st.integers(0, 1000))
def test_session_io_with_compaction_matches_model(ops, seed) -> None:
    """The real Session (over an in-process metanode) with compactions in between."""
    from cachefs.rpc import RpcPool
    from cachefs.testing.metanode import local_metanode
    from tests.client.localfs import VOLUME

    rng = random.Random(seed)

    async def main() -> None:
        async with local_metanode() as metanode, RpcPool(secret=None) as pool:
            await metanode.create_volume(VOLUME, block_size=BLOCK)
            session = await metanode.session(pool, VOLUME)
            async with trio.open_nursery() as n:
                await _session_ops(session, n, ops, rng)
            await session.close()
            metanode.check()

    trio.run(main)


async def _session_ops(session, n: trio.Nursery, ops, rng: random.Random) -> None:
    """One example's operations on a new file of ``session``, against a bytearray."""
    from cachefs.client.compaction import Compactor

    inode = Inode(await session.meta.mutate(C.Mknod(session.volume, 1, b"f", 0o100644)))
    reader = Reader(session, L1Cache(3 * BLOCK), nursery=n, readahead_max=4 * BLOCK)
    ra = reader.new_readahead()
    writer = _writer(session, inode, n)  # type: ignore[arg-type]
    model = bytearray()
    for op, a, b in ops:
        if op == "write":
            data = rng.randbytes(b)
            await writer.write(a, data)
            if len(model) < a + b:
                model.extend(bytes(a + b - len(model)))
            model[a : a + b] = data
        elif op == "read":
            assert await reader.read(inode, a, b, ra) == bytes(model[a : a + b])
        elif op == "flush":
            await writer.flush()
        elif op == "compact":
            await Compactor(session, reader, nursery=n, threshold=1).compact(inode, 0)
        else:
            await writer.flush()
            resized = await session.meta.mutate(C.SetAttr(session.volume, inode.ino, size=a))
            inode.set_attr(resized)
            del model[a:]
            model.extend(bytes(a - len(model)))
    await writer.flush()
    assert await reader.read(inode, 0, len(model) + 10, None) == bytes(model)
    n.cancel_scope.cancel()


async def test_a_block_read_at_random_twice_is_cached_whole(nursery) -> None:
    src = InProcess()
    inode = src.new_file()
    data = random.randbytes(16 * BLOCK)
    writer = _writer(src, inode, nursery, limit=64 * BLOCK)
    await writer.write(0, data)
    await writer.flush()
    reader = Reader(src, L1Cache(64 * BLOCK), nursery=nursery, readahead_max=8 * BLOCK)
    ra = reader.new_readahead()
    # Far enough apart not to look sequential (SEQ_SLACK).
    for off in (10 * BLOCK + 100, 5000, 10 * BLOCK + 9000, 10 * BLOCK + 20000):
        assert await reader.read(inode, off, 4096, ra) == data[off : off + 4096]
    # range, range, then the second touch of block 2 fetches it whole, then L1
    assert [length for _, _, length in src.fetches] == [4096, 4096, -1]


async def test_random_reader_of_l2_blocks_reads_ranges_not_whole_blocks(nursery, tmp_path) -> None:
    """A block in L2 read at random twice stays a range read (one pread of the
    range each time), not a whole block pulled into L1 on the second touch."""
    src = InProcess()
    inode = src.new_file()
    data = random.randbytes(8 * BLOCK)
    writer = _writer(src, inode, nursery, limit=16 * BLOCK)
    await writer.write(0, data)
    await writer.flush()
    l2 = L2Cache.open(tmp_path, 8 * BLOCK, VOL, free_space_ratio=0.0, nursery=nursery)
    reader = Reader(CachedBlocks(src, l2), L1Cache(8 * BLOCK), nursery=nursery, readahead_max=BLOCK)
    (slice_,) = await src.read_chunk(inode.ino, 0)
    for index in (1, 6):  # into L2, as a fetch from the tier would put them
        await reader.source.fetch(BlockKey(slice_.id, index))
    while l2._queued:
        await trio.sleep(0.01)
    reader.l1.clear()
    src.fetches.clear()
    ra = reader.new_readahead()
    for off in (6 * BLOCK + 100, BLOCK + 5000, 6 * BLOCK + 100, BLOCK + 5000):  # not sequential
        assert await reader.read(inode, off, 4096, ra) == data[off : off + 4096]
    assert src.fetches == [] and len(reader.l1) == 0
    assert l2.stats["l2_hit_bytes"] == 4 * 4096  # ranges only, each from L2


def test_compaction_keeps_bytes_its_cached_size_does_not_know() -> None:
    """Issue 14, item 1: another client appended after this one's last commit,
    so this inode's cached size is short of the chunk's records. The
    compaction must still cover every record (the metanode checks the
    records and where they end), and the appended bytes read back."""
    from cachefs.client.compaction import Compactor
    from cachefs.rpc import RpcPool
    from cachefs.testing.metanode import local_metanode
    from tests.client.localfs import VOLUME

    parts = [random.randbytes(100) for _ in range(20)]
    tail = random.randbytes(4096)

    async def main() -> None:
        async with local_metanode() as metanode, RpcPool(secret=None) as pool:
            await metanode.create_volume(VOLUME, block_size=BLOCK)
            session = await metanode.session(pool, VOLUME)
            meta = session.meta
            async with trio.open_nursery() as n:
                a = Inode(await meta.mutate(C.Mknod(VOLUME, 1, b"f", 0o100644)))
                writer = _writer(session, a, n)  # type: ignore[arg-type]
                for i, part in enumerate(parts):
                    await writer.write(i * 100, part)
                    await writer.flush()
                b = Inode(await meta.query(Q.GetAttr(VOLUME, a.ino)))  # the other client
                await _writer(session, b, n).write(b.attr.size, tail)  # type: ignore[arg-type]
                await b.writer.flush()
                assert a.attr.size == 2000 < b.attr.size
                reader = Reader(session, L1Cache(3 * BLOCK), nursery=n, readahead_max=0)
                await Compactor(session, reader, nursery=n, threshold=16).compact(a, 0)
                assert len(await session.read_chunk(a.ino, 0)) == 1  # it did compact
                fresh = Inode(await meta.query(Q.GetAttr(VOLUME, a.ino)))
                got = await Reader(session, L1Cache(3 * BLOCK), nursery=n, readahead_max=0).read(
                    fresh, 0, 10_000, None
                )
                assert got == b"".join(parts) + tail
                n.cancel_scope.cancel()
            await session.close()
            metanode.check()

    trio.run(main)


def test_a_commit_during_a_lost_compaction_is_looked_at_again(monkeypatch) -> None:
    """A writer that keeps committing while the compactor works makes every
    attempt lose its race (ESTALE). The commits that came in meanwhile must
    not be swallowed: once the writer stops, the chunk ends as one slice.
    (The old compactor dropped them while it ran, so the writer's last burst
    left the chunk uncompacted for good.)"""
    from cachefs.client import compaction
    from cachefs.client.compaction import Compactor
    from cachefs.rpc import RpcPool
    from cachefs.testing.metanode import local_metanode
    from tests.client.localfs import VOLUME

    monkeypatch.setattr(compaction, "COMPACT_DELAY", 0.01)

    async def main() -> None:
        async with local_metanode() as metanode, RpcPool(secret=None) as pool:
            await metanode.create_volume(VOLUME, block_size=BLOCK)
            session = await metanode.session(pool, VOLUME)
            meta = session.meta
            async with trio.open_nursery() as n:
                a = Inode(await meta.mutate(C.Mknod(VOLUME, 1, b"f", 0o100644)))
                writer = _writer(session, a, n)  # type: ignore[arg-type]
                want = bytearray()
                compactor: Compactor

                async def commit_one() -> None:
                    piece = random.randbytes(100)
                    await writer.write(len(want), piece)
                    await writer.flush()
                    want.extend(piece)
                    compactor.schedule(a, 0, 0)  # what the writer's on_commit does

                class RacingReader(Reader):
                    races = compaction.ATTEMPTS  # a commit lands inside each attempt

                    async def read_slices(self, slices, length):  # type: ignore[no-untyped-def]
                        data = await super().read_slices(slices, length)
                        if RacingReader.races:
                            RacingReader.races -= 1
                            await commit_one()
                        return data

                reader = RacingReader(session, L1Cache(3 * BLOCK), nursery=n, readahead_max=0)
                compactor = Compactor(session, reader, nursery=n, threshold=4)
                for _ in range(5):
                    await commit_one()
                with trio.fail_after(10):
                    while RacingReader.races or len(await session.read_chunk(a.ino, 0)) > 1:
                        await trio.sleep(0.02)
                fresh = Inode(await meta.query(Q.GetAttr(VOLUME, a.ino)))
                got = await Reader(session, L1Cache(3 * BLOCK), nursery=n, readahead_max=0).read(
                    fresh, 0, len(want), None
                )
                assert got == bytes(want)
                n.cancel_scope.cancel()
            await session.close()
            metanode.check()

    trio.run(main)
