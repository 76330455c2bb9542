"""FUSE_FALLOCATE for pyfuse3, which has no handler for it.

pyfuse3 (3.5, and upstream so far) leaves libfuse's ``fallocate`` operation
unset: libfuse answers ENOSYS and the kernel then fails every fallocate(2)
on the mount with EOPNOTSUPP. :func:`install` sets that one operation in the
running session's table (:mod:`.libfuse_ops`); the slot must be empty in
pyfuse3's, else fallocate stays unsupported (logged) and nothing is written.

The handler is a ctypes callback that libfuse calls in the trio thread,
inside pyfuse3's ``fuse_session_process_buf``; it starts the request as a
task of the mount and answers it with ``fuse_reply_err``.
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

FALLOCATE = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p
)
Handler = Callable[[int, int, int, int], Awaitable[int]]  # (ino, mode, offset, length) -> errno

_installed: list[object] = []  # the callback must live as long as the session


def install(handler: Handler, spawner: Spawner, ops: OpsTable) -> bool:
    """Route FUSE_FALLOCATE to ``handler`` (run as a task of ``spawner``) in
    the session whose operations are ``ops``. Returns False, having logged
    why, when this build cannot take it."""
    if ops.pyfuse3_sets("fallocate"):
        log.warning("fallocate stays unsupported on this mount: pyfuse3 already sets the operation")
        return False
    try:
        libfuse = ctypes.CDLL(ctypes.util.find_library("fuse3") or "libfuse3.so.3")
        reply_err = libfuse.fuse_reply_err
        reply_err.argtypes = [ctypes.c_void_p, ctypes.c_int]
        reply_err.restype = ctypes.c_int
    except (OSError, AttributeError) as exc:
        log.warning("fallocate stays unsupported on this mount (EOPNOTSUPP): %s", exc)
        return False
    slot = ops.slot("fallocate")

    async def answer(req: int, ino: int, mode: int, offset: int, length: int) -> None:
        err = errno.EIO
        try:
            err = await handler(ino, mode, offset, length)
        finally:
            reply_err(req, err)  # every request gets exactly one answer

    @FALLOCATE
    def fallocate(req: int, ino: int, mode: int, offset: int, length: int, _fi: int) -> None:
        try:
            spawner.start_soon(answer, req, ino, mode, offset, length, name="fallocate")
        except BaseException:  # a ctypes callback must not raise
            log.exception("could not start fallocate of inode %d", ino)
            reply_err(req, errno.EIO)

    _installed.append(fallocate)
    ctypes.c_void_p.from_address(slot).value = ctypes.cast(fallocate, ctypes.c_void_p).value
    return True
