"""Dropping one file from the page cache, for tests of reads that must not wait for the disk."""

from __future__ import annotations

import os
from pathlib import Path


def evict_from_page_cache(path: Path) -> bool:
    """Write back and drop ``path``'s pages; False when the filesystem keeps them anyway."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        try:
            os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT)
        except BlockingIOError:
            return True
        return False
    finally:
        os.close(fd)
