"""The power-cut layer's FUSE front end: :class:`~cachefs.testing.volatile.VolatileFS` mounted.

    python -m cachefs.testing.powercutfs BACKING MOUNTPOINT

Daemons run with their data directory on MOUNTPOINT. ``kill -9`` of this
process is a power cut: what was made durable is in ``BACKING/tree``
already, the rest dies with the process (then ``fusermount3 -u`` the dead
mount and start it again to "reboot"). Any other end (SIGTERM, SIGINT, an
unmount) is a clean shutdown: everything is synced, as ``umount`` would.

The kernel must not hold data of its own that this process has not seen:
the writeback cache is off, so every write reaches it before the syscall
returns, and ``fsync``/``fsyncdir`` arrive as themselves. Attributes and
pages may be cached (``keep_cache``), since every change passes through
this mount. Only a test helper imports pyfuse3 outside the client's FUSE
front end, and only here.
"""

from __future__ import annotations

import argparse
import errno
import functools
import logging
import os
import signal
import stat
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pyfuse3
import trio

from .volatile import Dir, File, Node, VolatileFS

log = logging.getLogger(__name__)
T = TypeVar("T")
TIMEOUT = 5.0  # attribute and entry cache: nothing changes behind the kernel's back


def _fuse_errors(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """OSError becomes its errno; anything else is a bug: logged, answered EIO."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except Exception:
            log.exception("power-cut layer: %s failed", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


class PowerCutOps(pyfuse3.Operations):
    enable_writeback_cache = False

    def __init__(self, fs: VolatileFS) -> None:
        super().__init__()
        self.fs = fs
        self._dir_handles: dict[int, tuple[int, list[tuple[str, Node]]]] = {}  # inode, listing at opendir
        self._file_handles: dict[int, tuple[int, bool]] = {}  # fh -> (inode, O_APPEND)
        self._next_fh = 1

    def _attr(self, node: Node) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = node.ino
        e.generation = 0
        e.st_mode = node.mode
        e.st_uid, e.st_gid = node.uid, node.gid
        e.st_rdev = 0
        e.st_blksize = 4096
        if isinstance(node, Dir):
            e.st_nlink = 2 + node.subdirs
            e.st_size = 4096
        else:
            assert isinstance(node, File)
            e.st_nlink = node.nlink
            e.st_size = node.size
        e.st_blocks = (e.st_size + 511) // 512
        e.st_atime_ns, e.st_mtime_ns, e.st_ctime_ns = node.atime_ns, node.mtime_ns, node.ctime_ns
        e.attr_timeout = e.entry_timeout = TIMEOUT
        return e

    def _entry(self, node: Node) -> pyfuse3.EntryAttributes:
        """An answer that tells the kernel about an inode: one more lookup to forget."""
        self.fs.hold(node.ino)
        return self._attr(node)

    def _fh(self) -> int:
        fh, self._next_fh = self._next_fh, self._next_fh + 1
        return fh

    @_fuse_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        node = self.fs.lookup(parent_inode, os.fsdecode(name))
        return self._attr(node) if name in (b".", b"..") else self._entry(node)

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            self.fs.release(ino, n)

    @_fuse_errors
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self._attr(self.fs.node(inode))

    @_fuse_errors
    async def setattr(self, inode: int, attr: Any, fields: Any, fh: int | None, ctx: Any) -> pyfuse3.EntryAttributes:
        node = self.fs.setattr(
            inode,
            size=attr.st_size if fields.update_size else None,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
        )
        return self._attr(node)

    @_fuse_errors
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        return self._entry(self.fs.mkdir(parent_inode, os.fsdecode(name), mode, ctx.uid, ctx.gid))

    @_fuse_errors
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        self.fs.rmdir(parent_inode, os.fsdecode(name))

    @_fuse_errors
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        self.fs.unlink(parent_inode, os.fsdecode(name))

    @_fuse_errors
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: Any) -> None:
        self.fs.rename(parent_inode_old, os.fsdecode(name_old), parent_inode_new,
                       os.fsdecode(name_new), flags)

    @_fuse_errors
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        return self._entry(self.fs.link(inode, new_parent_inode, os.fsdecode(new_name)))

    @_fuse_errors
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any) -> pyfuse3.EntryAttributes:
        if not stat.S_ISREG(mode):
            raise pyfuse3.FUSEError(errno.EPERM)  # only files and directories are modelled
        return self._entry(self.fs.create(parent_inode, os.fsdecode(name), mode, ctx.uid, ctx.gid))

    @_fuse_errors
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        raise pyfuse3.FUSEError(errno.EPERM)

    # -- files

    def _opened(self, ino: int, flags: int) -> pyfuse3.FileInfo:
        self.fs.open(ino)
        if flags & os.O_TRUNC and flags & os.O_ACCMODE != os.O_RDONLY:
            self.fs.truncate(ino, 0)
        fh = self._fh()
        self._file_handles[fh] = (ino, bool(flags & os.O_APPEND))
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    @_fuse_errors
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        return self._opened(inode, flags)

    @_fuse_errors
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any) -> tuple:
        f = self.fs.create(parent_inode, os.fsdecode(name), mode, ctx.uid, ctx.gid)
        return self._opened(f.ino, flags), self._entry(f)

    @_fuse_errors
    async def read(self, fh: int, off: int, size: int) -> bytes:
        return self.fs.read(self._file_handles[fh][0], off, size)

    @_fuse_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        ino, append = self._file_handles[fh]
        if append:
            off = self.fs.node(ino).size  # type: ignore[attr-defined]
        return self.fs.write(ino, off, buf)

    async def flush(self, fh: int) -> None:
        pass  # close() promises nothing about durability

    @_fuse_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        self.fs.fsync(self._file_handles[fh][0])

    @_fuse_errors
    async def release(self, fh: int) -> None:
        ino, _ = self._file_handles.pop(fh)
        self.fs.close(ino)

    # -- directories

    @_fuse_errors
    async def opendir(self, inode: int, ctx: Any) -> int:
        listing = self.fs.listdir(inode)
        self.fs.hold(inode)
        fh = self._fh()
        self._dir_handles[fh] = (inode, listing)
        return fh

    @_fuse_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        _, listing = self._dir_handles[fh]
        for i in range(start_id, len(listing)):
            name, node = listing[i]
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._attr(node), i + 1):
                break
            self.fs.hold(node.ino)  # readdirplus: the kernel now knows this inode

    @_fuse_errors
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        self.fs.fsync(self._dir_handles[fh][0])

    @_fuse_errors
    async def releasedir(self, fh: int) -> None:
        inode, _ = self._dir_handles.pop(fh)
        self.fs.release(inode)

    @_fuse_errors
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        st = os.statvfs(self.fs.backing)
        out = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree",
                     "f_favail", "f_namemax"):
            setattr(out, name, getattr(st, name))
        return out


async def serve(fs: VolatileFS, mountpoint: str) -> None:
    """Serve until unmounted or SIGTERM/SIGINT, then sync everything (a clean
    shutdown). Only kill -9 skips that: it is the power cut."""
    options = set(pyfuse3.default_options) | {"fsname=powercut", "subtype=powercut"}
    pyfuse3.init(PowerCutOps(fs), mountpoint, options)
    try:
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for _ in signals:
                        pyfuse3.terminate()
                        return

            nursery.start_soon(on_signal)
            await pyfuse3.main()
            nursery.cancel_scope.cancel()
    finally:
        pyfuse3.close(unmount=True)
        fs.sync_all()
        fs.close_all()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backing", help="the real directory that holds the durable state")
    parser.add_argument("mountpoint")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s powercutfs %(levelname)s %(message)s")
    fs = VolatileFS(args.backing)
    log.info("serving %s on %s (%d inodes)", args.backing, args.mountpoint, len(fs.table))
    trio.run(serve, fs, args.mountpoint)


if __name__ == "__main__":
    main()
