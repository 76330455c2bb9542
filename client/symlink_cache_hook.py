"""FUSE_CACHE_SYMLINKS: the kernel keeps a symlink's target in its page cache.

Why: without it every readlink(2), and every path walk through a symlink,
is a FUSE request through pyfuse3 and the trio loop, however long the
kernel keeps the symlink's dentry and attributes. A symlink's target never
changes in cachefs (a new target is a new inode: ``symlink`` after
``unlink``, or a rename over it), and inode numbers are never reused, so a
kept target is never stale. The kernel drops it with the inode, or on
``invalidate_inode``, which a revoked lease sends.

How: libfuse 3.14 asks the kernel for FUSE_CACHE_SYMLINKS when the
filesystem's ``init`` sets ``FUSE_CAP_CACHE_SYMLINKS`` in ``conn->want``;
pyfuse3 3.5's ``init`` does not. :func:`install` puts a wrapper in the
session's ``init`` slot (:mod:`.libfuse_ops`) that calls pyfuse3's ``init``
and then adds the flag when the kernel offers it. Called by libfuse in the
trio thread, with the GIL held, for the kernel's INIT request, which waits
in /dev/fuse until the mount's loop reads it: install before ``pyfuse3.main``.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

from .libfuse_ops import OpsTable

log = logging.getLogger(__name__)

# struct fuse_conn_info (libfuse 3.14, fuse_common.h): unsigned proto_major,
# proto_minor, max_write, max_read, max_readahead, capable, want, ...
CAPABLE_OFFSET = 20
WANT_OFFSET = 24
FUSE_CAP_CACHE_SYMLINKS = 1 << 23

INIT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
PYFUSE3_INIT = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)

def install(ops: OpsTable) -> bool:
    """Ask for FUSE_CACHE_SYMLINKS in the session whose operations are
    ``ops``. Returns False, having logged why, when this build cannot
    (every readlink is then a request, as before)."""

    def make(pyfuse3_init: Callable[[int, int], None]) -> Callable[[int, int], None]:
        def init_cache_symlinks(userdata: int, conn: int) -> None:
            pyfuse3_init(userdata, conn)
            capable = ctypes.c_uint32.from_address(conn + CAPABLE_OFFSET).value
            if capable & FUSE_CAP_CACHE_SYMLINKS:
                want = ctypes.c_uint32.from_address(conn + WANT_OFFSET)
                want.value |= FUSE_CAP_CACHE_SYMLINKS
            else:
                log.info("the kernel does not offer FUSE_CACHE_SYMLINKS: symlink targets stay uncached")

        return init_cache_symlinks

    if not ops.wrap("init", INIT, PYFUSE3_INIT, make):
        log.warning("symlink targets stay uncached: pyfuse3 sets no init operation")
        return False
    return True
