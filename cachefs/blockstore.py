"""A flash block store: blocks as files under a byte capacity.

Two users: a cache node's flash tier (:mod:`cachefs.cachenode.service`) and
a client's local flash cache, L2 (:mod:`cachefs.client.l2`).

Theory of operation
-------------------

Each cached block is one file ``<root>/blocks/<xx>/<key.hex()>`` laid out as::

    header: magic "CFB1", version, flags, volume length, data length,
            segment size, segment count, the volume name, one xxh3-64 per
            segment of the data, and an xxh3-64 of all the header bytes before it
    data:   the block's bytes

Blocks are immutable (DESIGN.md, "Data model"), so a cached block is never
stale and never rewritten; keys are unique across volumes because slice ids
are cluster-wide. The per-segment checksums (64 KiB segments by default, as
HDFS and 3FS checksum chunks rather than whole blocks) let a 128 KiB range
read touch and verify about 128 KiB instead of the whole 4 MiB block; each
file names its segment size, so stores of different sizes read each other's
files (the client's L2 uses 16 KiB: see :mod:`cachefs.client.l2`). The index
keeps the checksums as a packed array, 8 bytes each. A segment that fails
verification drops the whole block and raises ``Corrupt``; the service then
fetches it again. Bad bytes are never served.

Capacity. ``used`` counts the file sizes of indexed blocks, ``reserved`` the
sizes of fills in progress. A fill first *reserves* its file size, evicting
least-recently-used blocks until ``used + reserved`` fits the capacity, and
unlinks its victims before writing. So the bytes on disk never exceed the
capacity, also with many concurrent fills; a fill that cannot reserve (the
rest is reserved by other fills) raises ``NoSpace`` and is served uncached.

Writes without the page cache. A block of ``direct_min`` bytes or more
(a whole 4 MiB block, not a small file's) is written with ``O_DIRECT``: a
buffered write copies every byte into the page cache (measured 0.4-1.2 s of
CPU per GiB here, the largest cost of a cache node's cold fill), O_DIRECT
has the disk read the buffer itself (0.08 s/GiB), at the price of one copy
into a reused page-aligned buffer (0.03-0.1 s/GiB). Such a file's header
sets ``FLAG_ALIGNED`` and is padded to :data:`ALIGN` bytes, so the data
starts (and is mapped and read) at a page boundary; the file is written
rounded up to ``ALIGN`` and cut to its exact size. A filesystem that refuses
O_DIRECT (tmpfs) gets buffered writes from then on. Reads of such a block
go through the page cache (a hit comes from the disk once, then from
memory), unless the store has a ``direct_read_min``: the client's L2 reads
whole blocks with ``O_DIRECT`` into private anonymous memory that its L1
then keeps (see ``_read_direct``), since a copy in the page cache would be
the third of the same bytes (the FUSE file's pages, L1, and this one).

Crash safety. A block is written to ``<root>/tmp/`` in one write and
renamed into place, so a file under ``blocks/`` is complete unless the machine
lost power (no fsync: it is a cache, and a torn file fails its checksums).
``open()`` rebuilds the index by scanning the headers (kill -9 included),
discards everything in ``tmp/`` and every file whose header is bad or whose
size disagrees with it, and orders the LRU by file mtime (the fill time; hits
are not persisted, which is what CubeFS's flash nodes do too).

Removal. A block leaves the index first (under the lock), and its file is
unlinked after, outside it. In between, a fill of the same key (another
reader that found the block gone fetched it again) may have renamed a good
copy onto the same path, so the unlink is of the entry's own file only: an
entry remembers its file's device and inode, and the file at the path is
unlinked only if it is still that one. The check and the unlink are made
under ``_names``, as a fill's rename is, so no rename falls between them. A
corrupt file is unlinked while its descriptor is open, so that its inode
number cannot have gone to another file meanwhile.

TTL. ``ttl`` maps a volume name to seconds after the fill; an expired block
is a miss and is deleted.

Pins. :meth:`BlockStore.pin` keeps keys from eviction (and from the TTL)
until a wall-clock time: a warm-up job's ``--pin-ttl``, so the LRU cannot
drop a dataset before the epoch that needs it (Fluid's DataLoad). A pin may
name a block that is not here yet (it is being fetched); it holds once it
arrives. Eviction passes over a pinned block by moving it to the recent end
of the LRU (so a scan of many pins is paid once, not per fill); a fill that
finds only pinned blocks to evict raises ``NoSpace`` and is served uncached.
An explicit :meth:`discard` (``warmup --evict``) drops the pin too. Pins are
appended to ``<root>/pins`` (key, until) and read back by :meth:`rebuild`,
which rewrites the file with the pins that still hold: a restarted node
keeps its pins.

Memory tier. Optionally the hottest blocks (read at least ``promote_after``
times) are also kept whole in memory, LRU by bytes; it is a subset of the
flash tier and costs no disk reads.

Free-space floor. With ``free_space_ratio`` set, a fill also keeps that
share of the whole filesystem free (JuiceFS's ``--free-space-ratio``): the
store shares its disk with others (a client's L2 sits on a training node's
local disk), so the capacity alone is not enough. A fill that would leave
less evicts more, least recently used first; with nothing left to evict it
raises ``NoSpace``. A write that fails anyway (``ENOSPC``: the disk filled
up faster than we looked) is an ``IOFailure`` and leaves nothing behind.

Reads and other writers. Small reads are one ``pread`` into a buffer of
this process. Reads of ``mmap_min`` bytes or more are served from a mapping
of the file (no copy: measured ~2.6 against ~3.3 ms of server CPU per 4 MiB
hit with 16 readers for a pread, even into reused heap memory), but only under
a read *lease* (``F_SETLEASE``) taken before mapping:
while the mapping lives (the lease sits on the mapping's own descriptor and
goes with it), another process that opens the file for writing or truncates
it waits (up to the kernel's ``lease-break-time``, 45 s by default) instead of
pulling the pages from under us, which would SIGBUS the node as it verifies
or copies them, or change bytes already verified. Where no lease can be had
(someone has the file open for writing, a filesystem without leases, a file
we do not own), the read falls back to ``pread``. Either way the checksums are
computed over the bytes that are then served; a short or changed file is
``Corrupt``: dropped and fetched again. The memory tier holds a private,
verified copy, served without re-checking (nothing else can write to it).

Open files. With ``open_files`` set (the client's L2), block files read
are kept open, at most that many, least recently read closed first: an
``open`` costs more than a 4 KiB ``pread`` from the page cache (about 29 us
of a mount's random 4 KiB read). A kept file belongs to its index entry: it
is closed when the entry leaves the index (evicted, expired, discarded, found
corrupt, short or gone) or the store is closed, but never while a read is
using it (a count of readers): a descriptor number closed under a ``pread``
could be reused by a fill's file and read as another block. A file replaced
or unlinked by someone else is still read through the kept descriptor, which
is safe (a block's bytes never change; the checksums still verify them); a
file changed in place fails them and is dropped. Mapped reads never use a
kept file: the read lease would outlive the mapping on it.

Threads. The store has no trio in it: every method is plain blocking code,
safe to call from several threads. The index is guarded by one lock that is
never held across file IO; file IO is done in few, large steps (one pread or
one leased, populated mmap per read, one write per fill). The service
decides what runs in a thread.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import signal
import struct
import sys
import threading
import time
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from cachefs.buffers import aligned_buffer
from cachefs.checksum import checksum
from cachefs.errors import Corrupt, InvalidArgument, IOFailure, NoSpace
from cachefs.ids import BlockKey
from cachefs.pagecache import pread_nowait

log = logging.getLogger(__name__)

MAGIC = b"CFB1"
VERSION = 1
SEGMENT_SIZE = 64 * 1024
_FIXED = struct.Struct("<4sBBHQII")  # magic, version, flags, vol_len, data_len, seg_size, nseg
_U64 = struct.Struct("<Q")
_SHARDS = 256
_HEADER_PROBE = 4096
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_F_SETLEASE = getattr(fcntl, "F_SETLEASE", None)
_F_SETSIG = getattr(fcntl, "F_SETSIG", None)
MMAP_MIN = 1 << 20
FLAG_ALIGNED = 1  # the data starts at the header's length rounded up to ALIGN
ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and memory (the page size)
DIRECT_MIN = 1 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_SCRATCH_KEPT = 4  # page-aligned write buffers kept for reuse


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _shard(key: BlockKey) -> str:
    return f"{(key.slice_id ^ (key.slice_id >> 8) ^ key.index) & 0xFF:02x}"


def segment_sums(data: bytes | bytearray | memoryview, segment_size: int) -> list[int]:
    view = memoryview(data)
    return [checksum(view[i : i + segment_size]) for i in range(0, len(view), segment_size)]


def encode_header(volume: str, size: int, segment_size: int, sums: Sequence[int], flags: int = 0) -> bytes:
    vol = volume.encode()
    head = (
        _FIXED.pack(MAGIC, VERSION, flags, len(vol), size, segment_size, len(sums))
        + vol
        + struct.pack(f"<{len(sums)}Q", *sums)
    )
    return head + _U64.pack(checksum(head))


def _sums(raw: bytes | memoryview) -> array[int]:
    """Little-endian u64 checksums as a compact array: 8 bytes each in the
    index, where a tuple of ints costs about 44 (an L2 of 16 KiB segments
    has 256 per block)."""
    sums = array("Q")
    sums.frombytes(raw)
    if sys.byteorder != "little":
        sums.byteswap()
    return sums


@dataclass(slots=True)
class _Header:
    volume: str
    size: int
    segment_size: int
    sums: array[int]
    length: int
    data_offset: int  # where the data starts: ``length``, or rounded up to ALIGN (FLAG_ALIGNED)


def decode_header(raw: bytes) -> _Header | int:
    """Parse a header; returns the bytes still needed as an int if ``raw`` is short.

    Raises:
        Corrupt: the header is malformed or fails its checksum.
    """
    if len(raw) < _FIXED.size:
        return _FIXED.size
    magic, version, flags, vol_len, size, seg, nseg = _FIXED.unpack_from(raw)
    if magic != MAGIC or version != VERSION or seg <= 0 or flags & ~FLAG_ALIGNED:
        raise Corrupt("bad block file header")
    if nseg != -(-size // seg):
        raise Corrupt("segment count does not match the data length")
    length = _FIXED.size + vol_len + 8 * nseg + 8
    if len(raw) < length:
        return length
    (stored,) = _U64.unpack_from(raw, length - 8)
    if checksum(memoryview(raw)[: length - 8]) != stored:
        raise Corrupt("block file header fails its checksum")
    vol = raw[_FIXED.size : _FIXED.size + vol_len].decode()
    sums = _sums(memoryview(raw)[_FIXED.size + vol_len : length - 8])
    return _Header(vol, size, seg, sums, length, _align(length) if flags & FLAG_ALIGNED else length)


@dataclass(slots=True)
class Entry:
    """One cached block in the index."""

    key: BlockKey
    volume: str
    size: int
    file_size: int
    data_offset: int
    segment_size: int
    sums: array[int]  # one per segment
    stored_at: float
    hits: int = 0
    file: _OpenFile | None = None  # kept open for reads (``open_files``)
    ident: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of its file: only that file is ever unlinked


@dataclass(slots=True, eq=False)
class _OpenFile:
    """A block file kept open; closed once dropped and no read is using it."""

    fd: int
    users: int = 0
    dropped: bool = False


@dataclass(slots=True)
class StoreCounters:
    evictions: int = 0
    expired: int = 0
    corrupt: int = 0
    discarded_on_open: int = 0
    memory_hits: int = 0
    flash_hits: int = 0
    below_floor: int = 0  # fills refused: the disk's free space was below the floor


@dataclass(slots=True)
class RebuildReport:
    blocks: int
    bytes: int
    discarded: int
    evicted: int


@dataclass(slots=True)
class _Memory:
    capacity: int
    used: int = 0
    blocks: OrderedDict[BlockKey, bytes] = field(default_factory=OrderedDict)

    def drop(self, key: BlockKey) -> None:
        data = self.blocks.pop(key, None)
        if data is not None:
            self.used -= len(data)

    def add(self, key: BlockKey, data: bytes) -> None:
        if len(data) > self.capacity or key in self.blocks:
            return
        while self.used + len(data) > self.capacity:
            _, old = self.blocks.popitem(last=False)
            self.used -= len(old)
        self.blocks[key] = data
        self.used += len(data)


class BlockStore:
    """Blocks on local flash under a byte capacity (see module docstring)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity: int,
        *,
        memory_capacity: int = 0,
        ttl: Mapping[str, float] | None = None,
        segment_size: int = SEGMENT_SIZE,
        promote_after: int = 2,
        mmap_min: int = MMAP_MIN,
        direct_min: int = DIRECT_MIN,
        direct_read_min: int = 0,
        free_space_ratio: float = 0.0,
        open_files: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if capacity <= 0:
            raise InvalidArgument(f"cache capacity must be positive, got {capacity}")
        if memory_capacity < 0:
            raise InvalidArgument(f"memory capacity must not be negative, got {memory_capacity}")
        if segment_size <= 0:
            raise InvalidArgument(f"segment size must be positive, got {segment_size}")
        if open_files < 0:
            raise InvalidArgument(f"open files must not be negative, got {open_files}")
        if not 0.0 <= free_space_ratio < 1.0:
            raise InvalidArgument(f"free space ratio must be in [0, 1), got {free_space_ratio}")
        self.root = Path(root)
        self.capacity = capacity
        self.ttl = dict(ttl or {})
        self.segment_size = segment_size
        self.promote_after = promote_after
        self.mmap_min = mmap_min
        self.direct_min = direct_min if _O_DIRECT else 0  # 0: never O_DIRECT
        self.direct_read_min = direct_read_min if _O_DIRECT else 0  # 0: reads through the page cache
        self._scratch: list[mmap.mmap] = []  # page-aligned buffers for O_DIRECT writes
        self.free_space_ratio = free_space_ratio
        self._clock = clock
        self._lock = threading.Lock()
        self._names = threading.Lock()  # a fill's rename vs. a removal's check-then-unlink (``_unlink``)
        self._index: OrderedDict[BlockKey, Entry] = OrderedDict()  # LRU first
        self._writing: set[BlockKey] = set()
        self._memory = _Memory(memory_capacity)
        self.open_files = open_files
        self._open: OrderedDict[BlockKey, Entry] = OrderedDict()  # with a kept file, LRU first
        self._closed = False
        self.used = 0
        self.reserved = 0
        self.counters = StoreCounters()
        self._blocks_dir = self.root / "blocks"
        self._blocks_prefix = f"{self._blocks_dir}/"
        self._tmp_dir = self.root / "tmp"
        self._pins: dict[BlockKey, float] = {}  # key -> wall-clock time the pin lapses
        self._pins_pruned = 0  # how many pins were left by the last pruning
        self._pins_file = self.root / "pins"

    # -- opening and the index rebuild -----------------------------------

    @classmethod
    def open(cls, root: str | os.PathLike[str], capacity: int, **kwargs: object) -> BlockStore:
        store = cls(root, capacity, **kwargs)  # type: ignore[arg-type]
        store.rebuild()
        return store

    def rebuild(self) -> RebuildReport:
        """Scan the cache directory and rebuild the index (after any restart)."""
        try:
            self._tmp_dir.mkdir(parents=True, exist_ok=True)
            for d in range(_SHARDS):
                (self._blocks_dir / f"{d:02x}").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise IOFailure(f"cannot create cache directory {self.root}: {exc}") from exc
        discarded = 0
        for name in os.listdir(self._tmp_dir):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp_dir / name)
            discarded += 1
        found: list[Entry] = []
        for d in range(_SHARDS):
            shard = self._blocks_dir / f"{d:02x}"
            for name in os.listdir(shard):
                entry = self._load_entry(shard / name, name)
                if entry is None:
                    discarded += 1
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(shard / name)
                else:
                    found.append(entry)
        found.sort(key=lambda e: e.stored_at)
        pins = self._load_pins()
        with self._lock:
            for old in list(self._open.values()):
                self._close_locked(old)
            self._pins = pins
            self._index = OrderedDict((e.key, e) for e in found)
            self._memory = _Memory(self._memory.capacity)
            self.used = sum(e.file_size for e in found)
            self.counters.discarded_on_open += discarded
            victims = self._evict_until_locked(0)
        self._unlink(victims)
        if discarded:
            log.info("cache store %s: discarded %d half-written or bad files", self.root, discarded)
        return RebuildReport(len(self._index), self.used, discarded, len(victims))

    def _load_pins(self) -> dict[BlockKey, float]:
        """The pins in ``<root>/pins`` that still hold; the file is rewritten with them.
        A torn last record (a crash while appending) ends the file."""
        pins: dict[BlockKey, float] = {}
        try:
            with open(self._pins_file, "rb") as f:
                for raw, until in msgpack.Unpacker(f, use_list=False):
                    key = BlockKey.from_bytes(raw)
                    pins[key] = max(until, pins.get(key, 0.0))
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, msgpack.UnpackException) as exc:
            log.warning("cache store %s: pins file unreadable past %d pins: %s", self.root, len(pins), exc)
        now = self._clock()
        pins = {k: u for k, u in pins.items() if u > now}
        tmp = self._tmp_dir / "pins"
        try:
            with open(tmp, "wb") as f:
                for key, until in pins.items():
                    f.write(msgpack.packb((key.to_bytes(), until)))
            os.rename(tmp, self._pins_file)
        except OSError as exc:
            raise IOFailure(f"cannot rewrite {self._pins_file}: {exc}") from exc
        return pins

    def pin(self, keys: list[BlockKey], until: float) -> None:
        """Keep ``keys`` from eviction and expiry until ``until`` (wall clock,
        seconds); a later pin of a key extends it, an earlier one does nothing."""
        with self._lock:
            new = [k for k in keys if self._pins.get(k, 0.0) < until]
            for key in new:
                self._pins[key] = until
            if len(self._pins) > 2 * self._pins_pruned + 1024:  # lapsed pins of blocks never stored
                now = self._clock()
                self._pins = {k: u for k, u in self._pins.items() if u > now}
                self._pins_pruned = len(self._pins)
        if new:
            try:
                with open(self._pins_file, "ab") as f:  # one write per call: a torn tail is one lost batch
                    f.write(b"".join(msgpack.packb((k.to_bytes(), until)) for k in new))
            except OSError as exc:
                raise IOFailure(f"cannot record pins in {self._pins_file}: {exc}") from exc

    def pinned(self, key: BlockKey) -> float:
        """When ``key``'s pin lapses (0: it has none)."""
        until = self._pins.get(key, 0.0)
        return until if until > self._clock() else 0.0

    def _load_entry(self, path: Path, name: str) -> Entry | None:
        try:
            key = BlockKey.from_hex(name)
        except ValueError:
            return None
        if path.parent.name != _shard(key):
            return None
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            raw = os.pread(fd, _HEADER_PROBE, 0)
            header = decode_header(raw)
            if isinstance(header, int):
                raw = os.pread(fd, header, 0)
                header = decode_header(raw)
        except (OSError, Corrupt, UnicodeDecodeError, struct.error):
            return None
        finally:
            os.close(fd)
        if isinstance(header, int) or st.st_size != header.data_offset + header.size:
            return None
        return Entry(
            key,
            header.volume,
            header.size,
            st.st_size,
            header.data_offset,
            header.segment_size,
            header.sums,
            st.st_mtime,
            ident=(st.st_dev, st.st_ino),
        )

    # -- paths, expiry, eviction ------------------------------------------

    def path(self, key: BlockKey) -> Path:
        return Path(self._file(key))

    def _file(self, key: BlockKey) -> str:
        # A plain string: pathlib costs more than the 128 KiB pread it names.
        return f"{self._blocks_prefix}{_shard(key)}/{key.hex()}"

    def _expired(self, entry: Entry, now: float) -> bool:
        ttl = self.ttl.get(entry.volume)
        return ttl is not None and now - entry.stored_at > ttl and self._pins.get(entry.key, 0.0) <= now

    def _pop_lru_locked(self) -> Entry | None:
        """Take the least recently used block that no pin holds out of the index."""
        if not self._pins:
            if not self._index:
                return None
            entry = self._index.popitem(last=False)[1]
            self._close_locked(entry)
            return entry
        now = self._clock()
        for _ in range(len(self._index)):
            key, entry = next(iter(self._index.items()))
            until = self._pins.get(key)
            if until is None or until <= now:
                self._pins.pop(key, None)
                del self._index[key]
                self._close_locked(entry)
                return entry
            self._index.move_to_end(key)  # held: look at it again only after every other block
        return None

    def _remove_locked(self, entry: Entry) -> None:
        """Drop ``entry`` from the index; the caller unlinks its file."""
        if self._index.get(entry.key) is entry:
            del self._index[entry.key]
            self.used -= entry.file_size
            self._memory.drop(entry.key)
        self._close_locked(entry)

    # -- kept open files (``open_files``) -------------------------------------

    def _acquire_locked(self, entry: Entry) -> _OpenFile | None:
        """The kept file of ``entry``, with one more reader; None if it has none."""
        kept = entry.file
        if kept is None:
            return None
        kept.users += 1
        self._open.move_to_end(entry.key)
        return kept

    def _keep_locked(self, entry: Entry, fd: int) -> _OpenFile | None:
        """Keep ``fd`` (just opened, by one reader) as ``entry``'s file, closing
        the least recently read kept file past ``open_files``; None when it is
        not kept (no ``open_files``, closed store, an entry no longer indexed
        or already with a file): the caller closes ``fd`` itself."""
        if (
            self.open_files <= 0
            or self._closed
            or entry.file is not None
            or self._index.get(entry.key) is not entry
        ):
            return None
        kept = entry.file = _OpenFile(fd, users=1)
        self._open[entry.key] = entry
        while len(self._open) > self.open_files:
            self._close_locked(self._open.popitem(last=False)[1])
        return kept

    def _close_locked(self, entry: Entry) -> None:
        """Let go of ``entry``'s kept file: closed now, or by its last reader."""
        kept = entry.file
        if kept is None:
            return
        entry.file = None
        if self._open.get(entry.key) is entry:
            del self._open[entry.key]
        kept.dropped = True
        if kept.users == 0:
            os.close(kept.fd)

    def _release(self, kept: _OpenFile) -> None:
        """A read is done with ``kept``: close it if it was dropped meanwhile."""
        with self._lock:
            kept.users -= 1
            if kept.dropped and kept.users == 0:
                os.close(kept.fd)

    def open_count(self) -> int:
        """How many block files are kept open (reads in flight may hold dropped ones a little longer)."""
        return len(self._open)

    def close(self) -> None:
        """Close the kept files (those being read, when their reads end); keep no more."""
        with self._lock:
            self._closed = True
            for entry in list(self._open.values()):
                self._close_locked(entry)

    def _evict_until_locked(self, extra: int) -> list[Entry]:
        victims = []
        while self.used + self.reserved + extra > self.capacity:
            entry = self._pop_lru_locked()
            if entry is None:
                break
            self.used -= entry.file_size
            self._memory.drop(entry.key)
            victims.append(entry)
        self.counters.evictions += len(victims)
        return victims

    def _evict_bytes_locked(self, nbytes: int) -> list[Entry]:
        """Evict least recently used blocks until ``nbytes`` are freed (or none are left)."""
        victims = []
        while nbytes > 0:
            entry = self._pop_lru_locked()
            if entry is None:
                break
            self.used -= entry.file_size
            self._memory.drop(entry.key)
            victims.append(entry)
            nbytes -= entry.file_size
        self.counters.evictions += len(victims)
        return victims

    def _disk(self) -> tuple[int, int] | None:
        """``(free, total)`` bytes of the store's filesystem when a free-space
        floor is set (None: no floor, or statvfs failed)."""
        if not self.free_space_ratio:
            return None
        try:
            st = os.statvfs(self.root)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize

    def _disk_room(self) -> int | None:
        """Bytes that may still be written under the free-space floor (None: no floor)."""
        disk = self._disk()
        if disk is None:
            return None
        free, total = disk
        return int(free - self.free_space_ratio * total)

    def floor_report(self) -> str | None:
        """Why fills are refused, naming the floor and the free space, when
        the free space is below the floor now; None when it is not (or no floor)."""
        disk = self._disk()
        if disk is None:
            return None
        free, total = disk
        floor = self.free_space_ratio * total
        if free >= floor:
            return None
        return (
            f"free space on {self.root} is {_gib(free)} ({free / max(total, 1):.1%} of {_gib(total)}), "
            f"below the floor of {self.free_space_ratio:.0%} ({_gib(floor)}) that this store keeps free "
            f"(free_space_ratio): blocks are not cached until the disk has room"
        )

    def _unlink(self, entries: list[Entry]) -> None:
        """Delete the files of ``entries`` (out of the index already), each only
        if the file at its path is still the entry's own (same device and
        inode): once an entry has left the index, a fill of the same key may
        have renamed a good copy onto that path, which is not ours to delete.
        The check and the unlink hold ``_names``, as a fill's rename does, so
        no rename falls between them."""
        for entry in entries:
            path = self._file(entry.key)
            with self._names:
                try:
                    st = os.lstat(path)
                    if (st.st_dev, st.st_ino) == entry.ident:
                        os.unlink(path)
                except FileNotFoundError:
                    pass

    def expire(self) -> int:
        """Delete every block past its volume's TTL (and forget lapsed pins); returns how many."""
        now = self._clock()
        with self._lock:
            self._pins = {k: u for k, u in self._pins.items() if u > now}
            gone = [e for e in self._index.values() if self._expired(e, now)]
            for e in gone:
                self._remove_locked(e)
            self.counters.expired += len(gone)
        self._unlink(gone)
        return len(gone)

    def discard(self, key: BlockKey) -> bool:
        with self._lock:
            self._pins.pop(key, None)
            entry = self._index.get(key)
            if entry is None:
                return False
            self._remove_locked(entry)
        self._unlink([entry])
        return True

    # -- lookups and reads --------------------------------------------------

    def __contains__(self, key: BlockKey) -> bool:
        return self.lookup(key) is not None

    def __len__(self) -> int:
        return len(self._index)

    def cached_keys(self) -> list[BlockKey]:
        with self._lock:
            return list(self._index)

    def in_memory(self, key: BlockKey) -> bool:
        return key in self._memory.blocks

    def lookup(self, key: BlockKey) -> Entry | None:
        """The index entry of ``key`` if cached and not expired (no IO, no LRU touch)."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            if self._expired(entry, self._clock()):
                self._remove_locked(entry)
                self.counters.expired += 1
            else:
                return entry
        self._unlink([entry])
        return None

    def read(
        self,
        key: BlockKey,
        offset: int = 0,
        length: int = -1,
        *,
        nowait: bool = False,
        into: mmap.mmap | None = None,
    ) -> memoryview | None:
        """Bytes ``[offset, offset+length)`` of a cached block, or None on a miss.

        ``length=-1`` reads to the end; a range past the end is clipped.
        ``nowait``: read only what the page cache holds (``RWF_NOWAIT``), so
        that an event loop can read inline and go to a thread only for the
        disk; nothing is counted or touched when it raises ``WouldBlock``.

        Raises:
            InvalidArgument: a negative offset or length below -1, or an
                offset past the end of the block.
            Corrupt: the cached bytes failed their checksum; the block has
                been dropped, so the next read is a miss.
            WouldBlock: with ``nowait``, the bytes are not all in the page cache.

        ``into``: page-aligned memory nobody else refers to, for a read made
        with ``O_DIRECT`` (``direct_read_min``) if it is large enough; the
        view returned is then of it.
        """
        if offset < 0 or length < -1:
            raise InvalidArgument(f"bad range: offset={offset} length={length}")
        entry = self.lookup(key)
        if entry is None:
            return None
        if offset > entry.size:
            raise InvalidArgument(f"offset {offset} is past the end of the block ({entry.size})")
        end = entry.size if length == -1 else min(entry.size, offset + length)
        with self._lock:
            data = self._memory.blocks.get(key)
            if data is not None:
                self._touch(entry)
                self._memory.blocks.move_to_end(key)
                self.counters.memory_hits += 1
                return memoryview(data)[offset:end]
            promote = (
                self._memory.capacity > 0
                and entry.size <= self._memory.capacity
                and entry.hits + 1 >= self.promote_after
            )
        # File IO outside the lock: one read (or mapping) covering the segments of the range.
        seg = entry.segment_size
        if promote:
            first, last = 0, len(entry.sums)
        else:
            first, last = offset // seg, -(-end // seg)
        lo, hi = first * seg, min(last * seg, entry.size)
        mapped = not nowait and not promote and hi - lo >= self.mmap_min
        if (
            not nowait
            and not promote
            and not mapped
            and 0 < self.direct_read_min <= hi - lo
            and entry.data_offset % ALIGN == 0
            and lo % ALIGN == 0
        ):
            view = self._read_direct(entry, first, last, lo, hi, into)
            if view is not None:
                return view[offset - lo : end - lo]
        kept = None
        if not mapped:  # a lease taken on a kept file would outlive the mapping
            with self._lock:
                kept = self._acquire_locked(entry)
        if kept is not None:
            fd = kept.fd
        else:
            try:
                fd = os.open(self._file(key), os.O_RDONLY)
            except FileNotFoundError:
                with self._lock:  # evicted or unlinked under us: a miss
                    self._remove_locked(entry)
                return None
            if not mapped:
                with self._lock:
                    kept = self._keep_locked(entry, fd)
        try:
            try:
                buf: bytes | bytearray | memoryview | None = None
                if nowait:
                    buf = pread_nowait(fd, hi - lo, entry.data_offset + lo)
                elif mapped:
                    buf = self._map(fd, entry.data_offset + lo, hi - lo)
                if buf is None:
                    buf = os.pread(fd, hi - lo, entry.data_offset + lo)
            except OSError as exc:
                raise IOFailure(f"reading cached block {key.hex()}: {exc}") from exc
            view = self._verified(entry, memoryview(buf), first, last, hi - lo)
        finally:
            if kept is not None:
                self._release(kept)
            else:
                os.close(fd)
        if promote and isinstance(buf, bytes | bytearray):  # a verified private copy, served unchecked
            with self._lock:
                if self._index.get(key) is entry:
                    self._memory.add(key, buf)
        return view[offset - lo : end - lo]

    def _verified(self, entry: Entry, view: memoryview, first: int, last: int, length: int) -> memoryview:
        """``view``, the bytes of segments ``[first, last)`` read from the
        entry's file, counted as a hit if ``length`` long and matching their
        checksums; else the block is dropped and ``Corrupt`` raised. Called
        with the file still open when read through a kept descriptor: its
        inode number cannot have been given to another file meanwhile (see
        ``_unlink``)."""
        with self._lock:
            self._touch(entry)
            self.counters.flash_hits += 1
        seg = entry.segment_size
        ok = len(view) == length and all(
            checksum(view[(i - first) * seg : (i - first + 1) * seg]) == entry.sums[i]
            for i in range(first, last)
        )
        if not ok:
            with self._lock:
                self._remove_locked(entry)
                self.counters.corrupt += 1
            self._unlink([entry])
            log.warning("cache store: block %s failed its checksum, dropped", entry.key.hex())
            raise Corrupt(f"cached block {entry.key.hex()} failed its checksum")
        return view

    def _read_direct(
        self, entry: Entry, first: int, last: int, lo: int, hi: int, into: mmap.mmap | None
    ) -> memoryview | None:
        """Bytes ``[lo, hi)`` (``lo`` page-aligned) of the entry's block,
        segments ``[first, last)``, verified: read with ``O_DIRECT`` into
        ``into`` or fresh page-aligned memory, so that the disk writes the caller's buffer
        itself, with no copy out of the page cache and no second copy of the
        block kept there (a client's L2 block is then in L1 already). None
        where it cannot be done: the file is gone (the caller's own open then
        finds that out), or the filesystem refuses O_DIRECT (tmpfs), which
        turns direct reads off for this store. Raises as :meth:`_verified`."""
        key = entry.key
        try:
            fd = os.open(self._file(key), os.O_RDONLY | _O_DIRECT)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise IOFailure(f"reading cached block {key.hex()}: {exc}") from exc
            log.info("cache store %s: the filesystem refuses O_DIRECT; reading through the page cache", self.root)
            self.direct_read_min = 0
            return None
        try:
            size = _align(hi - lo)
            buf = into if into is not None and len(into) >= size else aligned_buffer(size)
            try:
                got = os.preadv(fd, [memoryview(buf)[:size]], entry.data_offset + lo)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise IOFailure(f"reading cached block {key.hex()}: {exc}") from exc
                log.info("cache store %s: an O_DIRECT read was refused (%s); reading through the page cache",
                         self.root, exc)  # fmt: skip
                self.direct_read_min = 0
                return None
            # Verified with the file still open: see _verified.
            return self._verified(entry, memoryview(buf)[: min(got, hi - lo)], first, last, hi - lo)
        finally:
            os.close(fd)

    def _touch(self, entry: Entry) -> None:
        """A hit on ``entry``: most recently used, one more hit (under the lock)."""
        if self._index.get(entry.key) is entry:
            self._index.move_to_end(entry.key)
        entry.hits += 1

    @staticmethod
    def _map(fd: int, start: int, length: int) -> memoryview | None:
        """``length`` bytes at ``start`` of a block file, mapped under a read lease.

        None when no lease can be had (the caller reads a copy instead). The
        lease is taken on ``fd`` before mapping; the mapping keeps a duplicate
        of ``fd``, so the lease lasts exactly as long as the mapping (the last
        view of it released), whatever the caller does with ``fd``. Lease
        breaks signal nobody (``F_SETOWN`` 0): SIGIO would kill the process.
        Taking the lease makes this process the file's owner, though, until
        ``F_SETOWN`` 0 runs; a truncation in between sent SIGIO and killed a
        cache node (5 of about 67 runs of tests/cachenode/test_cache_truncate.py:
        exit status -29). So the signal is first set to SIGURG, which a
        process ignores unless it asks for it.
        """
        if _F_SETLEASE is None:  # not Linux
            return None
        try:
            if _F_SETSIG is not None:
                fcntl.fcntl(fd, _F_SETSIG, signal.SIGURG)
            fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
        except OSError:  # open for writing elsewhere, no lease support, not our file
            return None
        try:
            fcntl.fcntl(fd, fcntl.F_SETOWN, 0)
            size = os.fstat(fd).st_size  # cannot shrink from here on
            if size < start + length:
                return memoryview(b"")  # truncated already: fails the length check, dropped
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=mmap.PROT_READ)
        except BaseException:
            fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
            raise
        return memoryview(m)[start : start + length]

    # -- fills ---------------------------------------------------------------

    def put(self, volume: str, key: BlockKey, data: bytes | bytearray | memoryview) -> bool:
        """Cache a block; False if it is already cached or being written.

        Raises:
            NoSpace: the block does not fit even after evicting every
                unreserved block (the caller serves it uncached).
            IOFailure: the file could not be written.
        """
        sums = segment_sums(data, self.segment_size)
        direct = 0 < self.direct_min <= len(data)
        header = encode_header(volume, len(data), self.segment_size, sums, FLAG_ALIGNED if direct else 0)
        data_offset = _align(len(header)) if direct else len(header)
        file_size = data_offset + len(data)
        room = self._disk_room()  # statvfs outside the lock: it is a syscall
        with self._lock:
            if key in self._writing:
                return False
            entry = self._index.get(key)
            if entry is not None and not self._expired(entry, self._clock()):
                return False
            if file_size > self.capacity:
                raise NoSpace(f"block of {file_size} bytes is larger than the cache")
            if self.reserved + file_size > self.capacity:
                raise NoSpace("cache space is reserved by fills in progress")
            victims = self._evict_until_locked(file_size)
            if self.used + self.reserved + file_size > self.capacity:  # the rest is pinned
                for v in reversed(victims):  # nothing is unlinked yet: put them back, oldest first
                    self._index[v.key] = v
                    self._index.move_to_end(v.key, last=False)
                self.used += sum(v.file_size for v in victims)
                self.counters.evictions -= len(victims)
                raise NoSpace("the cache is full of pinned blocks")
            if room is not None:  # the free-space floor: evict what the disk lacks too
                short = file_size + self.reserved - room - sum(v.file_size for v in victims)
                more = self._evict_bytes_locked(short)
                victims += more
                below_floor = short > sum(v.file_size for v in more)
            else:
                below_floor = False
            if below_floor:
                self.counters.below_floor += 1
            else:
                # No IO between the checks above and these lines: the reservation is atomic.
                self.reserved += file_size
                self._writing.add(key)
        self._unlink(victims)  # before writing, so disk usage never exceeds the capacity
        if below_floor:
            raise NoSpace(self.floor_report() or f"free space on {self.root} is below the floor",
                          floor=self.free_space_ratio)  # fmt: skip
        tmp = self._tmp_dir / f"{key.hex()}.{uuid.uuid4().hex[:8]}"
        try:
            if not (direct and self._write_direct(tmp, header, data_offset, data)):
                self._write_buffered(tmp, header, data_offset, data)
            st = os.stat(tmp)
            with self._names:  # never between a removal's check and its unlink
                os.rename(tmp, self._file(key))
        except OSError as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            with self._lock:
                self.reserved -= file_size
                self._writing.discard(key)
            raise IOFailure(f"writing cached block {key.hex()}: {exc}") from exc
        entry = Entry(
            key,
            volume,
            len(data),
            file_size,
            data_offset,
            self.segment_size,
            array("Q", sums),
            self._clock(),
            ident=(st.st_dev, st.st_ino),
        )
        with self._lock:
            self.reserved -= file_size
            self._writing.discard(key)
            old = self._index.pop(key, None)
            if old is not None:  # an expired copy: the rename replaced its file
                self.used -= old.file_size
                self._memory.drop(key)
                self._close_locked(old)
            self._index[key] = entry
            self.used += file_size
        return True

    @staticmethod
    def _write_buffered(path: Path, header: bytes, data_offset: int, data: bytes | bytearray | memoryview) -> None:
        """The block file in one ``writev`` through the page cache."""
        pieces = [header + bytes(data_offset - len(header)), memoryview(data)]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            written, total = os.writev(fd, pieces), data_offset + len(data)
            while written < total:  # short writes are rare but legal
                head = pieces[0]
                rest = [head[written:]] if written < len(head) else []
                written += os.writev(fd, [*rest, pieces[1][max(0, written - len(head)) :]])
        finally:
            os.close(fd)

    def _write_direct(self, path: Path, header: bytes, data_offset: int, data: bytes | bytearray | memoryview) -> bool:
        """The block file with O_DIRECT, from a reused page-aligned buffer (see
        the module docstring); False when the filesystem refuses O_DIRECT,
        which then turns it off for this store (the caller writes buffered)."""
        size = data_offset + len(data)
        total = _align(size)
        with self._lock:
            scratch = next((m for m in self._scratch if len(m) >= total), None)
            if scratch is not None:
                self._scratch.remove(scratch)
        if scratch is None:
            scratch = mmap.mmap(-1, max(total, _align(DIRECT_MIN + ALIGN)))  # anonymous: page-aligned
        try:
            buf = memoryview(scratch)
            buf[: len(header)] = header
            buf[len(header) : data_offset] = bytes(data_offset - len(header))
            buf[data_offset:size] = data
            buf[size:total] = bytes(total - size)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.info("cache store %s: the filesystem refuses O_DIRECT; writing through the page cache", self.root)
                self.direct_min = 0
                return False
            try:
                written = 0
                while written < total:
                    written += os.write(fd, buf[written:total])
                os.ftruncate(fd, size)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.info("cache store %s: an O_DIRECT write was refused (%s); writing through the page cache",
                         self.root, exc)
                self.direct_min = 0
                return False
            finally:
                os.close(fd)
            del buf
        finally:
            with self._lock:
                if len(self._scratch) < _SCRATCH_KEPT:
                    self._scratch.append(scratch)
        return True

    # -- reporting -------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        with self._lock:
            c = self.counters
            return {
                "capacity": self.capacity,
                "used": self.used,
                "reserved": self.reserved,
                "blocks": len(self._index),
                "pins": len(self._pins),
                "memory_capacity": self._memory.capacity,
                "memory_used": self._memory.used,
                "memory_blocks": len(self._memory.blocks),
                "evictions": c.evictions,
                "expired": c.expired,
                "corrupt": c.corrupt,
                "discarded_on_open": c.discarded_on_open,
                "memory_hits": c.memory_hits,
                "flash_hits": c.flash_hits,
                "below_floor": c.below_floor,
            }
