"""Spill files: where a mount keeps written bytes it could not commit at unmount.

An unmount must end even when a dirty file cannot be committed (the cluster
refuses it, is out of reach, or the commits cannot finish in time): waiting
forever keeps every process that touches the mount hanging, and killing the
daemon loses the bytes silently. So what is still uncommitted when the
unmount's commit deadline passes, or whose commit failed, is written to a
local spill file, named in the log at ERROR, and the unmount goes on.

A spill is two files in the spill directory (``--spill-dir``, default
``/var/lib/cachefs/spill``):

- ``VOLUME-INO-STAMP.data``: a sparse file with every uncommitted byte at its
  own file offset, written oldest first, so where writes overlap the newest
  wins, as it would have in the file;
- ``VOLUME-INO-STAMP.json``: the inode, the volume, the reason, and the
  extents (``[[offset, length], ...]``) that hold data; bytes outside them are
  not part of the spill (holes read as zeros).

To recover, copy each extent into the file, e.g.
``dd if=X.data of=FILE bs=1M iflag=skip_bytes,count_bytes oflag=seek_bytes
conv=notrunc skip=OFF seek=OFF count=LEN``. Some extents may have been
committed after all (a commit already in flight when the deadline passed):
their bytes are then the file's own.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from cachefs.ids import CHUNK_SIZE
from cachefs.layout import Run

log = logging.getLogger(__name__)

DEFAULT_SPILL_DIR = "/var/lib/cachefs/spill"


def spill(directory: str | os.PathLike[str], volume: str, ino: int, runs: Sequence[Run], reason: str) -> Path:
    """Write ``runs`` (oldest first) of inode ``ino`` as a spill; returns the data file's path.

    Raises:
        OSError: the spill could not be written (the caller logs the loss).
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{volume}-{ino}-{time.time_ns()}"
    data_path = folder / f"{stem}.data"
    extents: list[list[int]] = []
    fd = os.open(data_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for run in runs:
            offset = run.chunk * CHUNK_SIZE + run.pos
            view = memoryview(run.data)
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
            extents.append([offset, len(view)])
        os.fsync(fd)
    finally:
        os.close(fd)
    meta = {"volume": volume, "ino": ino, "reason": reason, "data": data_path.name, "extents": extents}
    meta_path = folder / f"{stem}.json"
    tmp = meta_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, meta_path)
    dirfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)
    return data_path
