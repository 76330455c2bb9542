"""The read path below the kernel page cache: L1, readahead, block fetches.

Theory of operation
-------------------
A read asks the inode's chunk slice lists (cached per content version) which
segments make up the range (:mod:`cachefs.layout`), then serves each block piece:

1. from the L1 cache if the whole block is there;
2. for a *sequential* reader, by fetching whole blocks (one fetch per block
   however many readers want it, :mod:`cachefs.singleflight`) into L1, and starting
   background fetches of the next blocks within the readahead window; the
   window starts at one block and doubles on every sequential read up to
   ``readahead_max``, so a streaming reader has several blocks in flight;
3. for a *random* reader, by fetching exactly the byte range it needs, which
   is not cached (a 4 KiB read costs 4 KiB of transfer, not a block) -- unless
   the block was read at random before (second touch: a hot block), which is
   then fetched whole into L1 (unless it is in L2, where its ranges cost
   a local pread each).

Fetches go to the session's block chain (own zone's cache node, next zone's,
then backing storage; see :mod:`.session`). Everything runs as trio tasks on
the FUSE thread: on two cores, worker threads made pyfuse3 slower.

Bytes written but not yet committed are laid over the result, so a reader
sees its own writes before they are committed.

A read that one block serves whole (no pending writes over it) is answered
with a view of that block in L1, or with the buffer its range fetch
returned: no buffer of ours, no copy until the kernel's.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import trio

from cachefs.errors import CacheFSError, NotFound
from cachefs.ids import CHUNK_SIZE, BlockKey
from cachefs.layout import (
    HOLE,
    BlockPart,
    ChunkMap,
    Run,
    Slice,
    block_keys,
    chunk_ranges,
    overlay,
    resolve,
    segment_blocks,
)
from cachefs.singleflight import SingleFlight
from cachefs.tasks import Spawner, run_all

from .dirahead import DirReadahead
from .inodes import Inode
from .l1 import Block, L1Cache

log = logging.getLogger(__name__)

SEQ_SLACK = 256 * 1024
TOUCH_MEMORY = 8192
BATCH_KEYS = 64  # keys per batched prefetch (the cache node's get_many limit)
PREFETCH_PARALLEL = 8  # readahead block fetches in flight, for the whole mount
MAPS_KEPT = 1024  # resolved chunk maps kept, oldest out (64 GiB of chunks; up to ~10 KiB each for a list of 64 slices)


async def _run(jobs: list[Callable[[], Awaitable[None]]]) -> None:
    if len(jobs) == 1:
        await jobs[0]()  # the common case: no nursery
    elif jobs:
        await run_all(jobs)


class BlockSource(Protocol):
    block_size: int

    async def read_chunk(self, ino: int, chunk: int) -> list[Slice]: ...

    async def fetch(
        self, key: BlockKey, offset: int = 0, length: int = -1
    ) -> bytes | bytearray: ...


@dataclass(slots=True)
class Readahead:
    """Per open file: is this reader sequential, and how far ahead to fetch.

    A read that starts where the previous one ended (give or take the kernel's
    own reordering, ``SEQ_SLACK``) counts as sequential and doubles the window;
    any other read resets it to 0 (random: fetch only what is asked).

    Readahead is started only when the window's end passes into a block it
    has not asked for yet (``ahead``): a stream of 128 KiB reads starts one
    per block, not one per read (each walks the window's slice lists; py-spy
    on a client reading from L1: 47% of its CPU in readahead it had started already).
    """

    block_size: int
    max_window: int
    next_off: int = -1
    window: int = 0
    ahead: int = 0  # the blocks below this offset were asked for by readahead

    def on_read(self, offset: int, size: int) -> bool:
        sequential = self.next_off >= 0 and abs(offset - self.next_off) <= SEQ_SLACK
        if offset == 0 and self.next_off < 0:
            sequential = True  # reading from the start is the common streaming case
        if sequential:
            self.window = min(self.max_window, max(self.block_size, self.window * 2))
        else:
            self.window = self.ahead = 0
        self.next_off = offset + size
        return sequential

    def due(self, end: int, file_size: int) -> tuple[int, int] | None:
        """The range readahead should ask for after a read that ended at
        ``end``: from where it stopped to the window's end, or None when
        nothing is new (``file_size``: a file that grows past where readahead
        stopped gets its new blocks too)."""
        if not self.window:  # a random reader: no readahead
            return None
        bs = self.block_size
        target = min(-(-(end + self.window) // bs), -(-file_size // bs)) * bs
        start = max(self.ahead, end)
        if target <= start or start >= file_size:  # a read to the end of a file: nothing past it
            return None
        self.ahead = target
        return start, target


class Reader:
    """Serves reads of committed data; one per mount."""

    def __init__(
        self,
        source: BlockSource,
        l1: L1Cache,
        *,
        nursery: Spawner,
        readahead_max: int,
        max_parallel: int = PREFETCH_PARALLEL,
    ) -> None:
        self.source = source
        self.l1 = l1
        self.readahead_max = readahead_max
        self._nursery = nursery
        self._blocks: SingleFlight[BlockKey, Block] = SingleFlight()
        self._lists: SingleFlight[tuple[int, int, tuple[int, int]], list[Slice]] = SingleFlight()
        self._touched: OrderedDict[BlockKey, None] = OrderedDict()
        self._maps: OrderedDict[int, tuple[list[Slice], ChunkMap]] = OrderedDict()  # see _chunk_map
        self._prefetch_limit = trio.Semaphore(max_parallel)
        # Blocks prefetched and not read yet, for readahead efficiency
        # (prefetches_used / prefetches); bounded, oldest forgotten.
        self._prefetched: OrderedDict[BlockKey, None] = OrderedDict()
        # Readahead across a directory's small imported files (see dirahead.py);
        # set by the volume engine.
        self.dirahead: DirReadahead | None = None
        self._queued: set[BlockKey] = set()  # prefetch_block's, waiting for a prefetch slot
        # Whether a block is on local flash (L2; see _whole).
        self._local: Callable[[BlockKey], bool] = getattr(source, "holds", lambda key: False)
        self.stats = {
            "bytes": 0,
            "l1_hit_bytes": 0,
            "range_fetches": 0,
            "block_fetches": 0,
            "prefetches": 0,
            "prefetches_used": 0,  # prefetched blocks a read then found in L1 or joined in flight
            "slice_lists": 0,  # chunk slice lists asked of the metanodes
            "early_reads": 0,  # opens that started fetching ahead of their first read
            "batch_fetches": 0,  # prefetch_many's get_many batches
            "batch_blocks": 0,  # blocks they brought
        }

    def new_readahead(self) -> Readahead:
        return Readahead(self.source.block_size, self.readahead_max)

    async def slices(self, inode: Inode, chunk: int) -> list[Slice]:
        """A chunk's slice list, cached per content version; one fetch at a
        time per list (``open`` starts one that the first read then joins)."""
        stamp = (inode.attr.version, inode.layout)
        cached = inode.chunks.get(chunk)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        self.stats["slice_lists"] += 1
        slices = await self._lists.run(
            (inode.ino, chunk, stamp), functools.partial(self.source.read_chunk, inode.ino, chunk)
        )
        # The inode may have moved on while we waited; cache only if not.
        if (inode.attr.version, inode.layout) == stamp:
            inode.chunks[chunk] = (stamp, slices)
        return slices

    def holds(self, inode: Inode, length: int) -> bool:
        """Whether a read of ``[0, length)`` needs nothing fetched: chunk 0's
        slice list is cached at the inode's version and every block of the
        range is in L1 or on its way (no await: an ``open`` asks it before
        starting an early read that would find nothing to do)."""
        keys = self._first_keys(inode, length)
        return keys is not None and all(key in self.l1 or key in self._blocks for key in keys)

    def _first_keys(self, inode: Inode, length: int) -> list[BlockKey] | None:
        """The blocks of the file's ``[0, length)`` in chunk 0, or None when
        its slice list is not cached at the inode's version."""
        cached = inode.chunks.get(0)
        if cached is None or cached[0] != (inode.attr.version, inode.layout):
            return None
        return block_keys(cached[1], 0, min(length, inode.attr.size, CHUNK_SIZE), self.source.block_size)

    async def read(
        self, inode: Inode, offset: int, size: int, ra: Readahead | None = None
    ) -> bytes:
        data = await self.read_view(inode, offset, size, ra)
        return data if isinstance(data, bytes) else bytes(data)

    async def read_view(
        self, inode: Inode, offset: int, size: int, ra: Readahead | None = None
    ) -> bytes | bytearray | memoryview:
        """Like :meth:`read`, but may return a view of an L1 block or of a
        fetched range (read-only, valid as long as the caller holds it:
        blocks are immutable)."""
        end = min(offset + size, inode.size)
        if offset >= end:
            return b""
        sequential = ra.on_read(offset, end - offset) if ra is not None else False
        # Taken before the first await: a run that commits while we fetch is
        # then either in the slice lists we read or in this list (or both,
        # which is harmless), never in neither.
        pending = inode.writer.pending_runs() if inode.writer is not None else []
        if not pending:
            try:
                view = await self._one_block(inode, offset, end, sequential)
            except NotFound:  # see below: the path below reads the lists again
                view = None
            if view is not None:
                self.stats["bytes"] += len(view)
                if sequential and ra is not None:
                    self._ahead(inode, end, ra)
                return view
        buf = bytearray(end - offset)
        view = memoryview(buf)
        try:
            await self._fill(inode, offset, view, sequential, pending)
        except NotFound:
            # A slice list read before a compaction elsewhere may name blocks
            # the garbage collector has since deleted: read the lists again.
            inode.chunks.clear()
            inode.layout += 1
            view[:] = bytes(len(view))
            await self._fill(inode, offset, view, sequential, pending)
        if pending:
            overlay(pending, offset, view)
        self.stats["bytes"] += len(buf)
        if sequential and ra is not None:
            self._ahead(inode, end, ra)
        return buf

    def _ahead(self, inode: Inode, end: int, ra: Readahead) -> None:
        """Start readahead of the blocks that the window reaches from ``end``
        and no readahead asked for yet (a block whose prefetch failed or that
        L1 dropped unread is fetched by the read that needs it)."""
        due = ra.due(end, inode.attr.size)
        if due is not None:
            self._nursery.start_soon(self._readahead, inode, due[0], due[1] - due[0])

    async def _one_block(
        self, inode: Inode, offset: int, end: int, sequential: bool
    ) -> bytes | bytearray | memoryview | None:
        """``[offset, end)`` when one block holds all of it: a view of the block
        in L1, else what the fetch of that one part returns (no buffer of our
        own, no copy: a random 4 KiB read is served from the fetch's buffer)."""
        chunk, pos = divmod(offset, CHUNK_SIZE)
        if (end - 1) // CHUNK_SIZE != chunk:
            return None
        seg = self._chunk_map(await self.slices(inode, chunk)).covering(pos, pos + end - offset)
        if seg is None:
            return None  # a hole or a slice boundary inside: _fill's general path
        parts = segment_blocks(seg, self.source.block_size)
        if len(parts) != 1:
            return None
        part = parts[0]
        lo, hi = part.block_off, part.block_off + part.length
        block = self.l1.get(part.key)
        if block is not None and len(block) >= hi:
            self.stats["l1_hit_bytes"] += part.length
            if self._prefetched:
                self._used(part.key)
            return memoryview(block)[lo:hi]
        if self._whole(part.key, sequential):
            return memoryview(await self._read_block(part.key))[lo:hi]
        return await self._fetch_range(part)

    def _chunk_map(self, slices: list[Slice]) -> ChunkMap:
        """The resolved map of a cached slice list (lists are never changed in
        place: a new version is a new list, and the entry keeps its list
        alive, so an id is not reused while its entry lasts)."""
        known = self._maps.get(id(slices))
        if known is not None and known[0] is slices:
            return known[1]
        chunk_map = ChunkMap(slices)
        self._maps[id(slices)] = (slices, chunk_map)
        if len(self._maps) > MAPS_KEPT:
            self._maps.popitem(last=False)
        return chunk_map

    async def _fill(
        self, inode: Inode, offset: int, view: memoryview, sequential: bool, pending: list[Run]
    ) -> None:
        """Committed bytes of ``[offset, offset+len(view))`` into ``view`` (holes stay zero).

        Parts that one pending run covers entirely are skipped: the overlay
        replaces them anyway (a file being rewritten in place reads from memory).
        """
        jobs: list[Callable[[], Awaitable[None]]] = []
        for chunk, pos, buf_off, n in chunk_ranges(offset, len(view)):
            covers = [(r.pos, r.end) for r in pending if r.chunk == chunk]
            slices = await self.slices(inode, chunk)
            dest = view[buf_off : buf_off + n]
            self._plan(slices, pos, dest, jobs, sequential=sequential, covers=covers)
        await _run(jobs)

    async def read_slices(self, slices: list[Slice], length: int) -> bytearray:
        """Bytes ``[0, length)`` of a chunk whose slice list is ``slices``
        (holes zero): exactly those slices, whatever the inode's cached lists
        or pending writes say, which is what compaction rewrites. Parts in L1
        are copied from there; the others are range fetches that stay out of
        L1 (their blocks are about to be replaced)."""
        buf = bytearray(length)
        jobs: list[Callable[[], Awaitable[None]]] = []
        self._plan(slices, 0, memoryview(buf), jobs, cache=False)
        await _run(jobs)
        return buf

    def _plan(
        self,
        slices: list[Slice],
        pos: int,
        dest: memoryview,
        jobs: list[Callable[[], Awaitable[None]]],
        *,
        sequential: bool = False,
        cache: bool = True,
        covers: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Fill ``dest`` with bytes ``[pos, pos+len(dest))`` of a chunk made of
        ``slices``: copy what L1 holds now, and add a fetch to ``jobs`` for each
        other part. Parts that one of ``covers`` spans are skipped; without
        ``cache``, no block is fetched whole into L1."""
        for seg in resolve(slices, pos, pos + len(dest)):
            if seg.slice_id == HOLE:
                continue
            for part in segment_blocks(seg, self.source.block_size):
                if any(a <= part.pos and part.pos + part.length <= b for a, b in covers):
                    continue
                into = dest[part.pos - pos : part.pos - pos + part.length]
                if not self._copy_from_l1(part, into):
                    whole = cache and self._whole(part.key, sequential)
                    jobs.append(self._job(part, into, whole=whole))

    def _whole(self, key: BlockKey, sequential: bool) -> bool:
        """Whether a read of part of ``key`` fetches the whole block into L1:
        for a sequential reader, or a block read at random before -- unless
        it is in L2, where a range costs one local pread and the whole block
        would cost the disk a whole block for each range asked."""
        return sequential or (not self._local(key) and self._seen_before(key))

    def _seen_before(self, key: BlockKey) -> bool:
        """Second-touch admission for random readers: the first random read of
        a block fetches only its range; a block read at random again (a hot
        file, a small dataset read in shuffled order) is fetched whole into L1.
        A random reader of a large cold dataset so never pays for whole blocks."""
        if key in self._touched:
            del self._touched[key]
            return True
        self._touched[key] = None
        if len(self._touched) > TOUCH_MEMORY:
            self._touched.popitem(last=False)
        return False

    def _copy_from_l1(self, part: BlockPart, dest: memoryview) -> bool:
        block = self.l1.get(part.key)
        if block is None or len(block) < part.block_off + part.length:
            return False
        dest[:] = memoryview(block)[part.block_off : part.block_off + part.length]
        self.stats["l1_hit_bytes"] += part.length
        if self._prefetched:
            self._used(part.key)
        return True

    def _used(self, key: BlockKey) -> None:
        if key in self._prefetched:
            del self._prefetched[key]
            self.stats["prefetches_used"] += 1
            if self.dirahead is not None:
                self.dirahead.used(key)

    def used_ahead(self, inode: Inode) -> None:
        """An open kept pages pushed from blocks fetched ahead (pagepush.py):
        they count as used, as a read of them from L1 would."""
        if self._prefetched:
            for key in self._first_keys(inode, inode.attr.size) or ():
                self._used(key)

    def l1_room(self) -> int:
        """Bytes L1 can take before it evicts anything."""
        return max(0, self.l1.capacity - self.l1.used)

    def has_or_fetching(self, key: BlockKey) -> bool:
        """Whether ``key`` is in L1, or a whole-block fetch of it is under way
        or waiting for a prefetch slot (:meth:`prefetch_block`)."""
        return key in self.l1 or key in self._blocks or key in self._queued

    def prefetch_many(self, keys: list[BlockKey]) -> None:
        """:meth:`prefetch_block` for many keys: those the source can batch
        (its ``owner``: the cache node it would ask first; not one in L2)
        are fetched in one ``get_many`` per node and group of up to
        ``BATCH_KEYS``, each batch under one of the mount's prefetch slots;
        the rest, and what a batch did not bring, one at a time."""
        owner = getattr(self.source, "owner", None)
        groups: dict[str, list[BlockKey]] = {}
        for key in keys:
            if self.has_or_fetching(key):
                continue
            addr = owner(key) if owner is not None else None
            if addr is None:
                self.prefetch_block(key)
                continue
            group = groups.setdefault(addr, [])
            group.append(key)
            self._queued.add(key)
            if len(group) == BATCH_KEYS:
                self._nursery.start_soon(self._prefetch_batch, addr, groups.pop(addr))
        for addr, group in groups.items():
            if len(group) == 1:  # a batch of one costs a get's round trip and more
                self._queued.discard(group[0])
                self.prefetch_block(group[0])
            else:
                self._nursery.start_soon(self._prefetch_batch, addr, group)

    async def _prefetch_batch(self, addr: str, keys: list[BlockKey]) -> None:
        try:
            async with self._prefetch_limit:
                self._queued.difference_update(keys)  # in _blocks from here on (or in L1 already)
                keys = [k for k in keys if k not in self.l1 and k not in self._blocks]
                for key in keys:  # marked before the fetch: a read that joins it in flight uses it
                    self._prefetched[key] = None
                self.stats["prefetches"] += len(keys)
                while len(self._prefetched) > TOUCH_MEMORY:
                    self._prefetched.popitem(last=False)
                try:
                    got = await self._blocks.run_many(keys, functools.partial(self._fetch_many, addr))
                except CacheFSError as exc:
                    log.debug("batched prefetch from %s failed: %s", addr, exc)
                    got = {}
        finally:
            self._queued.difference_update(keys)
        for key in keys:
            if key not in got:  # a miss there (or the node failed): the single path, which reads through
                self._prefetched.pop(key, None)
                self.stats["prefetches"] -= 1
                self.prefetch_block(key)

    async def _fetch_many(self, addr: str, keys: list[BlockKey]) -> dict[BlockKey, bytes]:
        self.stats["batch_fetches"] += 1
        got = await self.source.fetch_many(addr, keys)
        self.stats["batch_blocks"] += len(got)
        for key, data in got.items():
            self.l1.put(key, data)
        if self.dirahead is not None:
            for key in got:  # all in L1 first: a file of several blocks is then whole
                self.dirahead.landed(key)
        return got

    def prefetch_block(self, key: BlockKey) -> None:
        """Fetch block ``key`` whole into L1 in the background, under the
        mount's prefetch limit (errors are left to a read that needs it)."""
        if key not in self._queued:
            self._queued.add(key)
            self._nursery.start_soon(self._prefetch_queued, key)

    async def _prefetch_queued(self, key: BlockKey) -> None:
        try:
            await self._prefetch(key, self._queued)
        finally:
            self._queued.discard(key)

    def _job(
        self, part: BlockPart, dest: memoryview, *, whole: bool
    ) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            if whole:
                block = await self._read_block(part.key)
                dest[:] = memoryview(block)[part.block_off : part.block_off + part.length]
            else:
                dest[:] = await self._fetch_range(part)

        return run

    async def _fetch_range(self, part: BlockPart) -> bytes | bytearray | memoryview:
        self.stats["range_fetches"] += 1
        data = await self.source.fetch(part.key, part.block_off, part.length)
        if len(data) != part.length:
            raise CacheFSError(
                f"block {part.key.hex()} returned {len(data)} bytes, wanted {part.length}"
            )
        return data

    async def block(self, key: BlockKey) -> Block:
        """A whole block, from L1 or fetched once however many tasks ask."""
        data = self.l1.get(key)
        if data is not None:
            return data
        return await self._blocks.run(key, functools.partial(self._fetch_block, key))

    async def _read_block(self, key: BlockKey) -> Block:
        """:meth:`block` for a read: a prefetch of the block that the read
        joined in flight was used too (it started the fetch earlier)."""
        block = await self.block(key)
        if self._prefetched:
            self._used(key)
        return block

    async def _fetch_block(self, key: BlockKey) -> Block:
        self.stats["block_fetches"] += 1
        data = await self.source.fetch(key, 0, -1)
        self.l1.put(key, data)  # the received buffer itself: nobody else holds it
        if self.dirahead is not None:
            self.dirahead.landed(key)
        return data

    async def prefetch(self, inode: Inode, offset: int, length: int) -> None:
        """Fetch the blocks of ``[offset, offset+length)`` into L1 (errors are
        left to the read that needs them)."""
        await self._readahead(inode, offset, length)

    async def _readahead(self, inode: Inode, offset: int, window: int) -> None:
        """Fetch the blocks of ``[offset, offset+window)`` into L1 in parallel."""
        end = min(offset + window, inode.attr.size)
        keys: list[BlockKey] = []
        try:
            for chunk, pos, _buf_off, n in chunk_ranges(offset, max(0, end - offset), CHUNK_SIZE):
                for seg in resolve(await self.slices(inode, chunk), pos, pos + n):
                    if seg.slice_id == HOLE:
                        continue
                    for part in segment_blocks(seg, self.source.block_size):
                        if (
                            part.key not in self.l1
                            and part.key not in self._blocks
                            and part.key not in keys
                        ):
                            keys.append(part.key)
        except CacheFSError as exc:
            log.debug("readahead of inode %d stopped: %s", inode.ino, exc)
            return
        async with trio.open_nursery() as n:
            for key in keys:
                n.start_soon(self._prefetch, key)

    async def _prefetch(self, key: BlockKey, queued: set[BlockKey] | None = None) -> None:
        async with self._prefetch_limit:
            if queued is not None:
                queued.discard(key)  # in _blocks from here on (or in L1 already)
            if key in self.l1 or key in self._blocks:
                return
            self.stats["prefetches"] += 1
            # Marked before the fetch: a read that joins it in flight uses it.
            self._prefetched[key] = None
            if len(self._prefetched) > TOUCH_MEMORY:
                self._prefetched.popitem(last=False)
            try:
                await self.block(key)
            except CacheFSError as exc:
                # The reader that needs it will fetch again and see the error.
                log.debug("prefetch of %s failed: %s", key.hex(), exc)
                self._prefetched.pop(key, None)
