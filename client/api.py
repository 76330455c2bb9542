"""The native Python API: a cachefs volume as a library, without FUSE.

Training code that reads through the mount pays a kernel round trip (and a
copy) per 128 KiB-1 MiB request; reading in-process skips both, as 3FS's
native API and CubeFS's AI-framework plugin do beside their FUSE clients.
The library runs the mount's own engine, not a second implementation: a
:class:`~cachefs.client.volume.Volume` (the session with its metanode calls,
cache-ring routing, backing-storage fallback and transports; L1, readahead
and one fetch per block however many readers ask; buffered writes cut into
slices and committed in order; compaction), with path calls on top. So what
the library writes, a mount sees after close, and the other way round
(close-to-open: every ``open``/``stat`` asks the metanodes).

Two entry points:

- trio-native: ``async with open_volume(meta_addrs, volume, secret=...) as fs``
  gives an :class:`AsyncFileSystem` whose workers (session upkeep, readahead,
  uploads) live in a nursery of the caller's run;
- synchronous: ``connect(meta_addrs, volume, secret=...)`` gives a
  :class:`FileSystem` that runs that same object on a trio loop in a
  background thread (one per client object) and calls into it with
  ``trio.from_thread``. It is safe to use from many threads at once. It does
  not survive ``fork``: a child process must connect on its own (the torch
  Dataset and the fsspec filesystem do that lazily per process).

A cluster that runs TLS (the daemons' ``--tls-cert/--tls-key/--tls-ca``)
takes the same three files here: ``tls_cert=``, ``tls_key=``, ``tls_ca=``
(all or none; TLS in the cluster is mutual, so the client shows a
certificate signed by ``tls_ca`` too). A volume with a mount token takes it
as ``token=``.

Paths are volume paths (``"a/b.bin"`` or ``"/a/b.bin"``); ``..`` in a path
is resolved lexically, symbolic links are followed (``lstat`` and
``readlink`` do not), and directory listings describe links as links.
Errors are raised as :class:`OSError` with the POSIX errno (so
``FileNotFoundError``, ``FileExistsError``...), the cachefs error chained as
``__cause__``: the library boundary is an edge, like the FUSE one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import io
import logging
import os
import queue
import ssl
import stat as stat_mod
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import trio

from cachefs.errors import (
    AuthFailed,
    CacheFSError,
    ConnectionLost,
    Exists,
    InvalidArgument,
    IsADirectory,
    NotADirectory,
    NotFound,
    ReadOnly,
    TooManyLinks,
)
from cachefs.messages import Attr
from cachefs.rpc import RpcPool

from .inodes import Inode
from .reader import Readahead
from .session import Session
from .volume import ClientOptions, Volume

log = logging.getLogger(__name__)

T = TypeVar("T")

ROOT_INO = 1
READDIR_BATCH = 1024
CONNECT_TIMEOUT = 10.0
CLOSE_TIMEOUT = 5.0
PROBE_TIMEOUT = 5.0  # per metanode, when explaining a connect that timed out
IDLE_INODES = 65536  # closed files whose slice lists are kept for their next open
BUFFER_SIZE = 1 << 20
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


def client_tls(
    tls_cert: str | os.PathLike[str] | None,
    tls_key: str | os.PathLike[str] | None,
    tls_ca: str | os.PathLike[str] | None,
) -> ssl.SSLContext | None:
    """The client side of the mount's ``--tls-cert/--tls-key/--tls-ca`` (None: no TLS).

    The same loader as the daemons and the mount (all three files or none,
    checked before anything connects), with a ``ValueError`` naming the
    keyword arguments instead of the command line's usage error.
    """
    import click

    from cachefs.config import load_tls

    paths = [os.fspath(p) if p else None for p in (tls_cert, tls_key, tls_ca)]
    try:
        return load_tls(*paths)[1]
    except click.UsageError as exc:
        raise ValueError(f"cachefs: {exc.message.replace('--tls-', 'tls_')}") from None


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
            "st_blksize": block_size, "st_blocks": (attr.size + 511) // 512, "st_rdev": attr.rdev,
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
                attr = await self.session.lookup(here, os.fsencode(name))
            except NotFound:
                self._forget_name(here, name)
                raise
            if stat_mod.S_ISLNK(attr.mode) and (follow_last or not last):
                hops += 1
                if hops > MAX_LINKS:
                    raise TooManyLinks(f"too many levels of symbolic links in {os.fspath(path)}")
                target = os.fsdecode(await self.session.readlink(attr.ino))
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
        return parent, stack[-1], await self.session.getattr(stack[-1])

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
            await self.session.symlink(
                parent, os.fsencode(name), os.fsencode(target), self._uid, self._gid
            )

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
            return os.fsdecode(await self.session.readlink(attr.ino))

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
                rows = await self.session.readdir(ino, cookie, READDIR_BATCH)
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
            await self.session.mkdir(
                parent, os.fsencode(name), mode | stat_mod.S_IFDIR, self._uid, self._gid
            )

    async def makedirs(
        self, path: str | os.PathLike[str], mode: int = 0o755, exist_ok: bool = False
    ) -> None:
        with _edge(os.fspath(path)):
            self._writable()
            names = split_path(path)
            ino = ROOT_INO
            for i, name in enumerate(names):
                try:
                    attr = await self.session.mkdir(
                        ino, os.fsencode(name), mode | stat_mod.S_IFDIR, self._uid, self._gid
                    )
                except Exists:
                    attr = await self._attr("/".join(names[: i + 1]))  # a link to a dir will do
                    if not attr.is_dir:
                        raise NotADirectory(
                            f"{'/'.join(names[: i + 1])} is not a directory"
                        ) from None
                    if i == len(names) - 1 and not exist_ok:
                        raise
                ino = attr.ino

    async def remove(self, path: str | os.PathLike[str]) -> None:
        with _edge(os.fspath(path)):
            self._writable()
            parent, name = await self._parent(path)
            await self.session.unlink(parent, os.fsencode(name))

    unlink = remove

    async def rmdir(self, path: str | os.PathLike[str]) -> None:
        with _edge(os.fspath(path)):
            self._writable()
            parent, name = await self._parent(path)
            self._forget_name(parent, name)
            await self.session.rmdir(parent, os.fsencode(name))

    async def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        """Atomic rename; an existing ``dst`` file (or empty directory) is replaced."""
        with _edge(os.fspath(src)):
            self._writable()
            parent, name = await self._parent(src)
            new_parent, new_name = await self._parent(dst)
            self._forget_name(parent, name)
            self._forget_name(new_parent, new_name)
            await self.session.rename(
                parent, os.fsencode(name), new_parent, os.fsencode(new_name), 0
            )

    async def statfs(self) -> dict[str, Any]:
        with _edge():
            return await self.session.statfs()

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
                    attr = await self.session.mknod(
                        parent, raw, 0o644 | stat_mod.S_IFREG, 0, self._uid, self._gid
                    )
                except Exists:
                    if m == "xb":
                        raise
                    attr = await self.session.lookup(parent, raw)
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


@contextlib.asynccontextmanager
async def open_volume(
    meta_addrs: Sequence[str] | str,
    volume: str,
    *,
    secret: bytes | str | None = None,
    zone: str = "",
    options: ClientOptions | None = None,
    connect_timeout: float = CONNECT_TIMEOUT,
    token: str | None = None,
    tls_cert: str | os.PathLike[str] | None = None,
    tls_key: str | os.PathLike[str] | None = None,
    tls_ca: str | os.PathLike[str] | None = None,
    tls_context: ssl.SSLContext | None = None,
) -> AsyncIterator[AsyncFileSystem]:
    """Connect to ``volume`` for the duration of the block (trio-native).
    ``token``: the volume's mount token (an open volume needs none).
    ``tls_cert``/``tls_key``/``tls_ca``: PEM files for a TLS cluster, as
    the mount's ``--tls-*`` options (all three or none); ``tls_context``: an
    already made client context instead of the files.

    The client's own tasks (session upkeep, readahead, uploads) run in a
    nursery inside this block, so, as with any nursery, an exception leaving
    the block comes out in an ``ExceptionGroup``.

    Raises:
        OSError: the volume does not exist (ENOENT), the secret, the
            volume token or the TLS handshake was refused (EACCES), no
            metanode answered in ``connect_timeout`` (ETIMEDOUT).
        ValueError: an incomplete or unreadable set of TLS files.
    """
    addrs = _addrs(meta_addrs)
    options = options or ClientOptions()
    if tls_context is not None and any((tls_cert, tls_key, tls_ca)):
        raise ValueError("cachefs: give tls_context or the tls_cert/tls_key/tls_ca files, not both")
    tls = tls_context or client_tls(tls_cert, tls_key, tls_ca)
    failure: BaseException | None = None
    async with RpcPool(secret=_secret(secret), tls=tls) as pool:
        try:
            with trio.fail_after(connect_timeout):
                session = await Session.connect(
                    pool, addrs, volume, zone=zone, transport=options.transport,
                    client_id=f"api-{uuid.uuid4().hex[:12]}", token=token,
                )  # fmt: skip
        except trio.TooSlowError:
            failure = await _why_no_answer(addrs, _secret(secret), tls, connect_timeout)
        except CacheFSError as exc:
            failure = _oserror(exc, f"cachefs:{volume}")
        else:
            async with trio.open_nursery() as nursery:
                fs = AsyncFileSystem(Volume(session, options, nursery=nursery, ghosts=IDLE_INODES))
                try:
                    yield fs
                finally:
                    with trio.CancelScope(shield=True):
                        await fs.aclose()
                    nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure


async def _why_no_answer(
    addrs: list[str], secret: bytes | None, tls: ssl.SSLContext | None, waited: float
) -> OSError:
    """The error for a connect that timed out.

    A metanode that refuses this client's TLS certificate ends each new
    connection right after the handshake, which the session takes for a lost
    connection and retries until the time is up. So ask every address once,
    all at the same time on a fresh pool, and name a refused certificate
    instead of a timeout.
    """
    refusals: list[OSError] = []

    async def probe(pool: RpcPool, addr: str) -> None:
        try:
            with trio.move_on_after(PROBE_TIMEOUT):
                await pool.call(addr, "health", timeout=PROBE_TIMEOUT)
        except AuthFailed as exc:  # the handshake itself refused (e.g. TLS 1.2)
            refusals.append(PermissionError(errno.EACCES, exc.message))
        except ConnectionLost as exc:
            if tls is not None and "TLS" in exc.message:
                refusals.append(PermissionError(
                    errno.EACCES,
                    f"the metanode at {addr} refused this client's TLS certificate "
                    f"({exc.message.strip()}); tls_cert must be signed by the cluster's CA",
                ))  # fmt: skip
        except CacheFSError:
            pass

    async with RpcPool(secret=secret, tls=tls) as pool, trio.open_nursery() as nursery:
        for addr in addrs:
            nursery.start_soon(probe, pool, addr)
    if refusals:
        return refusals[0]
    hint = "" if tls else " (a TLS cluster needs tls_cert, tls_key and tls_ca)"
    return TimeoutError(
        errno.ETIMEDOUT, f"no metanode at {','.join(addrs)} answered within {waited:.0f}s{hint}"
    )


def _addrs(meta_addrs: Sequence[str] | str) -> list[str]:
    addrs = meta_addrs.split(",") if isinstance(meta_addrs, str) else list(meta_addrs)
    addrs = [a.strip() for a in addrs if a.strip()]
    if not addrs:
        raise ValueError("no metanode addresses given")
    return addrs


def _secret(secret: bytes | str | None) -> bytes | None:
    if isinstance(secret, str):
        return secret.encode()
    return secret


# ---------------------------------------------------------------------- sync


def _stop_loop(
    token: trio.lowlevel.TrioToken, stop: trio.Event, thread: threading.Thread, pid: int
) -> None:
    """The finalizer of a :class:`FileSystem` (close, garbage collection, exit).

    Only in the process that made it: a forked child holds a copy of the
    object but not the loop thread, and the token's wake-up socket is shared
    with the parent, so calling into it from the child would wait forever.
    """
    if os.getpid() != pid:
        return
    if thread.ident == threading.get_ident():  # dropped on its own loop: just ask it to stop
        stop.set()
        return
    with contextlib.suppress(trio.RunFinishedError, RuntimeError):
        trio.from_thread.run_sync(stop.set, trio_token=token)
    thread.join(timeout=60)


class FileSystem:
    """A volume for synchronous code: :class:`AsyncFileSystem` on a trio loop
    in a background thread. Make it with :func:`connect`; close it (or use it
    as a context manager) to commit open files and end the session."""

    def __init__(
        self,
        meta_addrs: Sequence[str] | str,
        volume: str,
        *,
        secret: bytes | str | None = None,
        zone: str = "",
        options: ClientOptions | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        token: str | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
    ) -> None:
        self.volume = volume
        self.pid = os.getpid()
        tls = client_tls(tls_cert, tls_key, tls_ca)  # a bad set fails here, in the caller's thread
        ready: queue.Queue[Any] = queue.Queue(1)
        args = (meta_addrs, volume, secret, zone, options, connect_timeout, token, tls, ready)
        self._thread = threading.Thread(
            target=self._main, args=args, name=f"cachefs-{volume}", daemon=True
        )
        self._thread.start()
        result = ready.get()
        if isinstance(result, BaseException):
            self._thread.join()
            raise result
        self._token, self._afs, self._stop = result
        self.aio: AsyncFileSystem = self._afs
        self._finalizer = weakref.finalize(
            self, _stop_loop, self._token, self._stop, self._thread, self.pid
        )

    @staticmethod
    def _main(meta_addrs: Any, volume: str, secret: Any, zone: str, options: Any,
              connect_timeout: float, token: str | None, tls: ssl.SSLContext | None,
              ready: queue.Queue[Any]) -> None:  # fmt: skip
        told = False

        async def main() -> None:
            nonlocal told
            async with open_volume(meta_addrs, volume, secret=secret, zone=zone, options=options,
                                   connect_timeout=connect_timeout, token=token,
                                   tls_context=tls) as afs:  # fmt: skip
                stop = trio.Event()
                ready.put((trio.lowlevel.current_trio_token(), afs, stop))
                told = True
                await stop.wait()

        try:
            trio.run(main)
        except BaseException as exc:  # handed to the thread that called connect()
            if not told:
                ready.put(exc)
            else:
                log.exception("cachefs client loop for %s ended with an error", volume)

    # -- plumbing

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` on this client's trio loop and return its result."""
        if os.getpid() != self.pid:
            raise RuntimeError(
                "a cachefs FileSystem does not survive fork(); connect again in the child"
            )
        if not self._finalizer.alive:
            raise ValueError("this cachefs FileSystem is closed")
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise ValueError("this cachefs FileSystem is closed") from None

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start ``fn(*args)`` as a background task of this client; returns at once."""
        self.call(self._spawn, fn, args)

    async def _spawn(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        self._afs.start_soon(fn, *args)

    @property
    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def close(self) -> None:
        """Commit open files, end the session and stop the loop thread."""
        if os.getpid() == self.pid:
            self._finalizer()
        else:
            self._finalizer.detach()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> FileSystem:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the API (see AsyncFileSystem for the meaning of each)

    def stat(self, path: str | os.PathLike[str]) -> os.stat_result:
        return self.call(self._afs.stat, path)

    def lstat(self, path: str | os.PathLike[str]) -> os.stat_result:
        return self.call(self._afs.lstat, path)

    def symlink(self, target: str, path: str | os.PathLike[str]) -> None:
        self.call(self._afs.symlink, target, path)

    def readlink(self, path: str | os.PathLike[str]) -> str:
        return self.call(self._afs.readlink, path)

    def utime(
        self,
        path: str | os.PathLike[str],
        times: tuple[float, float] | None = None,
        *,
        ns: tuple[int, int] | None = None,
        follow_symlinks: bool = True,
    ) -> None:
        self.call(functools.partial(self._afs.utime, path, times, ns=ns,
                                    follow_symlinks=follow_symlinks))  # fmt: skip

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return self.call(self._afs.exists, path)

    def isdir(self, path: str | os.PathLike[str]) -> bool:
        return self.call(self._afs.isdir, path)

    def isfile(self, path: str | os.PathLike[str]) -> bool:
        return self.call(self._afs.isfile, path)

    def scandir(self, path: str | os.PathLike[str] = "/") -> list[DirEntry]:
        return self.call(self._afs.scandir, path)

    def listdir(self, path: str | os.PathLike[str] = "/") -> list[str]:
        return self.call(self._afs.listdir, path)

    def walk(self, top: str | os.PathLike[str] = "/") -> Iterator[tuple[str, list[str], list[str]]]:
        """``os.walk`` top-down; prune ``dirnames`` in place to skip subtrees."""
        stack = [_norm(top)]
        while stack:
            where = stack.pop()
            try:
                entries = self.scandir(where)
            except (FileNotFoundError, NotADirectoryError):
                continue
            dirs = [e.name for e in entries if e.is_dir()]
            files = [e.name for e in entries if not e.is_dir()]
            yield where, dirs, files
            stack.extend(f"{where.rstrip('/')}/{d}" for d in reversed(dirs))

    def mkdir(self, path: str | os.PathLike[str], mode: int = 0o755) -> None:
        self.call(self._afs.mkdir, path, mode)

    def makedirs(
        self, path: str | os.PathLike[str], mode: int = 0o755, exist_ok: bool = False
    ) -> None:
        self.call(self._afs.makedirs, path, mode, exist_ok)

    def remove(self, path: str | os.PathLike[str]) -> None:
        self.call(self._afs.remove, path)

    unlink = remove

    def rmdir(self, path: str | os.PathLike[str]) -> None:
        self.call(self._afs.rmdir, path)

    def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        self.call(self._afs.rename, src, dst)

    def statfs(self) -> dict[str, Any]:
        return self.call(self._afs.statfs)

    def read_bytes(
        self, path: str | os.PathLike[str], start: int = 0, end: int | None = None
    ) -> bytes:
        return self.call(self._afs.read_bytes, path, start, end)

    def write_bytes(
        self, path: str | os.PathLike[str], data: bytes | bytearray | memoryview
    ) -> None:
        self.call(self._afs.write_bytes, path, data)

    def open(
        self,
        path: str | os.PathLike[str],
        mode: str = "rb",
        buffering: int = -1,
        encoding: str | None = None,
        errors: str | None = None,
        newline: str | None = None,
    ) -> Any:
        """Like the builtin ``open`` (but binary by default, as fsspec): text
        unless the mode has ``b``, buffered
        unless ``buffering=0`` (binary only; then a :class:`File`, the raw
        object). Closing (or ``flush``) commits what was written."""
        m = _parse_mode(mode)
        text = "b" not in mode
        if text and buffering == 0:
            raise ValueError("can't have unbuffered text I/O")
        raw = File(self, self.call(self._afs.open, path, m))
        if buffering == 0:
            return raw
        size = BUFFER_SIZE if buffering in (-1, 1) else buffering
        buffered: io.BufferedIOBase
        if m == "rb":
            buffered = BufferedReader(raw, size)
        elif m == "r+b":
            buffered = BufferedRandom(raw, size)
        else:
            buffered = BufferedWriter(raw, size)
        if text:
            return io.TextIOWrapper(buffered, encoding or "utf-8", errors, newline)
        return buffered

    def stats(self) -> dict[str, Any]:
        return self.call(_async_stats, self._afs)


async def _async_stats(afs: AsyncFileSystem) -> dict[str, Any]:
    return afs.stats()


class File(io.RawIOBase):
    """A raw binary file of a :class:`FileSystem` (each call crosses to the loop thread)."""

    def __init__(self, fs: FileSystem, afile: AsyncFile) -> None:
        super().__init__()
        self._fs = fs
        self._f = afile
        self.name = afile.path
        self.mode = afile.mode

    @property
    def size(self) -> int:
        return self._f.size

    def readable(self) -> bool:
        return self._f.readable

    def writable(self) -> bool:
        return self._f.writable

    def seekable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        return self._fs.call(self._f.read, -1 if size is None else size)

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def pread(self, offset: int, size: int) -> bytes:
        return self._fs.call(self._f.pread, offset, size)

    def write(self, data: Any) -> int:
        return self._fs.call(self._f.write, bytes(data))

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def truncate(self, size: int | None = None) -> int:
        return self._fs.call(self._f.truncate, size)

    def flush(self) -> None:
        """Commit written bytes (the mount's fsync)."""
        if self.closed or self._f.closed or not self._f.writable:
            return
        self._fs.call(self._f.flush)

    def close(self) -> None:
        if self.closed:
            return
        try:
            if not self._f.closed and not self._fs.closed and os.getpid() == self._fs.pid:
                if self._fs.in_loop_thread:
                    # Garbage-collected on the loop thread, which cannot block
                    # on itself: commit in the background instead.
                    self._fs.aio.start_soon(self._f.close)
                else:
                    self._fs.call(self._f.close)
        finally:
            super().close()


# Buffered files as the builtin open() returns them, plus ``.size`` (the file's
# size as this client sees it, which fsspec code reads) and a ``flush()`` that
# commits, as fsync does on the mount (io's own flush only hands the buffer to
# the raw file).


def _size(raw: Any) -> int:
    return cast(File, raw).size


class BufferedReader(io.BufferedReader):
    @property
    def size(self) -> int:
        return _size(self.raw)


class BufferedWriter(io.BufferedWriter):
    @property
    def size(self) -> int:
        return _size(self.raw)

    def flush(self) -> None:
        super().flush()
        self.raw.flush()


class BufferedRandom(io.BufferedRandom):
    @property
    def size(self) -> int:
        return _size(self.raw)

    def flush(self) -> None:
        super().flush()
        self.raw.flush()


def connect(
    meta_addrs: Sequence[str] | str,
    volume: str,
    *,
    secret: bytes | str | None = None,
    zone: str = "",
    options: ClientOptions | None = None,
    connect_timeout: float = CONNECT_TIMEOUT,
    token: str | None = None,
    tls_cert: str | os.PathLike[str] | None = None,
    tls_key: str | os.PathLike[str] | None = None,
    tls_ca: str | os.PathLike[str] | None = None,
    **tunables: Any,
) -> FileSystem:
    """Connect to ``volume`` of the cluster whose metanodes are ``meta_addrs``.

    ``token``: the volume's mount token (an open volume needs none);
    ``tls_cert``/``tls_key``/``tls_ca``: PEM files of a TLS cluster (all three
    or none, as the mount's ``--tls-*``). ``tunables`` are
    :class:`ClientOptions` fields (``l1_bytes=...``) applied over ``options``.

    Raises:
        OSError: see :func:`open_volume`.
    """
    if tunables:
        options = dataclasses.replace(options or ClientOptions(), **tunables)
    return FileSystem(meta_addrs, volume, secret=secret, zone=zone, options=options,
                      connect_timeout=connect_timeout, token=token, tls_cert=tls_cert,
                      tls_key=tls_key, tls_ca=tls_ca)  # fmt: skip


__all__ = [
    "AsyncFile",
    "AsyncFileSystem",
    "ClientOptions",
    "DirEntry",
    "File",
    "FileSystem",
    "client_tls",
    "connect",
    "open_volume",
    "split_path",
    "to_stat",
]
