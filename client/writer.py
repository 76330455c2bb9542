"""The write path: a bounded buffer per file, slices, blocks, commit.

Theory of operation
-------------------
Each inode being written has one :class:`FileWriter` (shared by its handles).
Writes go into a :class:`~cachefs.layout.WritePlan`, which merges them into runs;
a sealed run becomes one slice:

    sealed run --alloc id--> blocks put to backing storage (in parallel)
               --wait for the previous run's commit--> write_slice --> done

Blocks of many runs upload at once, but commits happen strictly in seal order,
because commit order decides which bytes win where slices overlap. A run's
bytes count against ``buffer_limit`` from the write that created them until
their commit; a write that would pass the limit waits (backpressure) while
earlier runs drain. Every file of a client also shares one
:class:`WriteBudget`: a write that would take the client's uncommitted bytes
past its limit waits the same way, so many files written at once hold at
most that much memory, not ``buffer_limit`` each. ``flush()`` (close, fsync) seals the open run and returns
only after every run is committed, or raises the first upload error: the
data is then lost. The caller answers with that error's errno when it is one
an application can act on (EDQUOT, ENOSPC, EFBIG, EROFS), else EIO; so does
every later write of the file, which is how a write learns that the commit
of a full buffer failed.

A commit can find its slice sealed (``SliceExpired``: the id was held
longer than the collector's grace, say behind a metanode outage, and its
blocks may be collected); the run is then stored again under a new id.

Each run becomes a new slice, so a small random write stores a small slice
and never rewrites a whole block. When a chunk's slice list grows past
``compact_after`` the writer schedules a compaction (:class:`~.compaction.Compactor`):
read the chunk, write it as one slice, and ask the metanodes to swap it in
only if the chunk is still exactly what was read.

Optionally (write-through) each stored block is also put into the cache tier,
best effort, so data written now (a checkpoint) is read fast later.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import trio

from cachefs.errors import (
    CacheFSError,
    FileTooLarge,
    IOFailure,
    NoSpace,
    QuotaExceeded,
    ReadOnly,
    SliceExpired,
)
from cachefs.ids import CHUNK_SIZE, BlockKey
from cachefs.layout import MAX_FILE_SIZE, Run, Slice, WritePlan, runs_end, slice_blocks
from cachefs.messages import Attr
from cachefs.opstats import OpStats
from cachefs.tasks import Spawner, run_all

from .inodes import Inode

log = logging.getLogger(__name__)
SLICE_ATTEMPTS = 3  # stores of one run under fresh slice ids when a commit finds its slice sealed

# Failures an application can act on keep their errno up to the kernel (a
# full volume, a quota, a size limit); any other failure of a commit is EIO.
_CARRIED: tuple[type[CacheFSError], ...] = (QuotaExceeded, NoSpace, FileTooLarge, ReadOnly)


class BlockSink(Protocol):
    block_size: int

    async def alloc_slice(self) -> int: ...

    async def store_block(self, key: BlockKey, data: bytes | memoryview) -> bool:
        """True when the block was stored short (some shards left for repair)."""
        ...

    async def write_through(self, key: BlockKey, data: bytes | memoryview) -> None: ...

    async def write_slice(
        self, ino: int, chunk: int, slice_id: int, pos: int, length: int, offset: int, mtime_ns: int,
        short: tuple[int, ...] = (),
    ) -> Attr: ...


class WriteBudget:
    """Uncommitted bytes of every file of one client, and their bound.

    Its condition is every writer's: a commit of any file wakes the writes
    waiting for room. ``waiting`` counts writes held back by this bound (not
    their own file's), so that the client seals the open extents of the
    other files at once instead of after their idle time.
    """

    def __init__(self, limit: float = float("inf")) -> None:
        self.limit = limit
        self.used = 0
        self.waiting = 0
        self.changed = trio.Condition()

    def full(self, size: int) -> bool:
        return bool(self.used) and self.used + size > self.limit


class _Pending:
    """One sealed run on its way to being committed."""

    __slots__ = ("committed", "order", "run")

    def __init__(self, run: Run, order: int) -> None:
        self.run = run
        self.order = order  # seal order: the order in which runs win
        self.committed = trio.Event()


class WriteStats:
    """Mount-wide write counters, shared by every :class:`FileWriter` (a file's
    writer goes away after its last close; the mount's totals stay). Plain ints
    and the trio thread only, as in :mod:`cachefs.opstats`; ``commits`` times each
    ``write_slice`` call (one per slice, up to 64 MiB: nothing per byte)."""

    __slots__ = ("written", "slices", "bytes", "blocks", "commits")

    def __init__(self) -> None:
        self.written = 0  # bytes applications wrote
        self.slices = 0
        self.bytes = 0  # bytes committed (rewrites of one range count each time)
        self.blocks = 0  # blocks stored on backing storage
        self.commits = OpStats()  # "commit": latency of the metanode commit


class FileWriter:
    def __init__(
        self,
        sink: BlockSink,
        inode: Inode,
        *,
        nursery: Spawner,
        buffer_limit: int,
        upload_limit: trio.Semaphore,
        budget: WriteBudget | None = None,
        write_through: bool = False,
        on_commit: Callable[[Inode, int, int], None] | None = None,
        stats: WriteStats | None = None,
    ) -> None:
        self.sink = sink
        self.inode = inode
        self.buffer_limit = buffer_limit
        self.write_through = write_through
        self.on_commit = on_commit
        max_run = max(
            sink.block_size, min(CHUNK_SIZE, buffer_limit // 4 // sink.block_size * sink.block_size)
        )
        self.plan = WritePlan(max_run, open_limit=buffer_limit // 2)
        self._nursery = nursery
        self._upload_limit = upload_limit
        self._queue: deque[_Pending] = deque()
        self._last: _Pending | None = None
        self._sealed = 0
        # Runs whose commit failed (seal order, run): kept for a spill at
        # unmount. Bounded: after the first failure the file takes no writes.
        self.lost: list[tuple[int, Run]] = []
        self.spilled = False  # abandoned at unmount, its bytes spilled
        self.budget = budget if budget is not None else WriteBudget()
        self._changed = self.budget.changed
        self.error: CacheFSError | None = None
        self.buffered = 0  # bytes written and not yet committed
        self.last_write = 0.0
        self.stats = stats if stats is not None else WriteStats()

    @property
    def dirty(self) -> bool:
        return self.buffered > 0

    def pending_runs(self) -> list[Run]:
        """Uncommitted runs, oldest first (the order in which they win)."""
        # Open extents are disjoint and newer than every queued run.
        return [p.run for p in self._queue] + self.plan.extents

    def unsaved(self) -> list[Run]:
        """Every run written and not committed, failed ones included, oldest
        first: what a spill keeps (see :mod:`.spill`)."""
        return [run for _, run in sorted(self.lost, key=lambda lost: lost[0])] + self.pending_runs()

    async def abandon(self, reason: str) -> None:
        """Give up on every uncommitted run (the unmount's deadline passed,
        their bytes are spilled): the file fails with ``reason``, so whoever
        waits in :meth:`flush` or :meth:`write` returns with that error
        instead of waiting for uploads the unmount is about to cancel. A
        commit already in flight may still land."""
        if self.error is None:
            self.error = IOFailure(reason)
        self.spilled = True
        for pending in self._queue:
            pending.committed.set()
        async with self._changed:
            self._changed.notify_all()

    def pending_end(self) -> int:
        return runs_end(self.pending_runs())

    async def write(self, offset: int, data: bytes) -> None:
        """Buffer one write; waits while the buffer is full.

        Raises:
            FileTooLarge: the write ends past the largest file.
            IOFailure: an earlier upload of this file failed (or the class of
                that failure, when it is one of ``_CARRIED``).
        """
        if offset + len(data) > MAX_FILE_SIZE:
            raise FileTooLarge(f"a write up to {offset + len(data)} is past the largest file")
        self._check()
        size, budget = len(data), self.budget
        async with self._changed:
            while (self.buffered and self.buffered + size > self.buffer_limit) or budget.full(size):
                if self.plan.extents and not self._queue:
                    self._submit(self.plan.seal_oldest())
                shared = not (self.buffered and self.buffered + size > self.buffer_limit)
                budget.waiting += shared
                try:
                    await self._changed.wait()
                finally:
                    budget.waiting -= shared
                self._check()
        self.last_write = trio.current_time()
        # No await from here on: the plan and the byte count change together.
        old_open = self.plan.open_bytes
        sealed = self.plan.add(offset, data)
        grown = sum(len(r.data) for r in sealed) + self.plan.open_bytes - old_open
        self.buffered += grown
        budget.used += grown
        self.stats.written += len(data)
        self._submit(sealed)

    def _check(self) -> None:
        error = self.error
        if error is not None:
            cls = type(error) if isinstance(error, _CARRIED) else IOFailure
            raise cls(f"an earlier write of inode {self.inode.ino} failed: {error.message}")

    def _submit(self, runs: list[Run]) -> None:
        for run in runs:
            self._sealed += 1
            pending = _Pending(run, self._sealed)
            previous, self._last = self._last, pending
            self._queue.append(pending)
            self._nursery.start_soon(self._upload, pending, previous)

    def seal_idle(self, idle: float) -> None:
        """Start uploading extents nobody wrote to for ``idle`` seconds, so
        data in a file left open does not wait for its close."""
        if self.plan.extents and trio.current_time() - self.last_write >= idle:
            self._submit(self.plan.seal())

    async def flush(self) -> None:
        """Commit everything written so far; returns after the last commit.

        Raises:
            IOFailure: some run could not be stored or committed (or the
                class of that failure, when it is one of ``_CARRIED``).
        """
        self._submit(self.plan.seal())
        last = self._last
        if last is not None:
            await last.committed.wait()
        self._check()

    async def _upload(self, pending: _Pending, previous: _Pending | None) -> None:
        run = pending.run
        committed = False
        try:
            # The run's own buffer: a sealed run is never written again, so
            # its blocks are stored from it without a copy of the whole run
            # (each block is copied once more, for its shards, while it uploads).
            view = memoryview(run.data)
            for attempt in range(1, SLICE_ATTEMPTS + 1):
                if self.error is not None:
                    break
                slice_id = await self.sink.alloc_slice()
                short: list[int] = []  # blocks stored short: the commit queues them for repair
                await run_all(
                    functools.partial(self._store, BlockKey(slice_id, index), view[start:end], short)
                    for index, start, end in slice_blocks(len(view), self.sink.block_size)
                )
                if previous is not None:
                    await previous.committed.wait()
                if self.error is not None:
                    break
                started = time.monotonic()
                try:
                    attr = await self.sink.write_slice(
                        self.inode.ino, run.chunk, slice_id, run.pos, len(view), 0, time.time_ns(),
                        tuple(sorted(short)),
                    )
                except SliceExpired:
                    if attempt == SLICE_ATTEMPTS:
                        raise
                    log.info("slice %d of inode %d was sealed before its commit; storing it again",
                             slice_id, self.inode.ino)
                    continue
                self.stats.commits.observe("commit", time.monotonic() - started)
                self._committed(run, attr, slice_id)
                committed = True
                break
        except CacheFSError as exc:
            # Over quota, out of space, past the largest file, read-only: the
            # application is told (its errno) and nothing is wrong here.
            log.log(
                logging.INFO if isinstance(exc, _CARRIED) else logging.ERROR,
                "write of inode %d (chunk %d, %d bytes) failed: %s",
                self.inode.ino,
                run.chunk,
                len(run.data),
                exc,
            )
            if self.error is None:
                self.error = exc
        except Exception as exc:
            # A bug, not a failure of the cluster: the run is lost all the
            # same, so the file is failed (the task boundary logs the rest).
            if self.error is None:
                leaf: BaseException = exc
                while isinstance(leaf, BaseExceptionGroup) and leaf.exceptions:
                    leaf = leaf.exceptions[0]
                self.error = IOFailure(f"unexpected {type(leaf).__name__}: {leaf}")
            raise
        finally:
            if not committed:
                self.lost.append((pending.order, run))
            self._queue.remove(pending)
            self.buffered -= len(run.data)
            self.budget.used -= len(run.data)
            pending.committed.set()
            async with self._changed:
                self._changed.notify_all()

    async def _store(self, key: BlockKey, data: memoryview, short: list[int]) -> None:
        async with self._upload_limit:
            if await self.sink.store_block(key, data):
                short.append(key.index)
            self.stats.blocks += 1
            if self.write_through:
                await self.sink.write_through(key, data)

    def _committed(self, run: Run, attr: Attr, slice_id: int) -> None:
        """Take the committed attributes; no await here, so readers never see
        the run neither pending nor in the (dropped) slice cache."""
        inode = self.inode
        # Only our commit moved the version (each content change moves it by one).
        alone = attr.version == inode.attr.version + 1
        # Our own write changed the content: the kernel's pages hold it already.
        ours = alone and inode.cached_version == inode.attr.version
        # The chunk's list as of the version before, then this slice over it,
        # is its list now: a read back asks no read_chunk (a new file's lists
        # start empty, see CacheFS.create).
        known = inode.chunks.get(run.chunk)
        if known is not None and not (alone and known[0] == (inode.attr.version, inode.layout)):
            known = None
        inode.chunks.pop(run.chunk, None)
        inode.layout += 1
        inode.set_attr(attr)
        if known is not None:  # what the metanode's list is now: the slices this one covers whole go
            lo, hi = run.pos, run.pos + len(run.data)
            slices = [s for s in known[1] if not lo <= s.pos <= s.pos + s.length <= hi]
            slices.append(Slice(slice_id, run.pos, len(run.data)))
            inode.chunks[run.chunk] = ((attr.version, inode.layout), slices)
        inode.cached_version = attr.version if ours else None
        self.stats.slices += 1
        self.stats.bytes += len(run.data)
        if self.on_commit is not None:
            self.on_commit(inode, run.chunk, attr.version)
