"""FUSE_LSEEK for pyfuse3, which has no handler for it: SEEK_DATA and SEEK_HOLE.

pyfuse3 (3.5) leaves libfuse's ``lseek`` operation unset: libfuse answers
ENOSYS, and the kernel then answers every SEEK_DATA with the offset asked
and every SEEK_HOLE with the file's size: all data, no holes. :func:`install`
sets that operation in the running session's table (:mod:`.libfuse_ops`),
as :mod:`.fallocate_hook` does for fallocate: the request runs as a task of
the mount and is answered with ``fuse_reply_lseek`` or ``fuse_reply_err``.
The kernel writes back the file's dirty pages before it asks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
from collections.abc import Awaitable, Callable

from cachefs.tasks import Spawner

from .libfuse_ops import OpsTable

log = logging.getLogger(__name__)

LSEEK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p)
Handler = Callable[[int, int, int], Awaitable[tuple[int, int]]]  # (ino, offset, whence) -> (errno, offset)

_installed: list[object] = []  # the callback must live as long as the session


def install(handler: Handler, spawner: Spawner, ops: OpsTable) -> bool:
    """Route FUSE_LSEEK to ``handler`` (run as a task of ``spawner``) in the
    session whose operations are ``ops``. Returns False, having logged why,
    when this build cannot take it."""
    if ops.pyfuse3_sets("lseek"):
        log.warning("SEEK_DATA/SEEK_HOLE stay the kernel's (no holes): pyfuse3 already sets lseek")
        return False
    try:
        libfuse = ctypes.CDLL(ctypes.util.find_library("fuse3") or "libfuse3.so.3")
        reply_err, reply_lseek = libfuse.fuse_reply_err, libfuse.fuse_reply_lseek
    except (OSError, AttributeError) as exc:
        log.warning("SEEK_DATA/SEEK_HOLE stay the kernel's (no holes): %s", exc)
        return False
    reply_err.argtypes = [ctypes.c_void_p, ctypes.c_int]
    reply_lseek.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    reply_err.restype = reply_lseek.restype = ctypes.c_int
    slot = ops.slot("lseek")

    async def answer(req: int, ino: int, offset: int, whence: int) -> None:
        err, found = errno.EIO, 0
        try:
            err, found = await handler(ino, offset, whence)
        finally:  # every request gets exactly one answer
            if err:
                reply_err(req, err)
            else:
                reply_lseek(req, found)

    @LSEEK
    def lseek(req: int, ino: int, offset: int, whence: int, _fi: int) -> None:
        try:
            spawner.start_soon(answer, req, ino, offset, whence, name="lseek")
        except BaseException:  # a ctypes callback must not raise
            log.exception("could not start lseek of inode %d", ino)
            reply_err(req, errno.EIO)

    _installed.append(lseek)
    ctypes.c_void_p.from_address(slot).value = ctypes.cast(lseek, ctypes.c_void_p).value
    return True
