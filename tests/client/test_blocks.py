"""st_blocks counts what a file stores, not its size (issue 16, item 1).

Each layout is made by the same calls on the mount and on local ext4 (one
mount for the module, a file per test); ``stat -c %b`` and ``du`` must give
ext4's figures, and ``cp --sparse=auto`` of the mount's file must make a copy
as sparse as one of ext4's (cp looks for holes only where st_blocks * 512 is
below the size: with st_blocks from the size it copied every zero).

The figure is the file's stored bytes (``Inode.stored``: the sizes of the
slices its records hold, what quotas and statfs count) in 4 KiB blocks.
Where a layout's writes are whole slices that agrees with ext4. Where it
does not, on purpose: a hole punched or a truncate cut inside one slice
keeps counting that slice (its blocks stay stored), and fallocate reserves nothing (ext4 counts the blocks it
allocates), so those layouts are not compared here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .test_fallocate import KEEP_SIZE, PUNCH_HOLE, is_ext4
from .test_seek import CHUNK, KiB, MiB, make

pytestmark = pytest.mark.needs_fuse

LAYOUTS = {
    "dense": [("write", 0, 200_000)],
    "sparse writes": [("write", 0, 8 * KiB), ("write", 1 * MiB, 4 * KiB), ("write", 5 * MiB + 10, 100),
                      ("truncate", 8 * MiB, 0)],  # fmt: skip
    "across chunks": [("write", CHUNK - 4 * KiB, 8 * KiB), ("write", 2 * CHUNK + 3 * MiB, 4 * KiB)],
    "a write punched out": [("write", 0, 64 * KiB), ("write", 1 * MiB, 64 * KiB),
                            (PUNCH_HOLE | KEEP_SIZE, 1 * MiB, 64 * KiB), ("write", 3 * MiB, 4 * KiB)],  # fmt: skip
    "truncated to a write's end": [("write", 0, 16 * KiB), ("write", 2 * MiB, 16 * KiB),
                                   ("truncate", 16 * KiB, 0), ("truncate", 10 * MiB, 0)],  # fmt: skip
    "only a size": [("truncate", 256 * MiB, 0)],
}


def figures(path: Path) -> tuple[int, int, int]:
    """size, ``stat -c %b``, ``du`` in 512-byte units"""
    b = subprocess.run(["stat", "-c", "%b", str(path)], capture_output=True, text=True, check=True)
    du = subprocess.run(["du", "-B512", str(path)], capture_output=True, text=True, check=True)
    return path.stat().st_size, int(b.stdout), int(du.stdout.split()[0])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_blocks_and_du_as_on_ext4(module_mnt: Path, tmp_path: Path, layout: str) -> None:
    if not is_ext4(tmp_path):
        pytest.skip(f"{tmp_path} is not on ext4, the reference")
    ext4, ours = tmp_path / "f", module_mnt / f"blocks-{layout.replace(' ', '-')}"
    for path in (ext4, ours):
        os.close(make(path, LAYOUTS[layout]))
    expect = figures(ext4)
    assert figures(ours) == expect
    # cp sees a sparse file as sparse: its copy on ext4 is as sparse as ext4's own
    for src, dst in ((ext4, tmp_path / "from-ext4"), (ours, tmp_path / "from-mount")):
        subprocess.run(["cp", "--sparse=auto", str(src), str(dst)], check=True)
    assert figures(tmp_path / "from-mount") == figures(tmp_path / "from-ext4")
    subprocess.run(["cmp", str(ours), str(tmp_path / "from-mount")], check=True)


def test_blocks_count_buffered_writes_then_the_commit(module_mnt: Path) -> None:
    """Before the close commits them, written bytes count (in 4 KiB blocks)
    as ext4's delayed allocations do; after it, what the metanodes store."""
    path = module_mnt / "blocks-buffered"
    with open(path, "wb") as f:
        f.write(b"x" * 10_000)
        f.flush()
        assert os.fstat(f.fileno()).st_blocks == 24
    assert path.stat().st_blocks == 24
    with open(path, "r+b") as f:
        f.seek(1 * MiB)
        f.write(b"y")
    assert path.stat().st_blocks == 32
    copy = module_mnt / "blocks-buffered-copy"
    shutil.copyfile(path, copy)  # a copy by read and write: dense
    assert copy.stat().st_blocks == (1 * MiB + 1 + 4095) // 4096 * 8
