"""Whether this host can run real FUSE mounts (root, ``/dev/fuse``, ``fusermount3``)."""

from __future__ import annotations

import os
import shutil


def fuse_unavailable() -> str | None:
    """None when FUSE mounts can run here, else why not (a skip reason)."""
    if os.geteuid() != 0:
        return "needs root (FUSE mounts)"
    if not os.path.exists("/dev/fuse"):
        return "needs /dev/fuse"
    if shutil.which("fusermount3") is None:
        return "needs fusermount3 (apt-get install fuse3)"
    return None
