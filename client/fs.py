"""The pyfuse3 operations: translate kernel requests into engine calls and metadata requests.

Only handlers live here; the engine of the volume (inodes, L1, reader,
writers, compaction) is :mod:`.volume`; a namespace operation is one command
(:mod:`cachefs.commands`) or query (:mod:`cachefs.queries`) sent through the
session's ``MetaClient``.

Rules every handler keeps:

- Only ``FUSEError`` leaves a handler: any other exception would end pyfuse3's
  main loop and kill the mount. :func:`_fuse` maps the cachefs error tree to
  its errno, and anything unexpected to EIO after logging it with a traceback.
- Lookup counts are exact (see :mod:`.inodes`): ``learn`` is called exactly
  where the kernel learns an inode, and counts drop only in ``forget``.
- Page cache: ``open`` keeps the kernel's cached pages (``keep_cache``) only
  when the inode's content version is the one those pages were read at;
  a version change seen by ``getattr`` drops them with ``invalidate_inode``
  (from a worker thread: it may wait on pages a pending read holds).
- Close-to-open: ``open`` always asks the metanodes for fresh attributes
  (or answers from a valid lease), and ``flush``/``fsync``/``release``
  return only after the data is committed. A read-only open is answered
  with FOPEN_NOFLUSH (:mod:`.noflush_hook`): its close has nothing to
  commit and sends no FLUSH.
  The first open of an inode here gets them from the leader's ``open`` reply
  (one round trip, not a ``getattr`` and an ``open``); meanwhile the first
  chunk's slice list (and, opened read-only, its first block) is fetched,
  which the read that follows joins.
- Leases (:mod:`.leases`): a lookup, getattr or open answered under a valid
  lease comes from memory, and the kernel gets the lease's remaining time
  as its entry and attribute timeouts; the names it learns that way are
  kept with the directory's lease, and when a lease goes (revoked, lapsed
  through a new leader) the kernel's entries and inode are invalidated
  before the revocation is acknowledged (``_leases_lost``). Without a lease
  the timeouts are the mount's options, as below.
- Attribute cache: the kernel drops an inode's attributes after every write
  and asks again on the next read (and asks ``security.capability`` on every
  write); ``getattr`` answers from the lease, else asks the leader, and
  ``getxattr`` answers from the lease (what was read under it, or that a
  file created here has none), else from what the metanodes said less than
  ``attr_timeout`` ago (a create's answer says whether the file has any, so
  the getxattr before each write to a new file costs no round trip even
  when no lease came with it), so its staleness bound stays the one the
  kernel's own attribute cache already has. An xattr change here voids that
  inode's.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from time import perf_counter
from typing import Any, TypeVar

import pyfuse3
import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.errors import CacheFSError, FileTooLarge, NoData, NotFound
from cachefs.layout import MAX_FILE_SIZE
from cachefs.messages import Attr
from cachefs.opstats import OpStats

from . import control
from .control import Control, ControlError, is_control
from .inodes import Inode
from .leases import Lease
from .pagepush import PagePush
from .reader import Readahead
from .volume import Volume

log = logging.getLogger(__name__)

T = TypeVar("T")

READDIR_BATCH = 256
# seconds the lease poll waits for the kernel to drop what lost leases
# covered, before it goes on and leaves the rest to the thread
INVALIDATE_WAIT = 0.5
XATTR_CACHE = 64  # names cached per inode


def entry_attributes(
    attr: Attr, attr_timeout: float, entry_timeout: float, block_size: int = 4096
) -> pyfuse3.EntryAttributes:
    """The kernel's view of ``attr``."""
    e = pyfuse3.EntryAttributes()
    e.st_ino = attr.ino
    e.generation = attr.generation
    e.st_mode = attr.mode
    e.st_nlink = attr.nlink
    e.st_uid = attr.uid
    e.st_gid = attr.gid
    e.st_rdev = attr.rdev
    e.st_size = attr.size
    e.st_blksize = block_size
    e.st_blocks = attr.blocks
    e.st_atime_ns = attr.atime_ns
    e.st_mtime_ns = attr.mtime_ns
    e.st_ctime_ns = attr.ctime_ns
    e.attr_timeout = attr_timeout
    e.entry_timeout = entry_timeout
    return e


