"""Readahead across the small files of a directory: a data loader's next files.

A data loader reads a dataset of small files (one block each) in shuffled
order. Every file is then a demand miss, and readahead within a file (the
kernel's, :class:`~.reader.Readahead`) never starts the next file's fetch:
a cold epoch costs one round trip per file through the cache node to the
datanodes or the object store, only as many at a time as the loader has
workers (profile of ``bench.repo_bench``, cold: 200 fills of 110 KiB objects
averaged 121 ms each at the cache node with 4 in flight, while the mount
and the cache node were mostly idle), and a warm one a ``get`` per file.
Fetching the next files of the same directory while the loader decodes the
current ones is what Alluxio's and JuiceFS's directory prefetch, and FSx
for Lustre's batched loads, do.

How it works: a ``readdir`` (``LoadDir``) brings chunk 0's slice list of
every small file with the listing, so the block keys of a directory's files
are known before any of them is opened. :meth:`DirReadahead.listed` keeps,
per directory, the small files with data (written into the volume or
imported from a linked bucket) in listing order. An open that has to fetch
its file's first block (:meth:`missed`: not in L1, not in flight) starts
whole-block prefetches
(:meth:`.reader.Reader.prefetch_block`, into L1, through the cache tier) of
the next ``per_miss`` files after a per-directory cursor, skipping what L1
holds or is fetching; a read that then uses a block fetched this way starts
one more in its directory (:meth:`used`; they are started half a window
at a time, so that the blocks of a top-up travel together), so the window
stays between half full and full while the loader consumes it. Wanted
blocks go to the reader together (:meth:`.reader.Reader.prefetch_many`):
one ``get_many`` per owning cache node, not one ``get`` per file (a warm
epoch of small files otherwise costs a round trip, ~1 ms of Python CPU on
both ends, per file). The cursor wraps: a later epoch whose blocks L1 has
dropped gets them fetched ahead again.

The window shrinks when blocks fetched ahead are evicted unread, and grows
back as they are read (:meth:`_reclaim`).

Bounds: prefetched blocks not read yet take at most L1's free room and
``budget`` bytes more (a quarter of L1 by default): filling free room evicts
nothing, and past it they may displace at most ``budget`` of what L1 held
(a shuffled epoch keeps each directory's window waiting for its turn, and a
fixed quarter of L1 ran dry with most of L1 empty: in a warm epoch of
2,000 files in 20 directories on a lab mount, 265 opens had to fetch their
own block, and 80 with the room counted). At most ``per_miss`` prefetches
are started per miss (the extra traffic is a bounded multiple of the
demand, and all of it is of files the loader has listed), the reader's
mount-wide prefetch limit bounds how many run at once, and at most
``max_files`` files are remembered over all directories, and at most
``MAX_DIRS`` directories (oldest directories forgotten first).

Correctness: nothing here decides what a read returns. Blocks are immutable
and keyed by slice id (a written slice is never rewritten, and an imported
file's slice is tied to its object's content version), so a block fetched
ahead is only ever used by a read that resolved the same key from the
inode's current slice list; a file changed
after the listing reads its new version's blocks, and the old ones only age
out of L1.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cachefs.ids import BlockKey
from cachefs.layout import Slice, block_keys

if TYPE_CHECKING:
    from .reader import Reader


PER_MISS = 32  # files fetched ahead by one demand miss (the window; it halves on waste, see _reclaim)
MAX_FILES = 1 << 18  # files remembered over all directories
MAX_DIRS = 4096  # directories remembered (those without small files count too)
SCAN = 4  # entries looked at per prefetch wanted (the rest are in L1 or on their way)


@dataclass(slots=True)
class _Dir:
    files: list[tuple[int, tuple[BlockKey, ...], int]] = field(default_factory=list)  # (ino, keys, bytes)
    cursor: int = 0


class DirReadahead:
    """Per mount: the small files of listed directories, and their prefetch."""

    def __init__(self, reader: Reader, *, budget: int, per_miss: int = PER_MISS,
                 max_files: int = MAX_FILES) -> None:  # fmt: skip
        self.reader = reader
        self.budget = budget
        self.per_miss = per_miss
        self.max_files = max_files
        self._dirs: OrderedDict[int, _Dir] = OrderedDict()
        self._where: dict[int, int] = {}  # file ino -> directory ino
        self._files = 0
        self._pending: dict[BlockKey, tuple[int, int, int]] = {}  # fetched ahead, unread: key -> (dir, bytes, file)
        self._pending_bytes = 0
        self._ahead: dict[int, int] = {}  # file ino -> its blocks in _pending
        self.window = per_miss  # files fetched ahead per miss now: per_miss, less after waste (see _reclaim)
        self._owed: dict[int, int] = {}  # dir -> files used since its window was last topped up
        self.stats = {"dir_prefetches": 0, "dir_prefetches_used": 0, "dir_prefetches_wasted": 0}
        # Told the file (ino) of each block fetched ahead that lands in L1 (the
        # mount pushes it into the page cache: pagepush.py).
        self.on_landed: Callable[[int], object] | None = None

    @property
    def enabled(self) -> bool:
        return self.budget > 0 and self.per_miss > 0

    def knows(self, dir_ino: int) -> bool:
        """Whether ``dir_ino``'s listing is remembered (so a listing the
        kernel keeps, which never reaches :meth:`listed`, loses nothing)."""
        return dir_ino in self._dirs

    def listed(self, dir_ino: int, files: list[tuple[int, int, list[Slice]]], *, restart: bool) -> None:
        """A page of ``dir_ino``'s listing: (ino, size, chunk 0's slices) of
        its small regular files; ``restart``: the listing's first page (what
        was known of the directory is replaced)."""
        if not self.enabled:
            return
        d = self._dirs.get(dir_ino)
        if d is None or restart:
            if d is not None:
                self._drop(dir_ino, d)
            d = self._dirs[dir_ino] = _Dir()
        self._dirs.move_to_end(dir_ino)
        bs = self.reader.source.block_size
        for ino, size, slices in files:
            if not size or ino in self._where:
                continue
            keys = block_keys(slices, 0, min(size, bs), bs)
            if not keys:
                continue
            d.files.append((ino, tuple(keys), min(size, bs)))
            self._where[ino] = dir_ino
            self._files += 1
        while (self._files > self.max_files or len(self._dirs) > MAX_DIRS) and len(self._dirs) > 1:
            old, od = next(iter(self._dirs.items()))
            self._drop(old, od)

    def _drop(self, dir_ino: int, d: _Dir) -> None:
        self._owed.pop(dir_ino, None)
        for ino, _keys, _n in d.files:
            if self._where.get(ino) == dir_ino:
                del self._where[ino]
        self._files -= len(d.files)
        del self._dirs[dir_ino]

    @property
    def refill(self) -> int:
        """Files used before a directory's window is topped up (see :meth:`used`)."""
        return max(1, self.window // 2)

    def missed(self, ino: int) -> None:
        """An open of ``ino`` has to fetch its first block: fetch its
        directory's next files too."""
        dir_ino = self._where.get(ino)
        if dir_ino is not None:
            self._start(dir_ino, self.window, skip=ino)

    def used(self, key: BlockKey) -> None:
        """A read used ``key`` (a block the reader prefetched): if it was one
        of ours, its room is free again and one more file is owed to its
        directory's window; once :attr:`refill` (half the window) are owed,
        they are fetched ahead together (one batch per cache node, see
        :meth:`.reader.Reader.prefetch_many`: topping up one file at a time
        would cost one round trip per file again)."""
        got = self._forget(key)
        if got is None:
            return
        dir_ino = got[0]
        self.stats["dir_prefetches_used"] += 1
        if dir_ino in self._dirs:
            owed = self._owed.pop(dir_ino, 0) + 1
            if self.window < self.per_miss:
                self.window += 1  # prefetches are being read: let the window grow back
            if owed >= self.refill:
                self._start(dir_ino, owed)
            else:
                self._owed[dir_ino] = owed

    def fetched_ahead(self, ino: int) -> bool:
        """Whether blocks of file ``ino`` were fetched ahead here and no read
        has used them yet (they may still be on their way)."""
        return ino in self._ahead

    def _forget(self, key: BlockKey) -> tuple[int, int, int] | None:
        got = self._pending.pop(key, None)
        if got is not None:
            self._pending_bytes -= got[1]
            ino = got[2]
            left = self._ahead[ino] - 1
            if left:
                self._ahead[ino] = left
            else:
                del self._ahead[ino]
        return got

    def landed(self, key: BlockKey) -> None:
        """Block ``key`` is in L1 now: if it was fetched ahead here, tell
        :attr:`on_landed` which file it belongs to."""
        got = self._pending.get(key)
        if got is not None and self.on_landed is not None:
            self.on_landed(got[2])

    def _start(self, dir_ino: int, wanted: int, skip: int = 0) -> None:
        d = self._dirs.get(dir_ino)
        if d is None or not d.files:
            return
        reader = self.reader
        batch: list[BlockKey] = []
        started = 0
        for _ in range(min(len(d.files), wanted * SCAN)):
            if wanted <= 0:
                break
            if not self._room():
                if batch:  # on their way first: _reclaim keeps only what is
                    reader.prefetch_many(batch)
                    batch = []
                if not self._reclaim():
                    break
                wanted = min(wanted, self.window - started)  # it may have shrunk the window
                if wanted <= 0:
                    break
            ino, keys, nbytes = d.files[d.cursor]
            d.cursor = (d.cursor + 1) % len(d.files)
            if ino == skip:
                continue
            todo = [k for k in keys if not reader.has_or_fetching(k) and k not in batch]
            if not todo:
                continue
            wanted -= 1
            started += 1
            share = nbytes // len(keys)
            for key in todo:
                self._pending[key] = (dir_ino, share, ino)
                self._pending_bytes += share
                self._ahead[ino] = self._ahead.get(ino, 0) + 1
                self.stats["dir_prefetches"] += 1
                batch.append(key)
        if batch:
            reader.prefetch_many(batch)

    def _reclaim(self) -> bool:
        """Forget pending blocks that are neither in L1 nor on their way
        (evicted unread, or their fetch failed); True if there is room now.

        Such blocks were fetched for nothing (a shuffled epoch over a dataset
        much larger than L1 reads a file long after its neighbours were
        fetched ahead, if ever): the window halves, down to one file a miss,
        and grows back by one with each block fetched ahead that a read uses
        (additive increase, multiplicative decrease, as TCP's window)."""
        reader = self.reader
        wasted = [k for k in self._pending if not reader.has_or_fetching(k)]
        for key in wasted:
            self._forget(key)
        if wasted:
            self.stats["dir_prefetches_wasted"] += len(wasted)
            self.window = max(1, self.window // 2)
        return self._room()

    def _room(self) -> bool:
        """Whether more may be fetched ahead (see the bounds above). Blocks
        fetched ahead that landed count twice, in L1's use and here: the
        bound errs on the side of fewer."""
        return self._pending_bytes < self.budget + self.reader.l1_room()
