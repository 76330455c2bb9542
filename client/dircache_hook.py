"""FOPEN_CACHE_DIR for directories this mount holds a lease on: the kernel
keeps their listings.

Why: every listing is otherwise an OPENDIR, READDIR requests through pyfuse3
and the trio loop, and a ``LoadDir`` round trip to the metanode leader, even
when nothing changed. Under a lease nothing changes unseen: the leader
revokes the lease (and the mount invalidates the directory's inode, which
drops the kernel's cached listing with its pages) before it applies another
client's change, and the kernel itself forgets the listing when this mount
changes the directory (its i_version) or when the directory's mtime moves.

When: :func:`install` wraps the session's ``opendir`` slot
(:mod:`.libfuse_ops`); the wrapper asks ``cacheable(ino)`` synchronously,
before pyfuse3's ``opendir`` copies the request's ``fuse_file_info`` (whose
bits then survive into the answer, as :mod:`.noflush_hook` relies on for
``open``), and sets ``cache_readdir`` and ``keep_cache`` when it says so
(the kernel, 6.18 here, drops a directory's kept listing at an opendir
answered without ``keep_cache``). ``cacheable`` says yes
only under a lease whose start the kernel's cache has been emptied since (see
``CacheFS.dir_cacheable``): a listing kept from before, under a lease since
lost without a revocation (lapsed, dropped at a failover), is never read.
pyfuse3 3.5's ``opendir`` cannot set the bit itself. Called by libfuse in the
trio thread with the GIL held; pyfuse3's C function is called back the same way.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

from .libfuse_ops import OpsTable
from .noflush_hook import BITS_OFFSET

log = logging.getLogger(__name__)

KEEP_CACHE = 1 << 2  # fuse_file_info's bit fields (see noflush_hook)
CACHE_READDIR = 1 << 6

OPENDIR = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p)
PYFUSE3_OPENDIR = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p)

def install(cacheable: Callable[[int], bool], ops: OpsTable) -> bool:
    """Let the kernel keep the listings of directories ``cacheable`` names,
    in the session whose operations are ``ops``. Returns False, having
    logged why, when this build cannot (every listing is then read from the
    mount, as before)."""

    def make(pyfuse3_opendir: Callable[[int, int, int], None]) -> Callable[[int, int, int], None]:
        def opendir_cached(req: int, ino: int, fi: int) -> None:
            try:
                if cacheable(ino):
                    bits = ctypes.c_uint32.from_address(fi + BITS_OFFSET)
                    bits.value |= CACHE_READDIR | KEEP_CACHE
            except Exception:  # never let a question stop the answer
                log.exception("dircache: deciding on directory %d", ino)
            finally:  # whatever happened, pyfuse3 answers the request
                pyfuse3_opendir(req, ino, fi)

        return opendir_cached

    if not ops.wrap("opendir", OPENDIR, PYFUSE3_OPENDIR, make):
        log.warning("listings stay uncached by the kernel: pyfuse3 sets no opendir operation")
        return False
    return True
