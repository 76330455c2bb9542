"""The client's inode table: attributes, kernel lookup counts, open handles.

Lookup counts are exact: :meth:`InodeTable.learn` is called once for every
reply that tells the kernel about an inode (lookup, create, mkdir, mknod,
symlink, link, and each readdirplus entry the kernel accepted), and counts
drop only in ``forget``. An inode leaves the table when the kernel forgot it
and no handle has it open, so an unlinked file that is still open keeps its
attributes (and its data, which the metanodes keep for our session) until the
last close. The native API has no kernel and counts no lookups: an inode is
in its table while a file of it is open there or one of its reads runs
(``update``, then ``drop_if_idle``).

``cached_version`` is the content version the kernel's page cache holds for
the inode: open() keeps the cache (``keep_cache``) only when the metanodes
still report that version.

The slice lists of an inode that leaves the table are kept (bounded, LRU)
with its content version: a data loader's next epoch finds the kernel has
forgotten the file (dentries are evicted, or the page cache was dropped), and
when the file comes back at the same version its lists are still right, so
its reads need no ``read_chunk``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cachefs.messages import Attr

if TYPE_CHECKING:
    from cachefs.layout import Slice

    from .writer import FileWriter

ROOT_INODE = 1  # pyfuse3.ROOT_INODE, the FUSE root (the kernel never forgets it)
GHOSTS = 16384  # inodes whose slice lists are kept after they leave the table


@dataclass(slots=True)
class Inode:
    attr: Attr
    lookups: int = 0
    opens: int = 0
    cached_opens: int = 0  # open handles that go through the page cache (not O_DIRECT)
    cached_version: int | None = None
    pushed: bool = False  # its pages were pushed to the kernel (pagepush.py) and no open has used them yet
    # chunk index -> ((content version, layout) it was read at, slice list)
    chunks: dict[int, tuple[tuple[int, int], list[Slice]]] = field(default_factory=dict)
    # Bumped when a chunk's slices change without a version change (compaction,
    # our own commits), so a slice list fetched before that is not cached.
    layout: int = 0
    writer: FileWriter | None = None
    # Extended attributes read here: name -> (when, value or None for "none"),
    # and when they were last voided (a getxattr older than that is not kept).
    xattrs: dict[bytes, tuple[float, bytes | None]] = field(default_factory=dict)
    xattrs_voided: float = 0.0
    # When the metanodes said it had no extended attributes at all (its
    # create's answer, leased or not); 0.0: not known.
    bare: float = 0.0
    # A file created here empty: the lease it was created under (an object
    # of the session's LeaseCache) and our commits per chunk since. While
    # that very lease is held no one else wrote the file, so a chunk has at
    # most that many slices, and the compactor need not read its list to
    # know it is below the threshold. None once anything else changed it.
    born: object | None = None
    commits: dict[int, int] = field(default_factory=dict)

    @property
    def ino(self) -> int:
        return self.attr.ino

    def set_attr(self, attr: Attr) -> None:
        """Take newer attributes (fresh from the metanodes); a content change
        drops the cached slice lists."""
        if attr.version != self.attr.version:
            self.chunks.clear()
            self.layout += 1
        self.attr = attr

    def void_xattrs(self) -> None:
        self.xattrs.clear()
        self.xattrs_voided = time.monotonic()
        self.bare = 0.0

    @property
    def size(self) -> int:
        """The size readers see: committed size, grown by pending writes."""
        if self.writer is not None:
            return max(self.attr.size, self.writer.pending_end())
        return self.attr.size

    @property
    def idle(self) -> bool:
        return (
            self.lookups <= 0 and self.opens <= 0 and (self.writer is None or not self.writer.dirty)
        )


class InodeTable:
    """Inodes the kernel knows (or has open), by number."""

    def __init__(self, ghosts: int = GHOSTS) -> None:
        self._inodes: dict[int, Inode] = {}
        # ino -> (content version, chunk -> slice list) of inodes that left
        self._ghosts: OrderedDict[int, tuple[int, dict[int, list[Slice]]]] = OrderedDict()
        self._max_ghosts = ghosts

    def __len__(self) -> int:
        return len(self._inodes)

    @property
    def ghosts(self) -> int:
        """Inodes that left the table and keep their slice lists."""
        return len(self._ghosts)

    def __contains__(self, ino: int) -> bool:
        return ino in self._inodes

    def get(self, ino: int) -> Inode | None:
        return self._inodes.get(ino)

    def update(self, attr: Attr) -> Inode:
        """Record attributes without counting a lookup (getattr, setattr)."""
        inode = self._inodes.get(attr.ino)
        if inode is None:
            inode = self._inodes[attr.ino] = Inode(attr)
            ghost = self._ghosts.pop(attr.ino, None)
            if ghost is not None and ghost[0] == attr.version:
                stamp = (attr.version, inode.layout)
                inode.chunks = {chunk: (stamp, slices) for chunk, slices in ghost[1].items()}
        else:
            inode.set_attr(attr)
        return inode

    def learn(self, attr: Attr) -> Inode:
        """The kernel was told about this inode: one more lookup to forget later."""
        inode = self.update(attr)
        inode.lookups += 1
        return inode

    def forget(self, ino: int, count: int) -> None:
        inode = self._inodes.get(ino)
        if inode is None:
            return
        inode.lookups -= count
        self.drop_if_idle(inode)

    def drop_if_idle(self, inode: Inode) -> None:
        """Let ``inode`` leave the table if nothing holds it (lookups, opens,
        dirty data). An object that already left (a native API read that
        ended after another one) never takes its successor with it."""
        if inode.idle and inode.ino != ROOT_INODE and self._inodes.get(inode.ino) is inode:
            del self._inodes[inode.ino]
            stamp = (inode.attr.version, inode.layout)
            valid = {chunk: sl for chunk, (st, sl) in inode.chunks.items() if st == stamp}
            if valid and self._max_ghosts > 0:
                self._ghosts[inode.ino] = (inode.attr.version, valid)
                self._ghosts.move_to_end(inode.ino)
                while len(self._ghosts) > self._max_ghosts:
                    self._ghosts.popitem(last=False)

    def all(self) -> list[Inode]:
        return list(self._inodes.values())
