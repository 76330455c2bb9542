"""The client engine of one volume, under both front ends (FUSE and the native API).

Whichever way a volume is reached, a client needs the same machinery; this is
the one place it is put together:

- the :class:`~.session.Session` (metadata calls, the block chain) and its
  upkeep task;
- ``nursery``: where every background task of the engine starts (uploads,
  compactions, readahead, upkeep, the front ends' own), a
  :class:`~cachefs.tasks.TaskGuard` over the caller's nursery, so that an
  unexpected exception in one of them is logged and counted and the mount
  (which runs its FUSE loop in that same nursery) keeps serving;
- the inode table (:mod:`.inodes`): the FUSE front end counts the kernel's
  lookups there, the native API keeps an inode there only while a file of it
  is open (or being read); an inode that leaves keeps its slice lists for its
  next open;
- the L1 cache and the :class:`~.reader.Reader`; blocks this client stores go
  into L1 too, at its cold end;
- one :class:`~.writer.FileWriter` per inode being written, all under one
  upload limit and one write budget (``write_buffer_total`` uncommitted
  bytes across files, besides ``write_buffer`` per file); every commit may schedule a compaction
  (:class:`~.compaction.Compactor`); writes left idle in an open file are
  sealed and uploaded after ``FLUSH_IDLE`` seconds, not at its close;
- open, release and truncation of inodes.

The front ends keep only what is theirs: handles, lookup counts, errno
mapping and kernel cache invalidation (:mod:`.fs`); paths, file objects and
``OSError`` (:mod:`.api`).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.buffers import BufferPool
from cachefs.errors import CacheFSError
from cachefs.ids import BlockKey
from cachefs.layout import Run
from cachefs.messages import Attr
from cachefs.tasks import TaskGuard

from .compaction import Compactor
from .dirahead import PER_MISS, DirReadahead
from .inodes import GHOSTS, Inode, InodeTable
from .l1 import L1Cache
from .l2 import CachedBlocks, L2Cache
from .reader import Reader
from .seek import seek_offset
from .session import Session
from .spill import DEFAULT_SPILL_DIR, spill
from .writer import FileWriter, WriteBudget, WriteStats

log = logging.getLogger(__name__)

FLUSH_IDLE = 5.0  # seconds without a write before an open file's extents are uploaded
MAX_BACKGROUND = 64  # FUSE background requests in flight (async/direct I/O); see mount.py
FUSE_WORKERS = 99  # pyfuse3's own cap; each worker keeps a 1 MiB receive buffer (see memory.py)


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """Tunables of one client of a volume: ``cachefs mount``'s options, or
    the keyword arguments of :func:`cachefs.client.api.connect`.

    The defaults are a library client's. The mount's ``--l1-size`` defaults
    to 512M instead: one mount serves every process of a node, while a
    training job often runs one library client per DataLoader worker.
    """

    l1_bytes: int = 256 << 20
    readahead_max: int = 32 << 20
    dir_readahead: int = PER_MISS  # small files of a directory fetched ahead per miss (0: off)
    push_pages: bool = True  # mount only: files fetched ahead go into the kernel's page cache (pagepush.py)
    write_buffer: int = 64 << 20  # per file being written
    write_buffer_total: int = 256 << 20  # every file being written, together
    write_through: bool = False  # also put written blocks into the cache tier
    upload_parallel: int = 8  # block uploads in flight
    compact_after: int = 64  # slices in a chunk before it is rewritten as one
    transport: str = "tcp"  # to the cache nodes: tcp, rdma or auto
    read_only: bool = False
    entry_timeout: float = 1.0  # how long a resolved name is trusted
    attr_timeout: float = 1.0  # mount only: the kernel's attribute cache
    max_background: int = MAX_BACKGROUND  # mount only: FUSE background requests
    fuse_workers: int = FUSE_WORKERS  # mount only: pyfuse3 worker tasks (requests served at once)
    cache_dir: str = ""  # L2 on local flash ("": none)
    cache_size: int = 10 << 30  # L2 capacity in bytes
    free_space_ratio: float = 0.1  # L2 keeps this share of its filesystem free
    unmount_timeout: float = 60.0  # mount only: commit time at unmount, then spill
    spill_dir: str = DEFAULT_SPILL_DIR  # mount only: where uncommittable data goes


class Volume:
    """One volume's client engine (see module docstring)."""

    def __init__(
        self,
        session: Session,
        options: ClientOptions,
        *,
        nursery: trio.Nursery,
        ghosts: int = GHOSTS,
    ) -> None:
        """Start the session's upkeep and the idle sealing in ``nursery``;
        ``ghosts``: how many inodes that left the table keep their slice lists.

        Raises:
            InvalidArgument, IOFailure: the L2 directory cannot be used (see
                :meth:`.L2Cache.open`).
        """
        self.session = session
        self.options = options
        self.nursery = TaskGuard(nursery)
        self.inodes = InodeTable(ghosts)
        # Block buffers L1 lets go of receive the next blocks (see .buffers).
        self.buffers = BufferPool()
        self.l1 = L1Cache(options.l1_bytes, recycle=self.buffers.give)
        if session.pool is not None:
            session.pool.allocate_payloads(self.buffers.take)
        self.l2: L2Cache | None = None
        source: Any = session
        if options.cache_dir:
            self.l2 = L2Cache.open(
                options.cache_dir,
                options.cache_size,
                session.volume,
                free_space_ratio=options.free_space_ratio,
                nursery=self.nursery,
                take_buffer=self.buffers.take_aligned,
            )
            source = CachedBlocks(session, self.l2)
        self.reader = Reader(
            source, self.l1, nursery=self.nursery, readahead_max=options.readahead_max
        )
        self.reader.dirahead = DirReadahead(self.reader, budget=self.l1.capacity // 4,
                                            per_miss=options.dir_readahead)  # fmt: skip
        self._upload_limit = trio.Semaphore(options.upload_parallel)
        self.compactor = Compactor(
            session, self.reader, nursery=self.nursery, threshold=options.compact_after,
            upload_limit=self._upload_limit,
        )
        self.write_stats = WriteStats()
        self.write_budget = WriteBudget(options.write_buffer_total)
        self.spilled = 0  # files not committed at unmount, their data spilled
        session.on_block_stored = self._keep_written
        self.nursery.start_soon(session.run, restart=True)
        self.nursery.start_soon(self._seal_idle_writes, restart=True)

    @property
    def block_size(self) -> int:
        return self.session.block_size

    # ------------------------------------------------------------------ open files

    async def open(self, ino: int, fresh: Attr | None = None) -> Inode:
        """Count an open of ``ino`` and return its inode with fresh attributes:
        the leader's, from the first open here (the session announces it),
        else ``fresh`` (just read by the caller), else the lease's, else a
        ``getattr``."""
        attr = await self.session.open(ino)
        try:
            if attr is None:  # already open here: the leader was not asked
                attr = (
                    fresh
                    or self.session.leased_attr(ino)
                    or await self.session.meta.query(Q.GetAttr(self.session.volume, ino))
                )
        except BaseException:
            await self.session.release(ino)
            raise
        inode = self.inodes.update(attr)
        inode.opens += 1
        return inode

    async def release(self, inode: Inode) -> None:
        """Uncount an open; after the last one here the (committed) writer goes
        and the leader is told."""
        inode.opens -= 1
        if inode.opens <= 0 and inode.writer is not None and not inode.writer.dirty:
            inode.writer = None
        try:
            await self.session.release(inode.ino)
        finally:
            self.inodes.drop_if_idle(inode)

    async def setattr(self, ino: int, **changes: int) -> Inode:
        """Change attributes. A new size first commits pending writes (they
        must land before the truncate, not after it) and drops the cached
        slice lists."""
        inode = self.inodes.get(ino)
        if "size" in changes and inode is not None:
            await self.flush(inode)
        change = C.SetAttr(self.session.volume, ino, **changes)
        inode = self.inodes.update(await self.session.mutate(change))
        if "size" in changes:
            inode.chunks.clear()
            inode.layout += 1
            inode.born = None  # a truncate cuts slices: not only our commits any more
        return inode

    async def fallocate(self, ino: int, mode: int, offset: int, length: int) -> Inode:
        """fallocate(2) as a metadata change (:class:`~cachefs.commands.Fallocate`).
        Pending writes commit first: a hole wins over them, not over later ones."""
        inode = self.inodes.get(ino)
        if inode is not None:
            await self.flush(inode)
        change = C.Fallocate(self.session.volume, ino, mode, offset, length)
        inode = self.inodes.update(await self.session.mutate(change))
        inode.chunks.clear()
        inode.layout += 1
        inode.born = None  # a hole record is a slice that no commit counted
        return inode

    async def seek(self, ino: int, offset: int, data: bool) -> int | None:
        """SEEK_DATA (``data``) or SEEK_HOLE from ``offset`` (:mod:`.seek`):
        pending writes commit first, so they count as data. None: ENXIO."""
        inode = self.inodes.get(ino)  # the kernel asks for an open file: its inode is here
        if inode is None:
            inode = self.inodes.update(await self.session.meta.query(Q.GetAttr(self.session.volume, ino)))
        try:
            await self.flush(inode)
            return await seek_offset(functools.partial(self.reader.slices, inode), inode.attr.size, offset, data)
        finally:
            self.inodes.drop_if_idle(inode)

    def start_early_read(self, inode: Inode, first_block: bool) -> None:
        """Start :meth:`read_early` unless what it would fetch is here
        already: a file read again (L1 holds its first block, the inode its
        slice list) costs its open no task (py-spy of a second read from the
        page cache: a third of the mount's CPU per file went to early reads
        that found everything in L1)."""
        first_block = first_block and self.l1.capacity >= self.block_size
        if self.reader.holds(inode, self.block_size if first_block else 0):
            return
        self.reader.stats["early_reads"] += 1
        self.nursery.start_soon(self.read_early, inode, first_block)
        if first_block and self.reader.dirahead is not None:
            self.reader.dirahead.missed(inode.ino)  # a data loader's next files

    async def read_early(self, inode: Inode, first_block: bool) -> None:
        """Fetch chunk 0's slice list, and with ``first_block`` the first block
        too, while an ``open`` waits for the leader (a data loader reads each
        file it opens from the start; a sequential reader's readahead starts
        there). The reads that follow join these fetches."""
        try:
            await self.reader.slices(inode, 0)
            if first_block and self.l1.capacity >= self.block_size:  # else read twice
                await self.reader.prefetch(inode, 0, self.block_size)
        except CacheFSError as exc:
            log.debug("early read of inode %d: %s", inode.ino, exc)

    # ------------------------------------------------------------------ writes

    def writer(self, inode: Inode) -> FileWriter:
        """The inode's writer, shared by all its handles."""
        if inode.writer is None:
            inode.writer = FileWriter(
                self.session,
                inode,
                nursery=self.nursery,
                buffer_limit=self.options.write_buffer,
                upload_limit=self._upload_limit,
                budget=self.write_budget,
                write_through=self.options.write_through,
                on_commit=self.compactor.schedule,
                stats=self.write_stats,
            )
        return inode.writer

    async def flush(self, inode: Inode) -> None:
        """Commit what was written to ``inode`` so far (close, fsync).

        Raises:
            CacheFSError: see :meth:`.FileWriter.flush`.
        """
        if inode.writer is not None:
            await inode.writer.flush()

    async def flush_all(self, deadline: float = math.inf) -> None:
        """Commit every dirty file, all at once (unmount, SIGTERM), until the
        trio clock reaches ``deadline``; then spill what is still uncommitted,
        and what failed to commit, to local files (see :mod:`.spill`).
        :attr:`spilled` counts the spilled files; every failure and spill is logged."""

        async def commit(inode: Inode, writer: FileWriter) -> None:
            try:
                await writer.flush()
            except CacheFSError as exc:
                log.error("could not commit inode %d at unmount: %s", inode.ino, exc)

        held = [(i, i.writer) for i in self.inodes.all() if i.writer is not None and not i.writer.spilled]
        with trio.move_on_at(deadline) as scope:
            async with trio.open_nursery() as nursery:
                for inode, writer in held:
                    if writer.dirty:
                        nursery.start_soon(commit, inode, writer)
        for inode, writer in held:
            runs = writer.unsaved()
            if not runs:
                continue
            if writer.error is not None:
                reason = f"its commit failed: {writer.error.message}"
            elif scope.cancelled_caught:
                reason = "its commits did not finish before the unmount deadline"
            else:
                reason = "it was not committed"
            self._spill(inode, runs, reason)
            await writer.abandon(f"not committed at unmount ({reason}); spilled")
            self.spilled += 1

    def _spill(self, inode: Inode, runs: list[Run], reason: str) -> None:
        size = sum(len(run.data) for run in runs)
        try:
            path = spill(self.options.spill_dir, self.session.volume, inode.ino, runs, reason)
        except OSError as exc:
            log.error(
                "inode %d: %d uncommitted bytes are lost (%s), and could not be spilled to %s: %s",
                inode.ino, size, reason, self.options.spill_dir, exc,
            )  # fmt: skip
            return
        log.error(
            "inode %d: %d uncommitted bytes (%s) are kept in %s; see %s for their extents",
            inode.ino, size, reason, path, path.with_suffix(".json").name,
        )  # fmt: skip

    def dirty_bytes(self) -> int:
        return self.write_budget.used

    async def _seal_idle_writes(self) -> None:
        """Seal extents left idle; all open extents at once while writes
        wait for room in the client's write budget."""
        while True:
            await trio.sleep(1.0)
            idle = 0.0 if self.write_budget.waiting else FLUSH_IDLE
            for inode in self.inodes.all():
                if inode.writer is not None:
                    inode.writer.seal_idle(idle)

    def _keep_written(self, key: BlockKey, data: bytes | memoryview) -> None:
        """A block we stored goes into L1 (at its cold end, see ``L1Cache.put``)
        and L2: O_DIRECT readers bypass the page cache, and what a job just
        wrote is what it reads next (JuiceFS keeps written blocks in its cache too)."""
        to_l1 = len(data) <= self.l1.capacity  # else L1 would drop it: spare the copy
        if to_l1 or self.l2 is not None:
            # One copy for both, the one the session made for the codec
            # (Session.store_block); a view of the writer's run is copied here.
            block = data if isinstance(data, bytes) else bytes(data)
            if to_l1:
                self.l1.put(key, block, cold=True)
            if self.l2 is not None:
                self.l2.keep(key, block)

    # ------------------------------------------------------------------ counters

    def stats(self) -> dict[str, Any]:
        """Counters of the read path (L1, fetches) and block chain (cache vs backing)."""
        s = self.l1.stats
        return {
            **self.reader.stats,
            **(self.reader.dirahead.stats if self.reader.dirahead is not None else {}),
            **self.session.stats,
            "l1_hits": s.hits,
            "l1_misses": s.misses,
            "l1_used": self.l1.used,
            **self.buffers.stats,
            **(self.l2.stats if self.l2 is not None else {}),
        }
