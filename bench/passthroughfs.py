"""A minimal pyfuse3 passthrough filesystem over a local directory.

The reference for ``bench.fio_compare``: what a Python FUSE daemon on this
machine can serve at best (no network, no cache logic), with and without
``keep_cache``. Modelled on pyfuse3's ``examples/passthroughfs.py``: inodes
are the source's inode numbers mapped to paths, lookup counts are kept, and
every handler raises only ``FUSEError``.

    python -m bench.passthroughfs SOURCE MOUNTPOINT [--keep-cache]

It runs in the foreground until unmounted (``fusermount3 -u MOUNTPOINT``) or
sent SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import errno
import functools
import logging
import os
import signal
import stat
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pyfuse3
import trio

log = logging.getLogger("passthroughfs")
T = TypeVar("T")


def _oserror(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return await fn(*args, **kwargs)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None

    return wrapper


def _names(path: str, ino: int) -> bool:
    try:
        return os.lstat(path).st_ino == ino
    except OSError:
        return False


class Passthrough(pyfuse3.Operations):
    enable_writeback_cache = False

    def __init__(self, source: str, keep_cache: bool) -> None:
        super().__init__()
        self.keep_cache = keep_cache
        self._paths: dict[int, set[str]] = {pyfuse3.ROOT_INODE: {source}}
        self._lookups: dict[int, int] = defaultdict(int)
        self._fd_ino: dict[int, int] = {}
        self._fd_opens: dict[int, int] = defaultdict(int)
        self._ino_fd: dict[int, int] = {}

    def _path(self, ino: int) -> str:
        paths = self._paths.get(ino)
        if not paths:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return next(iter(paths))

    def _remember(self, ino: int, path: str) -> None:
        self._lookups[ino] += 1
        paths = self._paths.setdefault(ino, set())
        if path not in paths:
            # A path removed behind our back (in the source) may still be
            # here, under a number the source has since given to this new
            # file: forget the paths that no longer name it.
            paths -= {p for p in paths if not _names(p, ino)}
            paths.add(path)

    def _attr(self, path: str | None = None, fd: int | None = None) -> pyfuse3.EntryAttributes:
        st = os.fstat(fd) if fd is not None else os.lstat(path)  # type: ignore[arg-type]
        e = pyfuse3.EntryAttributes()
        for name in (
            "st_ino",
            "st_mode",
            "st_nlink",
            "st_uid",
            "st_gid",
            "st_rdev",
            "st_size",
            "st_blksize",
            "st_blocks",
        ):
            setattr(e, name, getattr(st, name))
        e.st_atime_ns, e.st_mtime_ns, e.st_ctime_ns = st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns
        e.generation = 0
        e.attr_timeout = e.entry_timeout = 1.0
        return e

    @_oserror
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: Any = None
    ) -> pyfuse3.EntryAttributes:
        path = os.path.join(self._path(parent_inode), os.fsdecode(name))
        attr = self._attr(path)
        if name not in (b".", b".."):
            self._remember(attr.st_ino, path)
        return attr

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            self._lookups[ino] -= n
            if self._lookups[ino] <= 0:
                self._lookups.pop(ino, None)
                if ino != pyfuse3.ROOT_INODE and ino not in self._ino_fd:
                    self._paths.pop(ino, None)

    @_oserror
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        fd = self._ino_fd.get(inode)
        if fd is not None:
            attr = self._attr(fd=fd)
            attr.st_ino = inode
            return attr
        attr = self._attr(self._path(inode))
        attr.st_ino = inode  # the root is ROOT_INODE whatever the source's number
        return attr

    @_oserror
    async def setattr(
        self, inode: int, attr: Any, fields: Any, fh: int | None, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        path = self._path(inode)
        if fields.update_size:
            if fh is not None:
                os.ftruncate(fh, attr.st_size)
            else:
                os.truncate(path, attr.st_size)
        if fields.update_mode:
            os.chmod(path, stat.S_IMODE(attr.st_mode))
        if fields.update_uid or fields.update_gid:
            os.chown(
                path,
                attr.st_uid if fields.update_uid else -1,
                attr.st_gid if fields.update_gid else -1,
            )
        if fields.update_atime or fields.update_mtime:
            st = os.lstat(path)
            os.utime(
                path,
                ns=(
                    attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                    attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns,
                ),
            )
        return await self.getattr(inode)

    @_oserror
    async def opendir(self, inode: int, ctx: Any) -> int:
        return inode

    @_oserror
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        path = self._path(fh)
        entries = sorted(((e.inode(), e.name) for e in os.scandir(path)), key=lambda item: item[0])
        for ino, name in entries:
            if ino <= start_id:
                continue
            full = os.path.join(path, name)
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._attr(full), ino):
                break
            self._remember(ino, full)

    @_oserror
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        path = os.path.join(self._path(parent_inode), os.fsdecode(name))
        os.mkdir(path, mode)
        attr = self._attr(path)
        self._remember(attr.st_ino, path)
        return attr

    @_oserror
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        path = os.path.join(self._path(parent_inode), os.fsdecode(name))
        ino = os.lstat(path).st_ino
        os.rmdir(path)
        self._paths.get(ino, set()).discard(path)

    @_oserror
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        path = os.path.join(self._path(parent_inode), os.fsdecode(name))
        ino = os.lstat(path).st_ino
        os.unlink(path)
        self._paths.get(ino, set()).discard(path)

    @_oserror
    async def rename(
        self, p_old: int, n_old: bytes, p_new: int, n_new: bytes, flags: int, ctx: Any
    ) -> None:
        if flags:
            raise pyfuse3.FUSEError(errno.EINVAL)
        old = os.path.join(self._path(p_old), os.fsdecode(n_old))
        new = os.path.join(self._path(p_new), os.fsdecode(n_new))
        ino = os.lstat(old).st_ino
        os.rename(old, new)
        paths = self._paths.setdefault(ino, set())
        paths.discard(old)
        paths.add(new)

    def _opened(self, ino: int, fd: int) -> pyfuse3.FileInfo:
        self._fd_ino[fd] = ino
        self._fd_opens[fd] += 1
        self._ino_fd.setdefault(ino, fd)
        return pyfuse3.FileInfo(fh=fd, keep_cache=self.keep_cache)

    @_oserror
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        # O_DIRECT stays in the kernel's hands; the source file is read buffered.
        fd = os.open(self._path(inode), flags & ~(os.O_CREAT | os.O_DIRECT))
        return self._opened(inode, fd)

    @_oserror
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
    ) -> tuple:
        path = os.path.join(self._path(parent_inode), os.fsdecode(name))
        fd = os.open(path, (flags | os.O_CREAT | os.O_TRUNC) & ~os.O_DIRECT, mode)
        attr = self._attr(fd=fd)
        self._remember(attr.st_ino, path)
        return self._opened(attr.st_ino, fd), attr

    @_oserror
    async def read(self, fh: int, off: int, size: int) -> bytes:
        return os.pread(fh, size, off)

    @_oserror
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return os.pwrite(fh, buf, off)

    async def flush(self, fh: int) -> None:
        pass

    @_oserror
    async def fsync(self, fh: int, datasync: bool) -> None:
        os.fdatasync(fh) if datasync else os.fsync(fh)

    @_oserror
    async def release(self, fh: int) -> None:
        self._fd_opens[fh] -= 1
        if self._fd_opens[fh] <= 0:
            del self._fd_opens[fh]
            ino = self._fd_ino.pop(fh)
            if self._ino_fd.get(ino) == fh:
                del self._ino_fd[ino]
            os.close(fh)

    @_oserror
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        st = os.statvfs(self._path(pyfuse3.ROOT_INODE))
        out = pyfuse3.StatvfsData()
        for name in (
            "f_bsize",
            "f_frsize",
            "f_blocks",
            "f_bfree",
            "f_bavail",
            "f_files",
            "f_ffree",
            "f_favail",
        ):
            setattr(out, name, getattr(st, name))
        out.f_namemax = st.f_namemax
        return out


async def _serve(ops: Passthrough, mountpoint: str, options: set[str]) -> None:
    pyfuse3.init(ops, mountpoint, options)
    try:
        async with trio.open_nursery() as n:

            async def on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
                    async for _ in sigs:
                        pyfuse3.terminate()
                        return

            n.start_soon(on_signal)
            await pyfuse3.main()
            n.cancel_scope.cancel()
    finally:
        pyfuse3.close(unmount=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("mountpoint")
    parser.add_argument(
        "--keep-cache", action="store_true", help="keep the kernel page cache across opens"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    options = set(pyfuse3.default_options) | {
        "fsname=passthroughfs",
        "subtype=passthroughfs",
        "allow_other",
    }
    trio.run(
        _serve, Passthrough(os.path.abspath(args.source), args.keep_cache), args.mountpoint, options
    )


if __name__ == "__main__":
    main()
