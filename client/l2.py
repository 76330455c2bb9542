"""L2: this client's local flash cache of whole blocks (``--cache-dir``).

Between L1 (memory) and the cache tier in the read order (DESIGN.md,
"Reads"), as JuiceFS's ``--cache-dir`` and CubeFS's bcache are. It keeps the
blocks this client fetched whole from the cache tier or backing storage and
the blocks it wrote, as files of a :class:`~cachefs.blockstore.BlockStore`
(the cache node's own store: LRU under ``--cache-size``, a free-space floor
``--free-space-ratio``, per-segment checksums verified on every read, an
index rebuilt from the files after a restart).

Theory of operation
-------------------
- Hits are served from this process, with no RPC: one ``pread`` of the
  segments covering the range, verified, and handed on without another
  copy. Blocks are kept in ``SEGMENT_SIZE`` (16 KiB) checksum segments, not
  the cache node's 64 KiB: a random 4 KiB read reads and verifies 16 KiB.
  Ranges up to ``INLINE_MAX``, and whole blocks that small (a small
  file's: in a thread, a 110 KiB one cost twice the mount's CPU, mostly in
  handing the GIL back and forth), are read inline on the trio thread while
  the disk answers them fast (:mod:`.inline_reads`: a small pread from an SSD
  costs less than a hop to a worker thread); on a slow disk, only what the
  page cache holds (``RWF_NOWAIT``). Ranges left on the disk and larger
  reads (big blocks) run in up to ``READ_THREADS`` worker threads, so
  that several are in flight at once (measured: inline, a cold 256 MiB
  file read at 278 MiB/s from a disk that reads 750 MiB/s). The threads are
  L2's own (:class:`ReadThreads`), not ``trio.to_thread``'s: a hop costs
  about 34 us of CPU against 74-93 us (measured here, empty jobs, 4 tasks).
  Reads of ``DIRECT_READ_MIN`` or more (whole 4 MiB blocks, written with
  ``O_DIRECT``) are read with ``O_DIRECT`` too, into fresh page-aligned
  memory that L1 then keeps. Through the page cache, 45% of the mount's
  CPU in 4 streams of first reads from L2 went to the ``pread`` (the copy
  out of the page cache, its page allocation and LRU locks), and the block
  was cached twice, in L1 and in the page cache; direct, the mount's
  system time fell from 1.4 to 0.85 s per GiB and the 4 streams went from
  630-700 to 830-900 MiB/s (fio, 4 x 1 GiB, page cache dropped; with perf
  attached). The memory comes from the mount's buffer pool when L1 has
  given a block's back (``take_buffer``): faulting in fresh pages and
  unmapping them was the largest cost left; reused, 0.68-0.82 -> 0.34-0.44
  s per GiB of system time, 855-1,143 -> 1,082-1,372 MiB/s (no perf).
- Blocks are immutable, so a cached block is never stale and L2 needs no
  invalidation across mounts: which blocks a file has is a question of
  metadata (slice lists), which close-to-open keeps fresh as before.
- Block files read are kept open (up to ``OPEN_FILES``, and a quarter of
  the descriptor limit): opening one cost about 29 us of a 4 KiB hit. The
  store closes them on eviction, corruption and at the mount's end, never
  under a read (see :mod:`cachefs.blockstore`, "Open files").
- A corrupt, truncated or deleted file is a miss (the store drops its
  entry); the read goes on down the chain. L2 never fails a read.
- Fills are written by one worker thread in the background, never on the
  read's or the write's path. Fills queue up to ``FILL_QUEUE`` blocks; past
  that they are dropped (a cache is allowed to forget). A full disk (the
  floor, or ``ENOSPC``) makes fills fail and be counted; reads and writes
  of the volume go on as without L2. Free space below the floor is said
  in the log when L2 opens and at the first fill refused (each minute at
  most), naming the floor and the free space, and counted apart
  (``fills_below_floor``): an L2 that stays empty is never a riddle.
- The directory is locked (``flock``) for the life of the mount, so two
  mounts never share one L2. The lock goes with the fill worker's task, that
  is with the engine's nursery.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import mmap
import os
import queue
import resource
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import outcome
import trio

from cachefs.blockstore import BlockStore
from cachefs.errors import CacheFSError, Corrupt, InvalidArgument, IOFailure, NoSpace
from cachefs.ids import BlockKey
from cachefs.layout import Slice
from cachefs.pagecache import WouldBlock
from cachefs.tasks import Spawner

from .inline_reads import InlineReads

log = logging.getLogger(__name__)

INLINE_MAX = 256 * 1024
SEGMENT_SIZE = 16 * 1024  # checksum segments of the blocks L2 writes: the least read from the disk
DIRECT_READ_MIN = 1 << 20  # reads of a block this large or larger bypass the page cache (O_DIRECT)
READ_THREADS = 4
OPEN_FILES = 1024  # block files kept open: 4 GiB of 4 MiB blocks
FILL_QUEUE = 32  # blocks waiting to be written to L2 (128 MiB of 4 MiB blocks)
NO_MAPPING = 1 << 62  # the client reads with pread: a mapping would need a lease (see the store)
WARN_EVERY = 60.0  # seconds between warnings about failing fills (and logs of the inline policy)


def lock_dir(root: Path) -> int:
    """An exclusive lock on ``root`` held by the returned descriptor.

    Raises:
        InvalidArgument: another process (mount) holds it.
        IOFailure: the directory cannot be created or locked.
    """
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise IOFailure(f"cache directory {root}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise InvalidArgument(f"cache directory {root} is in use by another mount") from None
    return fd


class ReadThreads:
    """``count`` threads that run blocking calls for trio tasks, the lean way.

    A job is queued with the waiting task; the thread runs it and hands the
    outcome back with ``run_sync_soon(reschedule)``: one queue hand-off and
    one wake-up of the loop, none of ``trio.to_thread``'s limiter and thread
    cache. As with ``trio.to_thread.run_sync``, a task waiting here cannot be
    cancelled (the call runs to its end). :meth:`stop` ends the threads once
    the jobs queued before it are done."""

    def __init__(self, count: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Any, Any] | None]
        self._jobs = queue.SimpleQueue()
        self._count = count
        for i in range(count):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, token, task = job
            result = outcome.capture(fn, *args)
            try:
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)
            except trio.RunFinishedError:  # the loop is gone: nobody waits for it
                pass

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._jobs.put((fn, args, trio.lowlevel.current_trio_token(), trio.lowlevel.current_task()))
        return await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)

    def stop(self) -> None:
        for _ in range(self._count):
            self._jobs.put(None)


def _timed_read(store: BlockStore, key: BlockKey, offset: int, length: int) -> tuple[memoryview | None, float]:
    """A read in a worker thread, and its time there (the disk's, not the hop's)."""
    started = time.perf_counter()
    data = store.read(key, offset, length)
    return data, time.perf_counter() - started


class L2Cache:
    """Whole blocks on local flash for one mount (see module docstring)."""

    def __init__(self, store: BlockStore, volume: str, lock_fd: int, *, nursery: Spawner,
                 pace: InlineReads | None = None,
                 take_buffer: Callable[[int], mmap.mmap | None] | None = None) -> None:  # fmt: skip
        """``take_buffer(size)``: page-aligned memory nobody refers to any
        more, for a whole block read with ``O_DIRECT`` (the mount's
        :meth:`~cachefs.buffers.BufferPool.take_aligned`), or None."""
        self.store = store
        self._take_buffer = take_buffer
        self.volume = volume
        self.pace = pace or InlineReads()
        self._lock_fd = lock_fd
        self._send, receive = trio.open_memory_channel[tuple[BlockKey, Any]](FILL_QUEUE)
        self._queued: set[BlockKey] = set()
        self._warned = -WARN_EVERY
        self._said_pace = -WARN_EVERY  # when a switch of the inline policy was last logged
        self._readers = ReadThreads(READ_THREADS, "l2-read")
        self.stats = {
            "l2_hits": 0,
            "l2_hit_bytes": 0,
            "l2_misses": 0,
            "l2_corrupt": 0,
            "l2_inline_reads": 0,  # small ranges read on the loop (the disk is fast)
            "l2_disk_reads": 0,  # small ranges not in the page cache, read in a thread
            "l2_inline_switches": 0,  # times small reads moved between the loop and the threads
            "l2_fills": 0,
            "l2_fills_dropped": 0,
            "l2_fills_failed": 0,
            "l2_fills_below_floor": 0,  # of those failed: the disk's free space was below the floor
        }
        nursery.start_soon(self._fill_worker, receive)

    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str],
        capacity: int,
        volume: str,
        *,
        free_space_ratio: float,
        nursery: Spawner,
        open_files: int | None = None,
        pace: InlineReads | None = None,
        take_buffer: Callable[[int], mmap.mmap | None] | None = None,
    ) -> L2Cache:
        """Lock ``root`` and rebuild the index from the files found there.

        ``open_files``: block files kept open (default: :data:`OPEN_FILES`,
        at most a quarter of this process's descriptor limit). ``pace``:
        when small ranges are read inline (default: :class:`.InlineReads`).

        Raises:
            InvalidArgument: bad capacity or ratio, or another mount uses ``root``.
            IOFailure: ``root`` cannot be created or scanned.
        """
        path = Path(root)
        if open_files is None:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            open_files = OPEN_FILES if soft == resource.RLIM_INFINITY else min(OPEN_FILES, soft // 4)
        fd = lock_dir(path)
        try:
            started = time.perf_counter()
            store = BlockStore.open(
                path,
                capacity,
                mmap_min=NO_MAPPING,
                free_space_ratio=free_space_ratio,
                open_files=open_files,
                segment_size=SEGMENT_SIZE,
                direct_read_min=DIRECT_READ_MIN,
            )
        except BaseException:
            os.close(fd)
            raise
        log.info(
            "L2 %s: %d blocks, %d of %d bytes, index rebuilt in %.2fs",
            path, len(store), store.used, capacity, time.perf_counter() - started,
        )  # fmt: skip
        below = store.floor_report()
        if below is not None:  # say so now, not only at the first fill refused
            log.warning("L2 %s: %s (--free-space-ratio %g)", path, below, free_space_ratio)
        return cls(store, volume, fd, nursery=nursery, pace=pace, take_buffer=take_buffer)

    async def read(self, key: BlockKey, offset: int = 0, length: int = -1) -> memoryview | None:
        """Bytes of a cached block (range), or None: not here, or not intact."""
        span = length
        if length == -1:  # a whole block: a small file's is as small as a range
            entry = self.store.lookup(key)
            if entry is None:
                return self._hit(None)
            span = entry.size - offset
        small = 0 <= span <= INLINE_MAX
        try:
            data = None
            if small:
                started = time.perf_counter()
                try:
                    if self.pace.inline:  # the disk is fast: read here, whatever it costs
                        self.stats["l2_inline_reads"] += 1
                        data = self.store.read(key, offset, length)
                    else:
                        data = self.store.read(key, offset, length, nowait=True)
                except WouldBlock:  # a slow disk: read it in a thread, not on the loop
                    self.stats["l2_disk_reads"] += 1
                else:
                    self._observe(time.perf_counter() - started)
                    return self._hit(data)
            if self.store.lookup(key) is not None:
                if small:
                    data, seconds = await self._readers.run(_timed_read, self.store, key, offset, length)
                    self._observe(seconds)
                else:
                    into = None
                    if self._take_buffer is not None and span >= DIRECT_READ_MIN:
                        into = self._take_buffer(span)
                    data = await self._readers.run(functools.partial(self.store.read, into=into), key, offset, length)
        except Corrupt:
            self.stats["l2_corrupt"] += 1
            data = None
        except (IOFailure, InvalidArgument) as exc:
            log.info("L2 read of %s failed, reading around it: %s", key.hex(), exc)
            data = None
        return self._hit(data)

    def _observe(self, seconds: float) -> None:
        inline = self.pace.inline
        self.pace.observe(seconds)
        if self.pace.inline != inline:
            self.stats["l2_inline_switches"] += 1
            now = time.monotonic()
            if now - self._said_pace < WARN_EVERY:  # a disk at the limit may switch often
                return
            self._said_pace = now
            log.info(
                "L2 %s: small reads %s: they took %.2f ms on average (limit %.2f ms)",
                self.store.root, "back on the loop" if self.pace.inline else "in threads now",
                self.pace.mean * 1e3, self.pace.stall_max * 1e3,
            )  # fmt: skip

    def _hit(self, data: memoryview | None) -> memoryview | None:
        if data is None:
            self.stats["l2_misses"] += 1
            return None
        self.stats["l2_hits"] += 1
        self.stats["l2_hit_bytes"] += len(data)
        return data

    def keep(self, key: BlockKey, data: bytes | bytearray | memoryview) -> None:
        """Queue a whole block for writing to L2; dropped if the queue is full.

        ``data`` must stay unchanged until written (blocks from the tier and
        L1's copies of written blocks are never written again)."""
        if key in self._queued or self.store.lookup(key) is not None:
            return
        try:
            self._send.send_nowait((key, data))
        except trio.WouldBlock:
            self.stats["l2_fills_dropped"] += 1
            return
        self._queued.add(key)

    async def _fill_worker(self, receive: trio.MemoryReceiveChannel[tuple[BlockKey, Any]]) -> None:
        try:
            async with receive:
                async for key, data in receive:
                    try:
                        if await trio.to_thread.run_sync(self.store.put, self.volume, key, data):
                            self.stats["l2_fills"] += 1
                    except (NoSpace, IOFailure) as exc:
                        self.stats["l2_fills_failed"] += 1
                        if exc.details.get("floor") is not None:
                            self.stats["l2_fills_below_floor"] += 1
                        self._warn(exc)
                    finally:
                        self._queued.discard(key)
        finally:
            self._readers.stop()
            self.store.close()  # the mount's end: its kept block files go
            os.close(self._lock_fd)  # and another may use the directory

    def _warn(self, exc: CacheFSError) -> None:
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY:
            self._warned = now
            hint = " (--free-space-ratio)" if exc.details.get("floor") is not None else ""
            log.warning("L2 %s: blocks are not being cached: %s%s", self.store.root, exc.message, hint)


class CachedBlocks:
    """The Reader's block source with L2 in front of the session's chain
    (cache tier, then backing storage); whole blocks fetched are kept in L2."""

    def __init__(self, source: Any, l2: L2Cache) -> None:
        self.source = source
        self.l2 = l2
        self.block_size: int = source.block_size

    def holds(self, key: BlockKey) -> bool:
        """Whether L2 has the block (the Reader then reads ranges of it, not all of it)."""
        return self.l2.store.lookup(key) is not None

    async def read_chunk(self, ino: int, chunk: int) -> list[Slice]:
        return await self.source.read_chunk(ino, chunk)

    async def fetch(
        self, key: BlockKey, offset: int = 0, length: int = -1
    ) -> bytes | bytearray | memoryview:
        data = await self.l2.read(key, offset, length)
        if data is not None:
            return data
        data = await self.source.fetch(key, offset, length)
        if offset == 0 and length == -1:
            self.l2.keep(key, data)
        return data

    def owner(self, key: BlockKey) -> str | None:
        """The cache node to ask for ``key`` in a batch, or None: a block in
        L2 is read from here, one at a time (:meth:`fetch`)."""
        if self.holds(key):
            return None
        return self.source.owner(key)

    async def fetch_many(self, addr: str, keys: list[BlockKey]) -> dict[BlockKey, bytes]:
        """The session's batch fetch; the blocks it brings are kept in L2 too."""
        got = await self.source.fetch_many(addr, keys)
        for key, data in got.items():
            self.l2.keep(key, data)
        return got
