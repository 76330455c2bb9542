"""The synchronous face of the native API.

:class:`FileSystem` runs an :class:`~.asyncfs.AsyncFileSystem` on a trio loop
in a background thread (one per client object) and calls into it with
``trio.from_thread``; :class:`File` and the buffered classes are the file
objects its ``open`` returns; :func:`connect` makes one.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import queue
import ssl
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, TypeVar, cast

import trio

from cachefs.credentials import Credential

from ..volume import ClientOptions
from .asyncfs import AsyncFile, AsyncFileSystem, DirEntry, _norm, _parse_mode
from .startup import CONNECT_TIMEOUT, client_tls, open_volume

log = logging.getLogger(__name__)

T = TypeVar("T")

BUFFER_SIZE = 1 << 20


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
        secret: bytes | str | Credential | None = None,
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
    secret: bytes | str | Credential | None = None,
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
        options = replace(options or ClientOptions(), **tunables)
    return FileSystem(meta_addrs, volume, secret=secret, zone=zone, options=options,
                      connect_timeout=connect_timeout, token=token, tls_cert=tls_cert,
                      tls_key=tls_key, tls_ca=tls_ca)  # fmt: skip
