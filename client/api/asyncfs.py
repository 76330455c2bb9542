"""The trio-native filesystem of the native API: path calls on the volume engine.

:class:`AsyncFileSystem` resolves paths from the root (with a name cache for
directories, as the kernel's dentry cache does under a mount) and turns each
call into metadata requests (:mod:`cachefs.commands`, :mod:`cachefs.queries`)
and data calls of the :class:`~cachefs.client.volume.Volume`; :class:`AsyncFile` is one open file
(its position and readahead state). Errors leave as ``OSError`` (:func:`_edge`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import stat as stat_mod
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.errors import (
    CacheFSError,
    Exists,
    InvalidArgument,
    IsADirectory,
    NotADirectory,
    NotFound,
    ReadOnly,
    TooManyLinks,
)
from cachefs.messages import Attr

from ..inodes import Inode
from ..reader import Readahead
from ..volume import Volume

log = logging.getLogger(__name__)

ROOT_INO = 1
READDIR_BATCH = 1024
CLOSE_TIMEOUT = 5.0
IDLE_INODES = 65536  # closed files whose slice lists are kept for their next open
MAX_LINKS = 40  # symbolic links followed in one path, as Linux


def _oserror(exc: CacheFSError, path: str | None = None) -> OSError:
    err = (
        OSError(exc.errno, exc.message, path)
        if path is not None
        else OSError(exc.errno, exc.message)
    )
    err.__cause__ = exc
    return err


@contextlib.contextmanager
def _edge(path: str | None = None) -> Iterator[None]:
    """Map the cachefs error tree to OSError at the library boundary."""
    try:
        yield
    except CacheFSError as exc:
        raise _oserror(exc, path) from exc


def split_path(path: str | os.PathLike[str]) -> list[str]:
    """Volume path -> names; ``.`` and empty parts dropped, ``..`` resolved lexically."""
    parts: list[str] = []
    for name in os.fspath(path).split("/"):
        if name in ("", "."):
            continue
        if name == "..":
            if parts:
                parts.pop()
            continue
        parts.append(name)
    return parts


def _norm(path: str | os.PathLike[str]) -> str:
    return "/" + "/".join(split_path(path))


def to_stat(attr: Attr, block_size: int = 4096) -> os.stat_result:
    """Attributes as an ``os.stat_result`` (st_dev 0), so os.path-style code works on them."""
    return os.stat_result(
        (attr.mode, attr.ino, 0, attr.nlink, attr.uid, attr.gid, attr.size,
         attr.atime_ns // 10**9, attr.mtime_ns // 10**9, attr.ctime_ns // 10**9),
        {
            "st_atime": attr.atime_ns / 1e9, "st_mtime": attr.mtime_ns / 1e9,
            "st_ctime": attr.ctime_ns / 1e9, "st_atime_ns": attr.atime_ns,
            "st_mtime_ns": attr.mtime_ns, "st_ctime_ns": attr.ctime_ns,
            "st_blksize": block_size, "st_blocks": attr.blocks, "st_rdev": attr.rdev,
        },
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class DirEntry:
    """One directory entry with its attributes (readdir already carries them)."""

    name: str
    path: str
    stat: os.stat_result

    def is_dir(self) -> bool:
        return stat_mod.S_ISDIR(self.stat.st_mode)

    def is_file(self) -> bool:
        return stat_mod.S_ISREG(self.stat.st_mode)


_MODES = {"rb": (True, False), "wb": (False, True), "ab": (False, True), "xb": (False, True),
          "r+b": (True, True)}  # fmt: skip


def _parse_mode(mode: str) -> str:
    """The binary mode for ``mode``: ``"r"``/``"rb"``/``"rt"`` -> ``"rb"``,
    ``"rb+"``/``"r+"`` -> ``"r+b"``, and so on (text is a wrapper, see
    :meth:`FileSystem.open`)."""
    core = "".join(sorted(set(mode) - {"b", "t"}))
    m = {"r": "rb", "w": "wb", "a": "ab", "x": "xb", "+r": "r+b"}.get(core)
    if m is None or len(mode) != len(set(mode)) or ("b" in mode and "t" in mode):
        raise ValueError(f"unsupported mode {mode!r}: use r, w, a, x or r+, binary or text")
    return m


class AsyncFileSystem:
    """One volume, trio-native. Make it with :func:`open_volume`."""

    def __init__(self, engine: Volume) -> None:
        self.engine = engine
        self.session = engine.session
        self.meta = engine.session.meta
        self.options = engine.options
        self.volume = engine.session.volume
        self._dentries: dict[tuple[int, str], tuple[int, float]] = {}
        self._files: weakref.WeakSet[AsyncFile] = weakref.WeakSet()
        self._uid, self._gid = os.getuid(), os.getgid()
        self.closed = False

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` as a background task of this client (it ends with the client)."""
        self.engine.nursery.start_soon(fn, *args)

    def _writable(self) -> None:
        if self.options.read_only:
            raise ReadOnly(f"volume {self.volume} is open read-only")

    # ------------------------------------------------------------------ names

    async def _resolve(
        self, path: str | os.PathLike[str], *, follow_last: bool = True, dir_only: bool = False
    ) -> tuple[int, int, Attr | None]:
        """Walk ``path`` from the root: ``(parent ino, ino, attributes)``.

        Symbolic links are followed on the way (and at the end with
        ``follow_last``), at most ``MAX_LINKS`` of them. Directory names
        resolved less than ``entry_timeout`` ago come from the name cache (the
        kernel's dentry cache does the same under a mount); the last name is
        always asked fresh, except with ``dir_only`` (a parent directory, whose
        attributes are then not returned).

        Raises:
            NotFound, NotADirectory, TooManyLinks
        """
        pending = split_path(path)
        stack = [ROOT_INO]  # the directories from the root down to where we are
        hops = 0
        while pending:
            name = pending.pop(0)
            last = not pending
            here = stack[-1]
            if name == "..":  # only from a link target: user paths are resolved lexically
                if len(stack) > 1:
                    stack.pop()
                continue
            if not last or dir_only:
                hit = self._dentries.get((here, name))
                if hit is not None and hit[1] > trio.current_time():
                    stack.append(hit[0])
                    continue
            try:
                attr = await self.meta.query(Q.Lookup(self.volume, here, os.fsencode(name)))
            except NotFound:
                self._forget_name(here, name)
                raise
            if stat_mod.S_ISLNK(attr.mode) and (follow_last or not last):
                hops += 1
                if hops > MAX_LINKS:
                    raise TooManyLinks(f"too many levels of symbolic links in {os.fspath(path)}")
                target = os.fsdecode(await self.meta.query(Q.ReadLink(self.volume, attr.ino)))
                if target.startswith("/"):
                    stack = [ROOT_INO]
                pending = [p for p in target.split("/") if p not in ("", ".")] + pending
                continue
            if attr.is_dir:
                self._dentries[(here, name)] = (
                    attr.ino,
                    trio.current_time() + self.options.entry_timeout,
                )
            elif not last or dir_only:
                raise NotADirectory(f"{name} is not a directory")
            if last:
                return here, attr.ino, attr
            stack.append(attr.ino)
        if len(self._dentries) > IDLE_INODES:
            now = trio.current_time()
            self._dentries = {k: v for k, v in self._dentries.items() if v[1] > now}
        parent = stack[-2] if len(stack) > 1 else ROOT_INO
        if dir_only:
            return parent, stack[-1], None
        return parent, stack[-1], await self.meta.query(Q.GetAttr(self.volume, stack[-1]))

    async def _parent(self, path: str | os.PathLike[str]) -> tuple[int, str]:
        """The directory that holds (or will hold) ``path``'s last name, and that name."""
        names = split_path(path)
        if not names:
            raise IsADirectory("the volume root has no parent")
        if len(names) == 1:
            return ROOT_INO, names[0]
        _, ino, _ = await self._resolve("/".join(names[:-1]), dir_only=True)
        return ino, names[-1]

    def _forget_name(self, parent: int, name: str) -> None:
        self._dentries.pop((parent, name), None)

    async def _attr(self, path: str | os.PathLike[str], *, follow: bool = True) -> Attr:
        """Fresh attributes of ``path`` (symbolic links followed unless ``follow`` is False)."""
        attr = (await self._resolve(path, follow_last=follow))[2]
        assert attr is not None  # only dir_only leaves it out
        return attr

    # ------------------------------------------------------------------ metadata

    async def stat(self, path: str | os.PathLike[str]) -> os.stat_result:
        with _edge(os.fspath(path)):
            return to_stat(await self._attr(path), self.block_size)

    async def lstat(self, path: str | os.PathLike[str]) -> os.stat_result:
        """Like :meth:`stat`, but a symbolic link is described, not followed."""
        with _edge(os.fspath(path)):
            return to_stat(await self._attr(path, follow=False), self.block_size)

    async def symlink(self, target: str, path: str | os.PathLike[str]) -> None:
        """Make ``path`` a symbolic link to ``target`` (as ``os.symlink``)."""
        with _edge(os.fspath(path)):
            self._writable()
            parent, name = await self._parent(path)
            link = os.fsencode(name), os.fsencode(target)
            await self.meta.mutate(C.Symlink(self.volume, parent, *link, self._uid, self._gid))

    async def utime(
        self,
        path: str | os.PathLike[str],
        times: tuple[float, float] | None = None,
        *,
        ns: tuple[int, int] | None = None,
        follow_symlinks: bool = True,
    ) -> None:
        """Set access and modification times, as ``os.utime`` (both now
        when neither ``times`` nor ``ns`` is given)."""
        if times is not None and ns is not None:
            raise ValueError("utime: give times or ns, not both")
        if ns is None:
            if times is None:
                now = time.time_ns()
                ns = (now, now)
            else:
                ns = (int(times[0] * 1e9), int(times[1] * 1e9))
        with _edge(os.fspath(path)):
            self._writable()
            attr = await self._attr(path, follow=follow_symlinks)
            inode = await self.engine.setattr(attr.ino, atime_ns=ns[0], mtime_ns=ns[1])
            self.engine.inodes.drop_if_idle(inode)

    async def readlink(self, path: str | os.PathLike[str]) -> str:
        with _edge(os.fspath(path)):
            attr = await self._attr(path, follow=False)
            if not stat_mod.S_ISLNK(attr.mode):
                raise InvalidArgument(f"{_norm(path)} is not a symbolic link")
            return os.fsdecode(await self.meta.query(Q.ReadLink(self.volume, attr.ino)))

    async def exists(self, path: str | os.PathLike[str]) -> bool:
        try:
            await self.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    async def isdir(self, path: str | os.PathLike[str]) -> bool:
        try:
            return stat_mod.S_ISDIR((await self.stat(path)).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

    async def isfile(self, path: str | os.PathLike[str]) -> bool:
        try:
            return stat_mod.S_ISREG((await self.stat(path)).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

    async def scandir(self, path: str | os.PathLike[str] = "/") -> list[DirEntry]:
        """Entries of a directory with their attributes, in readdir order."""
        base = _norm(path)
        with _edge(os.fspath(path)):
            names = split_path(path)
            if names:
                attr = await self._attr(path)
                if not attr.is_dir:
                    raise NotADirectory(f"{base} is not a directory")
                ino = attr.ino
            else:
                ino = ROOT_INO
            out: list[DirEntry] = []
            cookie = 0
            while True:
                rows = await self.meta.query(Q.ReadDir(self.volume, ino, cookie, READDIR_BATCH))
                for raw, attr, next_cookie in rows:
                    cookie = next_cookie
                    name = os.fsdecode(raw)
                    if name in (".", ".."):
                        continue
                    out.append(
                        DirEntry(name, f"{base.rstrip('/')}/{name}", to_stat(attr, self.block_size))
                    )
                if len(rows) < READDIR_BATCH:
                    return out

    async def listdir(self, path: str | os.PathLike[str] = "/") -> list[str]:
        return [e.name for e in await self.scandir(path)]

    async def walk(
        self, top: str | os.PathLike[str] = "/"
    ) -> AsyncIterator[tuple[str, list[str], list[str]]]:
        """``os.walk`` top-down: ``(dirpath, dirnames, filenames)``; pruning
        ``dirnames`` in place skips those subtrees."""
        stack = [_norm(top)]
        while stack:
            where = stack.pop()
            try:
                entries = await self.scandir(where)
            except (FileNotFoundError, NotADirectoryError):
                continue
            dirs = [e.name for e in entries if e.is_dir()]
            files = [e.name for e in entries if not e.is_dir()]
            yield where, dirs, files
            stack.extend(f"{where.rstrip('/')}/{d}" for d in reversed(dirs))

    async def mkdir(self, path: str | os.PathLike[str], mode: int = 0o755) -> None:
        with _edge(os.fspath(path)):
            self._writable()
            parent, name = await self._parent(path)
            await self.meta.mutate(self._mkdir(parent, name, mode))

    async def makedirs(
        self, path: str | os.PathLike[str], mode: int = 0o755, exist_ok: bool = False
    ) -> None:
        with _edge(os.fspath(path)):
            self._writable()
            names = split_path(path)
            ino = ROOT_INO
            for i, name in enumerate(names):
                try:
                    attr = await self.meta.mutate(self._mkdir(ino, name, mode))
                except Exists:
                    attr = await self._attr("/".join(names[: i + 1]))  # a link to a dir will do
                    if not attr.is_dir:
                        raise NotADirectory(
                            f"{'/'.join(names[: i + 1])} is not a directory"
                        ) from None
                    if i == len(names) - 1 and not exist_ok:
                        raise
                ino = attr.ino

    def _mkdir(self, parent: int, name: str, mode: int) -> C.Mkdir:
        return C.Mkdir(
            self.volume, parent, os.fsencode(name), mode | stat_mod.S_IFDIR, self._uid, self._gid
        )

    async def remove(self, path: str | os.PathLike[str]) -> None:
        with _edge(os.fspath(path)):
            self._writable()
            parent, name = await self._parent(path)
            await self.meta.mutate(C.Unlink(self.volume, parent, os.fsencode(name)))

    unlink = remove

    async def rmdir(self, path: str | os.PathLike[str]) -> None:
        with _edge(os.fspath(path)):
            self._writable()
            parent, name = await self._parent(path)
            self._forget_name(parent, name)
            await self.meta.mutate(C.Rmdir(self.volume, parent, os.fsencode(name)))

    async def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        """Atomic rename; an existing ``dst`` file (or empty directory) is replaced."""
        with _edge(os.fspath(src)):
            self._writable()
            parent, name = await self._parent(src)
            new_parent, new_name = await self._parent(dst)
            self._forget_name(parent, name)
            self._forget_name(new_parent, new_name)
            await self.meta.mutate(
                C.Rename(self.volume, parent, os.fsencode(name), new_parent, os.fsencode(new_name))
            )

    async def statfs(self) -> dict[str, Any]:
        with _edge():
            return (await self.meta.query(Q.StatFs(self.volume)))._asdict()

    # ------------------------------------------------------------------ data

    async def read_bytes(
        self, path: str | os.PathLike[str], start: int = 0, end: int | None = None
    ) -> bytes:
        """Bytes ``[start, end)`` of a file (negative offsets count from its end).

        A whole-file read fetches whole blocks into L1 (the next epoch finds
        them there); a range read fetches only the range.
        """
        with _edge(os.fspath(path)):
            attr = await self._attr(path)
            if attr.is_dir:
                raise IsADirectory(f"{_norm(path)} is a directory")
            inodes = self.engine.inodes
            inode = inodes.update(attr)
            try:
                size = inode.size
                lo = max(0, size + start) if start < 0 else min(start, size)
                hi = size if end is None else (max(0, size + end) if end < 0 else min(end, size))
                if hi <= lo:
                    return b""
                whole = lo == 0 and hi == size
                ra = self.engine.reader.new_readahead() if whole else None
                return await self.engine.reader.read(inode, lo, hi - lo, ra)
            finally:
                inodes.drop_if_idle(inode)

    async def write_bytes(
        self, path: str | os.PathLike[str], data: bytes | bytearray | memoryview
    ) -> None:
        """Create or replace a file with ``data``; committed when this returns."""
        f = await self.open(path, "wb")
        try:
            await f.write(data)
        finally:
            await f.close()

    async def open(self, path: str | os.PathLike[str], mode: str = "rb") -> AsyncFile:
        """Open a file (always binary): ``rb``, ``r+b``, ``wb`` (create or
        truncate), ``ab``, ``xb``.

        Written bytes are committed (visible to every mount and client) when
        ``flush``/``close`` returns.
        """
        m = _parse_mode(mode)
        spath = os.fspath(path)
        with _edge(spath):
            if m != "rb":
                self._writable()
            if m[0] == "r":
                attr = await self._attr(path)
            else:
                parent, name = await self._parent(path)
                raw = os.fsencode(name)
                try:
                    attr = await self.meta.mutate(
                        C.Mknod(self.volume, parent, raw, 0o644 | stat_mod.S_IFREG, 0, self._uid, self._gid)
                    )
                except Exists:
                    if m == "xb":
                        raise
                    attr = await self.meta.query(Q.Lookup(self.volume, parent, raw))
            if attr.is_dir:
                raise IsADirectory(f"{_norm(path)} is a directory")
            inode = await self.engine.open(attr.ino, attr)
            try:
                if m == "wb" and inode.size:
                    await self.engine.setattr(inode.ino, size=0)
            except BaseException:
                await self.engine.release(inode)
                raise
        f = AsyncFile(self, inode, _norm(path), m)
        self._files.add(f)
        return f

    async def aclose(self) -> None:
        """Close open files (committing what they wrote) and the session."""
        if self.closed:
            return
        self.closed = True
        for f in list(self._files):
            try:
                await f.close()
            except OSError as exc:
                log.error("could not commit %s at close: %s", f.path, exc)
        # Ending the session early only saves the metanodes its timeout; a
        # cluster that is already gone must not hold the caller for 30 s.
        with trio.move_on_after(CLOSE_TIMEOUT):
            await self.session.close()

    def stats(self) -> dict[str, Any]:
        """Counters of the read path (L1, fetches) and block chain (cache vs backing)."""
        return self.engine.stats()


class AsyncFile:
    """An open file of an :class:`AsyncFileSystem` (position, readahead state)."""

    def __init__(self, fs: AsyncFileSystem, inode: Inode, path: str, mode: str) -> None:
        self.fs = fs
        self.inode = inode
        self.path = path
        self.mode = mode
        self.readable, self.writable = _MODES[mode]
        self.pos = inode.size if mode == "ab" else 0
        self._ra: Readahead = fs.engine.reader.new_readahead()
        self.closed = False

    @property
    def size(self) -> int:
        return self.inode.size

    def _check(self, want: str) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file")
        if want == "r" and not self.readable:
            raise io.UnsupportedOperation("file not open for reading")
        if want == "w" and not self.writable:
            raise io.UnsupportedOperation("file not open for writing")

    async def read(self, size: int = -1) -> bytes:
        self._check("r")
        if size is None or size < 0:
            size = max(0, self.inode.size - self.pos)
        data = await self.pread(self.pos, size)
        self.pos += len(data)
        return data

    async def pread(self, offset: int, size: int) -> bytes:
        self._check("r")
        with _edge(self.path):
            return await self.fs.engine.reader.read(self.inode, offset, size, self._ra)

    async def write(self, data: bytes | bytearray | memoryview) -> int:
        self._check("w")
        if self.mode == "ab":
            self.pos = self.inode.size
        n = await self.pwrite(self.pos, data)
        self.pos += n
        return n

    async def pwrite(self, offset: int, data: bytes | bytearray | memoryview) -> int:
        self._check("w")
        if not data:
            return 0
        with _edge(self.path):
            await self.fs.engine.writer(self.inode).write(offset, bytes(data))
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if self.closed:
            raise ValueError("I/O operation on closed file")
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.inode.size}[whence]
        if base + offset < 0:
            raise OSError(22, "negative seek position", self.path)
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    async def flush(self) -> None:
        """Commit what this client wrote to the file so far."""
        if self.closed:
            raise ValueError("I/O operation on closed file")
        if self.inode.writer is not None:
            with _edge(self.path):
                await self.inode.writer.flush()

    async def truncate(self, size: int | None = None) -> int:
        self._check("w")
        size = self.pos if size is None else size
        await self.flush()
        with _edge(self.path):
            await self.fs.engine.setattr(self.inode.ino, size=size)
        return size

    async def close(self) -> None:
        """Commit and release; raises OSError if the data could not be stored."""
        if self.closed:
            return
        self.closed = True
        self.fs._files.discard(self)
        try:
            if self.writable and self.inode.writer is not None:
                with _edge(self.path):
                    await self.inode.writer.flush()
        finally:
            with _edge(self.path):
                await self.fs.engine.release(self.inode)

    async def __aenter__(self) -> AsyncFile:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
