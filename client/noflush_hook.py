"""FOPEN_NOFLUSH for read-only opens: their close(2) sends no FUSE_FLUSH.

Why: the kernel sends FLUSH at every close and the closing process waits for
the answer, one trip through pyfuse3 and the trio loop, though a handle
opened read-only has nothing to commit. For a small file read from the page
cache that trip is a third of what its open-read-close costs. The kernel
(5.17 on, ``fuse_flush`` in fs/fuse/file.c) skips FLUSH for a file opened
with FOPEN_NOFLUSH, unless the mount has a writeback cache (this one has
none), and libfuse 3.14 sends that flag for ``fuse_file_info.noflush``; but
pyfuse3 3.5's ``FileInfo`` has no such field.

How: pyfuse3's ``open`` copies the request's ``fuse_file_info`` and answers
with that copy after setting only the fields its ``FileInfo`` has (fh,
direct_io, keep_cache, nonseekable), so a bit set in the request survives
into the answer. :func:`install` puts a wrapper in the session's ``open``
slot (:mod:`.libfuse_ops`) that sets ``noflush`` when the flags are
O_RDONLY, then calls pyfuse3's ``open``. A handle opened for writing still
gets its FLUSH: close() returns only after its data is committed.

Called by libfuse in the trio thread with the GIL held (pyfuse3's handlers
run there); pyfuse3's C function is called back the same way
(``PYFUNCTYPE``: the GIL stays held, which its Cython code needs).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable

from .libfuse_ops import OpsTable

log = logging.getLogger(__name__)

# struct fuse_file_info (libfuse 3.14, fuse_common.h): int flags, then the
# bit fields writepage, direct_io, keep_cache, flush, nonseekable,
# flock_release, cache_readdir, noflush.
BITS_OFFSET = 4
NOFLUSH = 1 << 7

OPEN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p)
PYFUSE3_OPEN = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p)

def install(ops: OpsTable) -> bool:
    """Answer read-only opens with FOPEN_NOFLUSH in the session whose
    operations are ``ops``. Returns False, having logged why, when this
    build cannot take it (closes are then flushed as before)."""

    def make(pyfuse3_open: Callable[[int, int, int], None]) -> Callable[[int, int, int], None]:
        def open_noflush(req: int, ino: int, fi: int) -> None:
            try:
                if ctypes.c_int.from_address(fi).value & os.O_ACCMODE == os.O_RDONLY:
                    bits = ctypes.c_uint32.from_address(fi + BITS_OFFSET)
                    bits.value |= NOFLUSH
            finally:  # whatever happened, pyfuse3 answers the request
                pyfuse3_open(req, ino, fi)

        return open_noflush

    if not ops.wrap("open", OPEN, PYFUSE3_OPEN, make):
        log.warning("read-only closes stay flushed on this mount: pyfuse3 sets no open operation")
        return False
    return True
