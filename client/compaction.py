"""Compaction: a chunk that collected many slices is rewritten as one.

Every committed run is a slice, so small random writes leave a chunk with
many slices, which every later read of it must resolve. After each commit the
writer tells the :class:`Compactor`, which lets the burst of writes finish
(``COMPACT_DELAY``; compacting under a writer only loses the race after
reading the whole chunk), reads the chunk's slice list and, past
``threshold`` slices:

1. reads the bytes those slices make up through the Reader (L1 where it has
   them, range fetches otherwise);
2. stores them as the blocks of one new slice;
3. asks the metanodes to swap the new slice in only if the chunk is still
   exactly the list it read (``CompactChunk``). If it changed, the answer is
   ESTALE (``Stale``, which the metadata client does not retry, unlike an
   overloaded node's EBUSY), the new slice goes to the trash and nothing is lost; the compactor
   tries again on the new list, a few times, since a writer still committing
   would otherwise leave the chunk uncompacted once it stops.

Memory: one chunk's bytes at a time for the whole mount (a chunk is up to
64 MiB, and a burst of small writes to many files would otherwise read as
many chunks at once), and its blocks upload under the writers' upload
limit, so a compaction holds at most a chunk and the uploads the writers
may hold anyway (docs/deploy.md, "Memory of a mount").

One compaction at a time per chunk. A commit that arrives while one runs is
remembered, and the chunk is looked at again once it ends, so the writer's
last commit is never swallowed by a compaction that lost its race to it. A
failed one is logged and skipped: the next commit to the chunk schedules
another.
"""

from __future__ import annotations

import functools
import logging
import time

import trio

from cachefs import commands as C
from cachefs.errors import CacheFSError, SliceExpired, Stale
from cachefs.ids import BlockKey
from cachefs.layout import HOLE, Slice, resolve, slice_blocks
from cachefs.tasks import Spawner, run_all

from .inodes import Inode
from .reader import Reader
from .session import Session

log = logging.getLogger(__name__)

COMPACT_DELAY = 0.5
ATTEMPTS = 3


class Compactor:
    """Background compaction of one volume's chunks (see module docstring)."""

    def __init__(
        self, session: Session, reader: Reader, *, nursery: Spawner, threshold: int,
        upload_limit: trio.Semaphore | None = None,
    ) -> None:
        self.session = session
        self.reader = reader
        self.threshold = threshold
        self._nursery = nursery
        self._upload_limit = upload_limit if upload_limit is not None else trio.Semaphore(8)
        self._chunk_memory = trio.Lock()  # one chunk's bytes in memory at a time
        self._running: set[tuple[int, int]] = set()
        self._again: set[tuple[int, int]] = set()  # committed to while a compaction of it ran

    def schedule(self, inode: Inode, chunk: int, version: int) -> None:
        """A commit to ``chunk`` of ``inode`` (the writer's ``on_commit``). A
        file created here and leased since has no more slices in the chunk
        than our commits to it (``Inode.born``): below the threshold there
        is nothing to look at, and no slice list is read. Skipping is always
        safe: a compaction swaps only the exact list it read."""
        if inode.born is not None:
            leases = self.session.leases
            if leases is not None and leases.get(inode.ino, time.monotonic()) is inode.born:
                inode.commits[chunk] = inode.commits.get(chunk, 0) + 1
                if inode.commits[chunk] < self.threshold:
                    return
            else:
                inode.born = None  # the lease went: others may have written the file
        key = (inode.ino, chunk)
        if key in self._running:
            self._again.add(key)
        else:
            self._running.add(key)
            self._nursery.start_soon(self._later, inode, chunk)

    async def _later(self, inode: Inode, chunk: int) -> None:
        key = (inode.ino, chunk)
        try:
            while True:
                self._again.discard(key)
                await trio.sleep(COMPACT_DELAY)
                if inode.writer is not None and inode.writer.dirty:
                    return  # the dirty bytes' own commit schedules the next look
                await self.compact(inode, chunk)
                if key not in self._again:
                    return
        except CacheFSError as exc:
            log.info("compaction of inode %d chunk %d skipped: %s", inode.ino, chunk, exc)
        finally:
            self._running.discard(key)
            self._again.discard(key)

    async def compact(self, inode: Inode, chunk: int) -> None:
        """Rewrite ``chunk`` as one slice if it has ``threshold`` slices or more.

        Raises:
            CacheFSError: reading, storing or swapping failed (nothing is lost).
        """
        for _attempt in range(ATTEMPTS):
            async with self._chunk_memory:
                if await self._once(inode, chunk):
                    return

    async def _once(self, inode: Inode, chunk: int) -> bool:
        """One attempt; False when the chunk changed under it."""
        session = self.session
        slices = await session.read_chunk(inode.ino, chunk)
        if len(slices) < self.threshold:
            return True
        # The records end where the chunk's bytes end (a truncate cuts them):
        # not the cached size, which may be older than the list just read.
        length = max(s.pos + s.length for s in slices)
        if 2 * _stored(slices, length) < length:
            return True  # mostly holes: one slice would store them as zeros
        view = memoryview(await self.reader.read_slices(slices, length))
        slice_id = await session.alloc_slice()
        short: list[int] = []

        async def store(index: int, data: memoryview) -> None:
            async with self._upload_limit:
                if await session.store_block(BlockKey(slice_id, index), data):
                    short.append(index)

        await run_all(
            functools.partial(store, index, view[start:end])
            for index, start, end in slice_blocks(length, session.block_size)
        )
        try:
            expect = tuple(f for s in slices for f in (s.id, s.pos, s.length, s.offset))
            swap = C.CompactChunk(session.volume, inode.ino, chunk, expect, slice_id, length,
                                  tuple(sorted(short)))
            await session.mutate(swap)
        except Stale:  # the metadata client never retries it: the answer stands
            log.info("chunk %d of inode %d changed while compacting", chunk, inode.ino)
            return False
        except SliceExpired:  # held longer than the collector's grace; its blocks are garbage
            session.drop_slice_ids()
            log.info("compaction of chunk %d of inode %d took too long; its slice was sealed", chunk, inode.ino)
            return False
        inode.chunks.pop(chunk, None)
        inode.layout += 1
        log.info("compacted chunk %d of inode %d: %d slices -> 1", chunk, inode.ino, len(slices))
        return True


def _stored(slices: list[Slice], length: int) -> int:
    """Bytes of ``[0, length)`` the slices hold (not holes)."""
    return sum(seg.length for seg in resolve(slices, 0, length) if seg.slice_id != HOLE)
