"""Dropping one file from the page cache, for tests of reads that must not wait for the disk."""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from pathlib import Path

_NR_CACHESTAT = 451  # Linux >= 6.5, the same number on every architecture
_RANGE = struct.Struct("<QQ")  # struct cachestat_range: off, len (0: to the end)
_STAT = struct.Struct("<5Q")  # struct cachestat: nr_cache first
_libc = ctypes.CDLL(None, use_errno=True)


def cached_pages(fd: int) -> int | None:
    """Pages of ``fd``'s file in the page cache (``cachestat(2)``), None where
    the kernel lacks the call. Unlike a RWF_NOWAIT probe it reads nothing:
    a NOWAIT read that misses starts the disk read, and on a fast disk this
    kernel may even complete it, putting back the pages it was to test."""
    rng = ctypes.create_string_buffer(_RANGE.pack(0, 0))
    out = ctypes.create_string_buffer(_STAT.size)
    if _libc.syscall(_NR_CACHESTAT, fd, rng, out, 0) != 0:
        err = ctypes.get_errno()
        if err == errno.ENOSYS:
            return None
        raise OSError(err, os.strerror(err))
    return _STAT.unpack(out.raw)[0]


def evict_from_page_cache(path: Path, tries: int = 20) -> bool:
    """Write back and drop ``path``'s pages; False when the kernel keeps some
    after ``tries`` attempts (or cannot say, and a probe found them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(tries):
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            left = cached_pages(fd)
            if left == 0:
                return True
            if left is None:
                try:
                    os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT)
                except BlockingIOError:
                    return True
                return False
        return False
    finally:
        os.close(fd)
