"""The mount's control files: ``MOUNTPOINT/.cachefs/stats`` and ``.cachefs/accesslog``.

A virtual directory ``.cachefs`` under the root, which readdir never lists
and the metanodes never hear of (JuiceFS's ``.stats`` and ``.accesslog``, in
one directory). Its inode numbers sit far above any the metanodes allocate
(< 2**40), and so do the file handles of its files, so one comparison tells
a control request from a volume's.

- ``stats``: what the mount's ``/metrics`` serves for the mount itself (the
  same collector, Prometheus text), rendered once at open. ``cachefs stats``
  reads it every interval and prints the differences, so it works with
  ``--no-metrics``, without finding a port, and from inside a container or
  network namespace that only shares the mount (the reason for a file over
  the metrics endpoint).
- ``accesslog``: one line per FUSE request while someone reads it (``cat``,
  ``tail -f``); each open gets the lines from then on. With no reader the
  request path pays one truthiness test (``AccessLog.readers``); lines are
  formatted only for readers. A read waits up to a second for lines, then
  answers ``#`` so the reader neither sees end of file nor hangs (as JuiceFS
  does). A reader that falls behind loses the oldest lines, and is told how
  many. Requests on the control files themselves are not logged.

Sans pyfuse3: the front end (fs.py) turns these answers into pyfuse3's types.
"""

from __future__ import annotations

import errno
import stat
import time
from collections import deque
from collections.abc import Callable

import trio

from cachefs.messages import Attr

BASE = 1 << 62  # control inodes and handles: never a volume's inode (< 2**40) nor a file handle
DIR_INO = BASE
STATS_INO = BASE + 1
ACCESSLOG_INO = BASE + 2
NAME = b".cachefs"
FILES = {b"stats": STATS_INO, b"accesslog": ACCESSLOG_INO}
MAX_LINES = 10_000  # per reader; older lines are dropped past this
IDLE = 1.0  # seconds a read of the access log waits for a line


def is_control(number: int) -> bool:
    """An inode number or file handle of the control files."""
    return number >= BASE


class ControlError(Exception):
    """A request the control files refuse, with its errno."""

    def __init__(self, code: int) -> None:
        super().__init__(errno.errorcode.get(code, str(code)))
        self.errno = code


def _attr(ino: int, mode: int, nlink: int, started_ns: int) -> Attr:
    return Attr(ino, mode, 0, 0, nlink, 0, started_ns, started_ns, started_ns)


class _Tail:
    """One open of the access log: the lines since it was opened."""

    __slots__ = ("lines", "dropped", "ready", "pending")

    def __init__(self) -> None:
        self.lines: deque[str] = deque()
        self.dropped = 0
        self.ready = trio.Event()
        self.pending = b""  # bytes of lines taken but not yet read

    def push(self, line: str) -> None:
        if len(self.lines) >= MAX_LINES:
            self.lines.popleft()
            self.dropped += 1
        self.lines.append(line)
        self.ready.set()

    async def read(self, size: int) -> bytes:
        if not self.pending and not self.lines:
            with trio.move_on_after(IDLE):
                await self.ready.wait()
            if not self.lines:
                return b"#\n"
        if self.ready.is_set():
            self.ready = trio.Event()
        if self.dropped:
            self.pending += f"# {self.dropped} lines dropped: the reader fell behind\n".encode()
            self.dropped = 0
        while self.lines and len(self.pending) < size:
            self.pending += self.lines.popleft().encode()
        out, self.pending = self.pending[:size], self.pending[size:]
        return out


class AccessLog:
    """Fans one line per FUSE request out to every open of the access log."""

    def __init__(self) -> None:
        self.readers: list[_Tail] = []

    def record(self, op: str, args: tuple[object, ...], seconds: float, code: int) -> None:
        """Called only while ``readers`` is not empty (see fs.py's ``_fuse``)."""
        if args and isinstance(args[0], int) and is_control(args[0]):
            return
        now = time.time()
        ctx = next((a for a in args if hasattr(a, "pid")), None)
        who = f"[uid:{ctx.uid},gid:{ctx.gid},pid:{ctx.pid}] " if ctx is not None else ""  # type: ignore[attr-defined]
        shown = ",".join(_show(a) for a in args if a is not ctx)
        result = "OK" if not code else errno.errorcode.get(code, str(code))
        line = (f"{time.strftime('%Y.%m.%d %H:%M:%S', time.localtime(now))}.{int(now % 1 * 1e6):06d} "
                f"{who}{op} ({shown}): {result} <{seconds:.6f}>\n")
        for tail in self.readers:
            tail.push(line)


def _show(arg: object) -> str:
    """An argument as the log shows it: numbers and names; buffers by length."""
    if isinstance(arg, bool | int):
        return str(int(arg))
    if isinstance(arg, bytes | bytearray | memoryview):
        raw = bytes(arg)
        if len(raw) <= 255 and b"\n" not in raw:
            return raw.decode("utf-8", "backslashreplace")
        return f"<{len(raw)} bytes>"
    if isinstance(arg, list | tuple):
        return f"<{len(arg)} items>"
    return type(arg).__name__


class Control:
    """The control directory's requests; ``render_stats`` gives the stats file's bytes."""

    def __init__(self, render_stats: Callable[[], bytes]) -> None:
        self.render_stats = render_stats
        self.access = AccessLog()
        self._started_ns = time.time_ns()
        self._handles: dict[int, bytes | _Tail] = {}
        self._next_fh = BASE

    def attr(self, ino: int) -> Attr:
        if ino == DIR_INO:
            return _attr(ino, stat.S_IFDIR | 0o555, 2, self._started_ns)
        if ino in FILES.values():
            return _attr(ino, stat.S_IFREG | 0o444, 1, self._started_ns)
        raise ControlError(errno.ENOENT)

    def lookup(self, parent: int, name: bytes) -> Attr:
        if parent != DIR_INO or name not in FILES:
            raise ControlError(errno.ENOENT)
        return self.attr(FILES[name])

    def entries(self, start: int) -> list[tuple[bytes, Attr, int]]:
        """``(name, attr, cookie)`` of the directory after cookie ``start``."""
        listing = [(name, self.attr(ino), i + 1) for i, (name, ino) in enumerate(FILES.items())]
        return listing[start:]

    def open(self, ino: int, writable: bool) -> int:
        if ino not in FILES.values():
            raise ControlError(errno.EISDIR if ino == DIR_INO else errno.ENOENT)
        if writable:
            raise ControlError(errno.EACCES)
        fh = self._next_fh
        self._next_fh += 1
        if ino == STATS_INO:
            self._handles[fh] = self.render_stats()
        else:
            tail = _Tail()
            self._handles[fh] = tail
            self.access.readers.append(tail)
        return fh

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        handle = self._handles.get(fh)
        if handle is None:
            raise ControlError(errno.EBADF)
        if isinstance(handle, bytes):
            return handle[offset : offset + size]
        return await handle.read(size)

    def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if isinstance(handle, _Tail):
            self.access.readers.remove(handle)