def _invalidate_all(lost: list[tuple[int, tuple[bytes, ...]]]) -> None:
    """The kernel forgets the names and inodes (see ``CacheFS._leases_lost``);
    what it no longer knows is skipped."""
    for ino, names in lost:
        for name in names:
            try:
                pyfuse3.invalidate_entry(ino, name)
            except OSError:
                pass
        try:
            pyfuse3.invalidate_inode(ino)
        except OSError:
            pass


def _fuse(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Map every error of a handler to FUSEError (see module docstring), and
    time it into the mount's :class:`OpStats` (errors counted by errno) and,
    while someone reads it, the access log (:mod:`.control`)."""
    op = fn.__name__

    @functools.wraps(fn)
    async def handler(self: CacheFS, *args: Any, **kwargs: Any) -> T:
        started = perf_counter()
        code = 0
        try:
            return await fn(self, *args, **kwargs)
        except pyfuse3.FUSEError as exc:
            code = exc.errno
            raise
        except (CacheFSError, ControlError) as exc:
            code = exc.errno
            if code == errno.EIO:
                log.error("%s failed: %s", op, exc)
            raise pyfuse3.FUSEError(code) from None
        except Exception:
            log.exception("unexpected error in %s", op)
            code = errno.EIO
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            seconds = perf_counter() - started
            self.op_stats.observe(op, seconds)
            if code:
                self.op_stats.error(op, code)
            if self.control.access.readers:
                self.control.access.record(op, args, seconds, code)

    return handler


@dataclass(slots=True)
class Handle:
    inode: Inode
    flags: int
    readahead: Readahead
    wrote: bool = False

    @property
    def direct(self) -> bool:
        """Opened with O_DIRECT: served with FOPEN_DIRECT_IO (see ``open``)."""
        return bool(self.flags & os.O_DIRECT)


class CacheFS(pyfuse3.Operations):
    """One mounted volume."""

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, engine: Volume) -> None:
        super().__init__()
        self.engine = engine
        self.op_stats = OpStats()
        self.session = engine.session
        self.meta = engine.session.meta
        self.vol = engine.session.volume  # the volume's name, in every request
        self.options = engine.options
        self.inodes = engine.inodes
        self.reader = engine.reader
        self.nursery = engine.nursery
        self._handles: dict[int, Handle] = {}
        self._dirs: dict[int, int] = {}
        # Directory handles whose listing reached its end: the cookie of its
        # last entry (see readdir).
        self._dir_ends: dict[int, int] = {}
        self._emptying: set[int] = set()  # directories whose kernel listing is being dropped
        self._next_fh = 1
        self.session.enable_leases(self.nursery, self._leases_lost)
        self.leases = self.session.leases
        self.control = Control(render_stats=lambda: b"")  # the mount sets its collector's text
        self.pages: PagePush | None = None  # small files fetched ahead, into the page cache
        ahead = self.reader.dirahead
        if ahead is not None and ahead.enabled and self.options.push_pages:
            self.pages = PagePush(self.inodes, self.reader.l1, self.session.block_size, pyfuse3.notify_store)
            ahead.on_landed = self.pages.offer

    # ------------------------------------------------------------------ helpers

    def _entry(
        self, inode: Inode, attr_timeout: float | None = None, entry_timeout: float | None = None
    ) -> pyfuse3.EntryAttributes:
        attr = inode.attr
        writer = inode.writer
        if writer is not None and (writer.buffered or inode.size != attr.size):
            # bytes written here and not yet committed count as ext4's delayed allocations do
            attr = attr._replace(size=inode.size, blocks=attr.blocks + (writer.buffered + 4095) // 4096 * 8)
        return entry_attributes(
            attr,
            self.options.attr_timeout if attr_timeout is None else attr_timeout,
            self.options.entry_timeout if entry_timeout is None else entry_timeout,
            self.session.block_size,
        )

    def _lease_left(self, lease: Lease | None, now: float, default: float) -> float:
        """The kernel's timeout for what ``lease`` covers."""
        if lease is None:
            return default
        return max(default, self.leases.remaining(lease, now))

    def _control_entry(self, attr: Attr) -> pyfuse3.EntryAttributes:
        return entry_attributes(attr, self.options.attr_timeout, self.options.entry_timeout)

    def _made(self, parent_inode: int, name: bytes, inode: Inode) -> pyfuse3.EntryAttributes:
        """The answer to a create, mknod, mkdir, symlink or link here: the
        kernel keeps the new name while the directory's lease lasts, when
        the name is known under it (the session kept it: no other own change
        of the directory overlapped), and the attributes while the inode's
        lease holds them; the name is in the lease's ``kernel_names``, so it
        is invalidated with the lease. A stat of a file just written then
        needs no lookup once the mount's entry timeout has passed."""
        now = time.monotonic()
        leases = self.leases
        parent = leases.get(parent_inode, now)
        if parent is not None and parent.entries.get(name) != inode.ino:
            parent = None
        child = leases.get(inode.ino, now)
        if child is not None and child.attr is not inode.attr:
            child = None
        return self._entry(
            inode,
            self._lease_left(child, now, self.options.attr_timeout),
            self._lease_left(parent, now, self.options.entry_timeout),
        )

    def _fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    def _writable(self) -> None:
        if self.options.read_only:
            raise pyfuse3.FUSEError(errno.EROFS)

    def _owner(self, parent: int, ctx: pyfuse3.RequestContext, mode: int) -> tuple[int, int, int]:
        """uid, gid and mode of a new inode: BSD group semantics under a setgid dir."""
        gid = ctx.gid
        parent_inode = self.inodes.get(parent)
        if parent_inode is not None and parent_inode.attr.mode & stat.S_ISGID:
            gid = parent_inode.attr.gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        return ctx.uid, gid, mode

    # ------------------------------------------------------------------ lookups

    @_fuse
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        if parent_inode == pyfuse3.ROOT_INODE and name == control.NAME:
            return self._control_entry(self.control.attr(control.DIR_INO))
        if is_control(parent_inode):
            return self._control_entry(self.control.lookup(parent_inode, name))
        if len(name) > C.NAME_MAX:  # as ext4 answers (pjdfstest */02.t): no such name can exist
            raise pyfuse3.FUSEError(errno.ENAMETOOLONG)
        leases = self.leases
        now = time.monotonic()
        parent = leases.get(parent_inode, now)
        if parent is not None:
            ino = parent.entries.get(name)
            if ino is None and parent.complete:  # every name of the directory is known: not this one
                leases.stats["hits"] += 1
                raise pyfuse3.FUSEError(errno.ENOENT)
            child = leases.get(ino, now) if ino is not None else None
            if child is not None and child.attr is not None:
                leases.stats["hits"] += 1
                return self._leased_entry(child.attr, parent, child, now)
        ticket = leases.ticket(now)
        try:
            reply = await self.meta.query(
                Q.LeaseLookup(self.vol, parent_inode, name, self.session.session_id)
            )
            got = leases.accept(ticket, reply.grant, time.monotonic())
        finally:
            leases.done(ticket)
        attr = reply.attr
        parent, child = got.get(parent_inode), got.get(attr.ino)
        if parent is not None:
            parent.entries[name] = attr.ino
            parent.kernel_names.add(name)
        if child is not None:
            child.attr = attr
        return self._leased_entry(attr, parent, child, time.monotonic())

    def _leased_entry(
        self, attr: Attr, parent: Lease | None, child: Lease | None, now: float
    ) -> pyfuse3.EntryAttributes:
        """A lookup's answer: the kernel keeps the name while the directory's
        lease lasts and the attributes while the inode's does."""
        inode = self.inodes.learn(attr)
        return self._entry(
            inode,
            self._lease_left(child, now, self.options.attr_timeout),
            self._lease_left(parent, now, self.options.entry_timeout),
        )

    @_fuse
    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for ino, nlookup in inode_list:
            self.inodes.forget(ino, nlookup)

    @_fuse
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if is_control(inode):
            return self._control_entry(self.control.attr(inode))
        known = self.inodes.get(inode)
        now = time.monotonic()
        lease = self.leases.get(inode, now)
        if lease is not None and lease.attr is not None:
            self.leases.stats["hits"] += 1
            node = self.inodes.update(lease.attr)
            return self._entry(node, self._lease_left(lease, now, self.options.attr_timeout))
        try:
            reply = await self.session.leased(
                inode, Q.LeaseGetAttr(self.vol, inode, self.session.session_id)
            )
        except NotFound:
            # Unlinked while open here: keep answering from what we know.
            if known is not None and known.opens > 0:
                return self._entry(known)
            raise
        attr = reply.attr
        node = self.inodes.update(attr)
        if (
            node.cached_version is not None
            and node.cached_version != attr.version
            and (node.writer is None or not node.writer.dirty)
        ):
            node.cached_version = None
            self.nursery.start_soon(self._invalidate, inode)
        now = time.monotonic()
        lease = self.leases.get(inode, now)
        if lease is not None and lease.attr is not attr:
            lease = None  # not installed: the answer is not under the lease
        return self._entry(node, self._lease_left(lease, now, self.options.attr_timeout))

    async def _leases_lost(self, lost: tuple[tuple[int, tuple[bytes, ...]], ...]) -> None:
        """Drop the kernel's caches of what lost leases covered: the names
        it learned under a directory's lease, and each inode's attributes
        and pages. In a worker thread: an invalidation waits for the
        directory's lock and the pages that requests in flight hold. A
        directory with our own change in flight is invalidated
        asynchronously instead: its lock is held until that change returns,
        which may wait for this very acknowledgement. So is one whose lock
        the kernel holds for a request not handled yet (queued, or waiting
        for a worker): the wait for the thread ends after
        ``INVALIDATE_WAIT``, and the thread goes on alone. Without that, a
        failover under load waited out the new leader's whole grace: a
        create queued in a leased directory waited for the grace, which
        waited for this mount to say it had dropped the old leases."""
        later = [(ino, names) for ino, names in lost if self.leases.busy(ino)]
        for ino, names in later:
            for name in names:
                pyfuse3.invalidate_entry_async(ino, name, ignore_enoent=True)
        now = [(ino, () if self.leases.busy(ino) else names) for ino, names in lost]
        with trio.move_on_after(INVALIDATE_WAIT) as waited:
            await trio.to_thread.run_sync(_invalidate_all, now, abandon_on_cancel=True)
        if waited.cancelled_caught:
            self.leases.stats["invalidations_left"] += 1
            log.info("dropping the kernel's caches of %d lost leases waits for requests in flight; "
                     "going on without waiting", len(now))

    async def _invalidate(self, ino: int) -> None:
        try:
            await trio.to_thread.run_sync(pyfuse3.invalidate_inode, ino)
        except OSError as exc:
            log.debug("invalidate_inode(%d): %s", ino, exc)

    @_fuse
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        self._writable()
        if is_control(inode):
            raise pyfuse3.FUSEError(errno.EPERM)
        changes: dict[str, int] = {}
        if fields.update_mode:
            changes["mode"] = attr.st_mode
        if fields.update_uid:
            changes["uid"] = attr.st_uid
        if fields.update_gid:
            changes["gid"] = attr.st_gid
        if fields.update_atime:
            changes["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            changes["mtime_ns"] = attr.st_mtime_ns
        if fields.update_size:
            changes["size"] = attr.st_size
        return self._entry(await self.engine.setattr(inode, **changes))

    async def fallocate(self, inode: int, mode: int, offset: int, length: int) -> int:
        """FUSE_FALLOCATE (pyfuse3 has no handler: :mod:`.fallocate_hook`
        calls this); the errno to answer, 0 for success."""
        try:
            await self._fallocate(inode, mode, offset, length)
        except pyfuse3.FUSEError as exc:
            return exc.errno
        return 0

    @_fuse
    async def _fallocate(self, inode: int, mode: int, offset: int, length: int) -> None:
        self._writable()
        await self.engine.fallocate(inode, mode, offset, length)

    async def lseek(self, inode: int, offset: int, whence: int) -> tuple[int, int]:
        """FUSE_LSEEK, which the kernel sends for SEEK_DATA and SEEK_HOLE only
        (pyfuse3 has no handler: :mod:`.lseek_hook` calls this); the errno
        to answer (0 for success) and the offset found."""
        try:
            return 0, await self._lseek(inode, offset, whence)
        except pyfuse3.FUSEError as exc:
            return exc.errno, 0

    @_fuse
    async def _lseek(self, inode: int, offset: int, whence: int) -> int:
        if whence not in (os.SEEK_DATA, os.SEEK_HOLE):
            raise pyfuse3.FUSEError(errno.EINVAL)
        found = await self.engine.seek(inode, offset, data=whence == os.SEEK_DATA)
        if found is None:
            raise pyfuse3.FUSEError(errno.ENXIO)
        return found

    @_fuse
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return await self.meta.query(Q.ReadLink(self.vol, inode))

    # ------------------------------------------------------------------ namespace

    @_fuse
    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self._writable()
        uid, gid, mode = self._owner(parent_inode, ctx, mode)
        attr = await self.session.mutate(C.Mknod(self.vol, parent_inode, name, mode, rdev, uid, gid))
        return self._made(parent_inode, name, self.inodes.learn(attr))

    @_fuse
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self._writable()
        uid, gid, mode = self._owner(parent_inode, ctx, mode | stat.S_IFDIR)
        attr, _ = await self.session.create(C.Mkdir(self.vol, parent_inode, name, mode, uid, gid))
        return self._made(parent_inode, name, self.inodes.learn(attr))

    @_fuse
    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self._writable()
        uid, gid, _ = self._owner(parent_inode, ctx, stat.S_IFLNK)
        attr = await self.session.mutate(C.Symlink(self.vol, parent_inode, name, target, uid, gid))
        return self._made(parent_inode, name, self.inodes.learn(attr))

    @_fuse
    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self._writable()
        attr = await self.session.mutate(C.Link(self.vol, inode, new_parent_inode, new_name))
        return self._made(new_parent_inode, new_name, self.inodes.learn(attr))

    @_fuse
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._writable()
        await self.session.mutate(C.Unlink(self.vol, parent_inode, name))

    @_fuse
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._writable()
        await self.session.mutate(C.Rmdir(self.vol, parent_inode, name))

    @_fuse
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        self._writable()
        await self.session.mutate(
            C.Rename(self.vol, parent_inode_old, name_old, parent_inode_new, name_new, flags)
        )

    # ------------------------------------------------------------------ files

    def _open_handle(self, inode: Inode, flags: int) -> int:
        fh = self._fh()
        handle = self._handles[fh] = Handle(inode, flags, self.reader.new_readahead())
        if not handle.direct:
            inode.cached_opens += 1
        return fh

    def _file_info(self, fh: int, inode: Inode, flags: int) -> pyfuse3.FileInfo:
        """O_DIRECT opens get FOPEN_DIRECT_IO. The kernel's own O_DIRECT path
        runs every write under the inode lock after a synchronous
        ``getxattr("security.capability")`` round trip (file_remove_privs;
        pyfuse3 cannot ask for FUSE_HANDLE_KILLPRIV_V2, which would skip it),
        so a deep libaio queue of writes to one file ran one at a time. With
        FOPEN_DIRECT_IO they go out asynchronously, as reads do. (Such a file
        cannot be mmap'ed, as with any FOPEN_DIRECT_IO file.)"""
        keep = inode.cached_version is not None and inode.cached_version == inode.attr.version
        if not keep:
            inode.cached_version = inode.attr.version
        if inode.pushed:  # its pages were pushed ahead (pagepush.py): used now, or dropped
            inode.pushed = False
            if keep:
                self.reader.used_ahead(inode)
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep, direct_io=bool(flags & os.O_DIRECT))

    @_fuse
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if is_control(inode):
            writable = bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND))
            return pyfuse3.FileInfo(fh=self.control.open(inode, writable), direct_io=True)
        if self.options.read_only and flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise pyfuse3.FUSEError(errno.EROFS)
        known = self.inodes.get(inode)
        if (
            known is not None
            and known.attr.is_reg
            and known.attr.size
            and flags & os.O_ACCMODE != os.O_WRONLY
            and not flags & os.O_TRUNC
        ):
            self.engine.start_early_read(known, flags & os.O_ACCMODE == os.O_RDONLY)
        node = await self.engine.open(inode)
        node.void_xattrs()
        if node.writer is not None and node.writer.dirty:
            # Our own uncommitted writes: the kernel's pages hold them.
            node.cached_version = node.attr.version
        fh = self._open_handle(node, flags)
        if flags & os.O_TRUNC and node.size:
            # Normally the kernel truncates with setattr first; cover the rest.
            await self.engine.setattr(inode, size=0)
        elif (
            self.pages is not None
            and flags & os.O_ACCMODE == os.O_RDONLY
            and self.reader.dirahead is not None
            and self.reader.dirahead.fetched_ahead(inode)
        ):
            self.pages.offer(inode, opening=True)  # landed while the kernel did not know it (pagepush.py)
        return self._file_info(fh, node, flags)

    @_fuse
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        self._writable()
        uid, gid, mode = self._owner(parent_inode, ctx, mode)
        asked = time.monotonic()
        attr, bare = await self.session.create(
            C.Mknod(self.vol, parent_inode, name, mode | stat.S_IFREG, 0, uid, gid)
        )
        self.inodes.learn(attr)
        try:
            node = await self.engine.open(attr.ino, attr)
        except BaseException:
            # The kernel never hears of this inode: take the lookup back.
            self.inodes.forget(attr.ino, 1)
            raise
        if not attr.size:  # empty as of its lease (see Compactor.schedule)
            node.born, node.commits = self.leases.get(attr.ino, time.monotonic()), {}
            if node.attr.version == attr.version:  # its first chunk's list, as its commits grow it
                node.chunks[0] = ((attr.version, node.layout), [])
        if bare and node.xattrs_voided < asked:  # the kernel's getxattr before each write
            node.bare = asked
        fh = self._open_handle(node, flags)
        return self._file_info(fh, node, flags), self._made(parent_inode, name, node)

    @_fuse
    async def read(self, fh: int, off: int, size: int) -> bytes:
        if is_control(fh):
            return await self.control.read(fh, off, size)
        handle = self._handles[fh]
        return await self.reader.read_view(handle.inode, off, size, handle.readahead)  # type: ignore[return-value]

    @_fuse
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        self._writable()
        if off + len(buf) > MAX_FILE_SIZE:
            # write(2): nothing past the largest file; a write that crosses
            # it stores what fits and returns that count.
            if off >= MAX_FILE_SIZE:
                raise FileTooLarge(f"write at {off} is past the largest file ({MAX_FILE_SIZE})")
            buf = buf[: MAX_FILE_SIZE - off]
        handle = self._handles[fh]
        handle.wrote = True
        inode = handle.inode
        if handle.direct:
            # Bypassing the page cache: whatever pages other openers hold
            # no longer match, and the next open must not keep them.
            inode.cached_version = None
            if inode.cached_opens:
                self.nursery.start_soon(self._invalidate, inode.ino)
        await self.engine.writer(inode).write(off, buf)
        return len(buf)

    @_fuse
    async def flush(self, fh: int) -> None:
        handle = self._handles.get(fh)
        if handle is not None:
            await self.engine.flush(handle.inode)

    @_fuse
    async def fsync(self, fh: int, datasync: bool) -> None:
        handle = self._handles.get(fh)
        if handle is not None:
            await self.engine.flush(handle.inode)

    @_fuse
    async def release(self, fh: int) -> None:
        if is_control(fh):
            self.control.release(fh)
            return
        handle = self._handles.pop(fh, None)
        if handle is None:
            return
        inode = handle.inode
        if not handle.direct:
            inode.cached_opens -= 1
        try:
            await self.engine.flush(inode)
        finally:
            await self.engine.release(inode)

    # ------------------------------------------------------------------ directories

    def dir_cacheable(self, ino: int) -> bool:
        """Whether the kernel may keep and read ``ino``'s listing (asked by
        :mod:`.dircache_hook` at each opendir): this mount holds a lease on
        the directory, and the kernel's cache of it was emptied after that
        lease began, so nothing it kept under an earlier lease, lost without
        a revocation, is read. The first opendir under a lease starts the
        emptying and is listed by the mount."""
        if is_control(ino):
            return False
        lease = self.leases.get(ino, time.monotonic())
        if lease is None:
            return False
        ahead = self.reader.dirahead
        if ahead is not None and ahead.enabled and not ahead.knows(ino):
            return False  # listed by the mount, so that directory readahead learns it again
        if lease.kernel_listing:
            return True
        if ino not in self._emptying:
            self._emptying.add(ino)
            self.nursery.start_soon(self._empty_listing, ino, lease)
        return False

    async def _empty_listing(self, ino: int, lease: Lease) -> None:
        try:
            await self._invalidate(ino)
            lease.kernel_listing = True
        finally:
            self._emptying.discard(ino)

    @_fuse
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        fh = self._fh()
        self._dirs[fh] = inode
        return fh

    @_fuse
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        """Pages of ``LoadDir``: the entries with their attributes and leases
        (later lookups and opens of them need no round trip), and chunk 0's
        slice list of each small file (nor does its first read)."""
        ino = self._dirs[fh]
        if is_control(ino):
            for name, attr, cookie in self.control.entries(start_id):
                if not pyfuse3.readdir_reply(token, name, self._control_entry(attr), cookie):
                    return
            return
        if start_id and self._dir_ends.get(fh) == start_id:
            # The kernel asks once more past the last entry it took, to
            # learn that the listing ended: this handle's last page said so
            # already. Entries made since opendir (or rewinddir, which
            # starts again at 0) need not appear (POSIX readdir), so the
            # answer is the end, with no round trip.
            return
        cookie = start_id
        leases = self.leases
        ahead = self.reader.dirahead
        page_no = 0
        while True:
            ticket = leases.ticket(time.monotonic())
            try:
                page = await self.meta.query(
                    Q.LoadDir(self.vol, ino, self.session.session_id, cookie, READDIR_BATCH)
                )
                got = leases.accept(ticket, page.grant, time.monotonic())
            finally:
                leases.done(ticket)
            if ahead is not None and ahead.enabled:  # before the replies: the kernel may stop taking them
                ahead.listed(ino, [(e.attr.ino, e.attr.size, e.slices) for e in page.entries
                                   if e.slices is not None and e.attr.is_reg], restart=not start_id and not page_no)
            page_no += 1
            now = time.monotonic()
            parent = got.get(ino)
            if parent is not None:
                parent.attr = page.attr
            for e in page.entries:
                child = got.get(e.attr.ino)
                if child is not None:
                    child.attr = e.attr
                if parent is not None:
                    parent.entries[e.name] = e.attr.ino
                    parent.kernel_names.add(e.name)
                entry = self._entry_for_readdir(e.attr, parent, child, now)
                # readdirplus: an accepted entry is a lookup the kernel will forget.
                if not pyfuse3.readdir_reply(token, e.name, entry, e.cookie):
                    return
                inode = self.inodes.learn(e.attr)
                if e.slices is not None and child is not None and inode.writer is None:
                    inode.chunks[0] = ((e.attr.version, inode.layout), e.slices)
                cookie = e.cookie
            if not page.more:
                if cookie:
                    self._dir_ends[fh] = cookie
                return

    def _entry_for_readdir(
        self, attr: Attr, parent: Lease | None, child: Lease | None, now: float
    ) -> pyfuse3.EntryAttributes:
        known = self.inodes.get(attr.ino)
        if known is not None and known.writer is not None and known.writer.dirty:
            return self._entry(known)
        return entry_attributes(
            attr,
            self._lease_left(child, now, self.options.attr_timeout),
            self._lease_left(parent, now, self.options.entry_timeout),
            self.session.block_size,
        )

    @_fuse
    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)
        self._dir_ends.pop(fh, None)

    @_fuse
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        """Namespace changes are committed before they are acknowledged."""

    # ------------------------------------------------------------------ misc

    @_fuse
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        fs = await self.meta.query(Q.StatFs(self.vol))
        st = pyfuse3.StatvfsData()
        st.f_bsize = fs.bsize
        st.f_frsize = fs.frsize
        st.f_blocks = fs.blocks
        st.f_bfree = fs.bfree
        st.f_bavail = fs.bavail
        st.f_files = fs.files
        st.f_ffree = fs.ffree
        st.f_favail = fs.favail
        st.f_namemax = fs.namemax
        return st

    @_fuse
    async def setxattr(
        self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext
    ) -> None:
        self._writable()
        self._xattr_changed(inode)
        try:
            await self.session.mutate(C.SetXattr(self.vol, inode, name, value))
        finally:
            self._xattr_changed(inode)

    def _xattr_changed(self, ino: int) -> None:
        """Before and after an xattr change: a getxattr in flight meanwhile
        may have read either value, so none of them is kept."""
        node = self.inodes.get(ino)
        if node is not None:
            node.void_xattrs()

    @_fuse
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if is_control(inode):
            raise pyfuse3.FUSEError(errno.ENODATA)
        node = self.inodes.get(inode)
        leases = self.leases
        now = time.monotonic()
        lease = leases.get(inode, now)
        if lease is not None and (name in lease.xattrs or lease.bare):
            leases.stats["hits"] += 1  # the lease covers extended attributes
            value = lease.xattrs.get(name)
            if value is None:
                raise pyfuse3.FUSEError(errno.ENODATA)
            return value
        if node is not None:
            if node.bare and now - node.bare < self.options.attr_timeout:
                raise pyfuse3.FUSEError(errno.ENODATA)
            hit = node.xattrs.get(name)
            if hit is not None and now - hit[0] < self.options.attr_timeout:
                if hit[1] is None:
                    raise pyfuse3.FUSEError(errno.ENODATA)
                return hit[1]
        ticket = leases.ticket(now)
        try:
            value: bytes | None = await self.meta.query(Q.GetXattr(self.vol, inode, name))
        except NoData:
            value = None
        finally:
            # kept with the lease only if it was held throughout (nothing dropped or changed it)
            leased = lease is not None and leases.fresh(ticket, inode) and leases.held(inode) is lease
            leases.done(ticket)
        if leased and len(lease.xattrs) < XATTR_CACHE:
            lease.xattrs[name] = value
        # Cache only if nothing voided this inode's xattrs while we waited.
        if node is not None and node.xattrs_voided < now:
            if len(node.xattrs) >= XATTR_CACHE:
                node.xattrs.clear()
            node.xattrs[name] = (now, value)
        if value is None:
            raise pyfuse3.FUSEError(errno.ENODATA)
        return value

    @_fuse
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        if is_control(inode):
            return []
        return await self.meta.query(Q.ListXattr(self.vol, inode))

    @_fuse
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._writable()
        self._xattr_changed(inode)
        try:
            await self.session.mutate(C.RemoveXattr(self.vol, inode, name))
        finally:
            self._xattr_changed(inode)
