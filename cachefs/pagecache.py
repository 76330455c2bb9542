"""Reads that never wait for the disk: what the page cache holds, else ``WouldBlock``.

An event loop (a datanode's or cache node's connection reader, a mount's
L2) reads inline what is already in memory and hands the rest to a worker
thread: one read from the disk on the loop stalls every request behind it.
"""

from __future__ import annotations

import errno
import os

_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
NOWAIT_READS = bool(_RWF_NOWAIT) and hasattr(os, "preadv")  # pread_nowait can tell, here


class WouldBlock(Exception):
    """A ``nowait`` read found bytes that are not in the page cache."""


def pread_nowait(fd: int, size: int, offset: int) -> bytearray:
    """``os.pread`` that never waits for the disk (``RWF_NOWAIT``).

    The kernel answers EAGAIN, or a short count, for bytes it would have to
    read from the disk; either is :class:`WouldBlock`. Callers ask only for
    bytes within the file, so a short count is not the end of the file (if
    it is, the blocking read that follows finds out).

    Raises:
        WouldBlock: some of the bytes are not in the page cache, or this
            system or filesystem cannot tell.
    """
    if not NOWAIT_READS:
        raise WouldBlock
    buf = bytearray(size)
    try:
        n = os.preadv(fd, [buf], offset, _RWF_NOWAIT)
    except BlockingIOError:
        raise WouldBlock from None
    except OSError as exc:
        if exc.errno == errno.EOPNOTSUPP:  # a filesystem without RWF_NOWAIT
            raise WouldBlock from None
        raise
    if n != size:
        raise WouldBlock
    return buf
