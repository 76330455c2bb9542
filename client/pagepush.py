"""Small files fetched ahead go straight into the kernel's page cache.

Directory readahead (:mod:`.dirahead`) brings a data loader's next files
into L1 before they are opened. Their reads would still each be a FUSE
round trip: a request to the mount, a handler, a reply that copies the
bytes. Pushed with ``notify_store`` as they land, the kernel has them when
the file is opened, and the open's ``keep_cache`` keeps them (as on a
second epoch, where no read reaches the mount).

Correctness rests on the rule ``open`` already keeps (:mod:`.fs`): pages
survive an open only when ``Inode.cached_version`` is the version that the
open's fresh attributes (close-to-open, or a valid lease) carry. A push
writes the whole file, ``[0, size)``, of the version its chunk 0 slice list
was read at, and then sets ``cached_version`` to that version. If the file
changes after the push, the next open sees another version and the kernel
drops the pages; nothing pushed is served across a change.

A push is offered twice: when the block lands (:meth:`PagePush.offer`,
told by directory readahead), and again at the file's read-only open if it
was fetched ahead and not pushed yet (``opening``). The second is the common
one when the kernel forgot the inode after the listing (memory pressure, a
dropped cache, a loader that lists the dataset long before its epoch): the
block landed while the kernel had nothing to push into. Pushed inside the
open handler, before its reply, the pages are there before the first read
is issued, and the reply's ``keep_cache`` keeps them.

A push is made only when nothing else can be in the inode's pages:

- no handle of this mount has it open (no reads or writes in flight, no
  dirty pages: a writer's close commits and the kernel writes back first),
  and no writer holds uncommitted bytes; at an open, that open is the only
  one, and its handle is not yet the kernel's (no request can use it
  before the reply);
- the kernel knows the inode (``lookups``: a ``readdirplus`` or lookup told
  it), or there is nothing to push into;
- the pages it may hold are of that very version or none
  (``cached_version`` unset), so a push never mixes versions;
- it was not pushed already since its last open (``Inode.pushed``): a
  block fetched again after an eviction brings the same bytes.

It runs on the trio thread, synchronously. ``notify_store`` waits only for
pages locked by requests in flight, and with no handle open no request of
the inode can be in flight; and an ``open`` cannot run between the push and
the setting of ``cached_version``. A push that fails leaves
``cached_version`` as it was, so the next open drops whatever landed.
Only files of one chunk up to a block are pushed (a data loader's samples);
every byte comes from L1, never fetched for the push.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable

from cachefs.ids import CHUNK_SIZE
from cachefs.layout import HOLE, resolve, segment_blocks

from .inodes import Inode, InodeTable
from .l1 import Block, L1Cache

log = logging.getLogger(__name__)

Notify = Callable[[int, int, "bytes | bytearray | memoryview"], None]


class PagePush:
    """Pushes small files whose blocks are all in L1 into the page cache."""

    def __init__(self, inodes: InodeTable, l1: L1Cache, block_size: int, notify: Notify) -> None:
        self.inodes = inodes
        self.l1 = l1
        self.block_size = block_size
        self.limit = min(block_size, CHUNK_SIZE)  # the largest file pushed
        self._notify = notify
        self.enabled = True
        self.stats = {"page_pushes": 0, "page_push_bytes": 0, "page_push_failures": 0}

    def offer(self, ino: int, *, opening: bool = False) -> bool:
        """Push ``ino``'s pages if every rule above allows it; whether it did.
        ``opening``: from inside a read-only open of it, before the reply."""
        inode = self.inodes.get(ino)
        if not self.enabled or inode is None or not self._pushable(inode, opening):
            return False
        data = self._bytes(inode)
        if data is None:
            return False
        try:
            self._notify(ino, 0, data)
        except OSError as exc:
            self.stats["page_push_failures"] += 1
            if exc.errno == errno.ENOSYS:  # a kernel without FUSE_NOTIFY_STORE
                self.enabled = False
                log.info("the kernel does not take pages pushed to it: reads go through the mount")
            else:  # ENOENT: the kernel forgot the inode meanwhile
                log.debug("page push of inode %d: %s", ino, exc)
            return False
        inode.cached_version = inode.attr.version
        inode.pushed = True
        self.stats["page_pushes"] += 1
        self.stats["page_push_bytes"] += len(data)
        return True

    def _pushable(self, inode: Inode, opening: bool) -> bool:
        attr = inode.attr
        return (
            inode.lookups > 0
            and not inode.pushed
            and inode.opens == (1 if opening else 0)
            and inode.writer is None
            and attr.is_reg
            and 0 < attr.size <= self.limit
            and inode.cached_version in (None, attr.version)
        )

    def _bytes(self, inode: Inode) -> bytes | bytearray | memoryview | None:
        """``[0, size)`` of the version chunk 0's cached list was read at,
        from L1 alone; None if the list is stale or a block is not there."""
        size = inode.attr.size
        cached = inode.chunks.get(0)
        if cached is None or cached[0] != (inode.attr.version, inode.layout):
            return None
        parts: list[tuple[int, Block | None, int, int]] = []  # (file offset, block, offset in it, length)
        for seg in resolve(cached[1], 0, size):
            if seg.slice_id == HOLE:
                parts.append((seg.pos, None, 0, seg.length))
                continue
            for part in segment_blocks(seg, self.block_size):
                block = self.l1.peek(part.key)
                if block is None or len(block) < part.block_off + part.length:
                    return None
                parts.append((part.pos, block, part.block_off, part.length))
        if len(parts) == 1 and parts[0][1] is not None and parts[0][0] == 0 and parts[0][3] == size:
            _, block, lo, n = parts[0]
            return memoryview(block)[lo : lo + n]  # the common case: one block, no copy
        out = bytearray(size)  # holes stay zero
        for at, block, lo, n in parts:
            if block is not None:
                out[at : at + n] = memoryview(block)[lo : lo + n]
        return out
