"""fallocate(2) on a mount, every supported mode beside local ext4 (issue 16, item 3).

Each case runs the same calls on the mount and on a file on local ext4 and
compares the bytes and sizes after each call (one mount for the module,
a file per test). The modes are metadata
operations (a size change, a hole record), so a hole over 1 TiB costs what
one over 4 KiB does; COLLAPSE_RANGE and INSERT_RANGE stay EOPNOTSUPP.
"""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs_fuse

KEEP_SIZE, PUNCH_HOLE, COLLAPSE_RANGE, ZERO_RANGE, INSERT_RANGE = 0x01, 0x02, 0x08, 0x10, 0x20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


# (name, [(mode, offset, length), ...]) on a file that holds 200,000 random bytes
CASES = {
    "plain grows the size": [(0, 0, 300_000), (0, 100, 50)],
    "keep-size keeps it": [(KEEP_SIZE, 0, 500_000), (KEEP_SIZE, 150_000, 1 << 30)],
    "punch a hole inside": [(PUNCH_HOLE | KEEP_SIZE, 1000, 5000), (PUNCH_HOLE | KEEP_SIZE, 0, 10)],
    "punch across the end": [(PUNCH_HOLE | KEEP_SIZE, 190_000, 50_000)],
    "punch past the end": [(PUNCH_HOLE | KEEP_SIZE, 300_000, 4096)],
    "zero a range": [(ZERO_RANGE, 100_000, 1000), (ZERO_RANGE, 150_000, 100_000)],
    "zero keeping the size": [(ZERO_RANGE | KEEP_SIZE, 190_000, 50_000)],
    "punch then write": [(PUNCH_HOLE | KEEP_SIZE, 0, 100_000), ("write", 50_000, 1000)],
}
DATA = os.urandom(200_000)


def is_ext4(path: Path) -> bool:
    kind = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True)
    return kind.stdout.strip() == "ext2/ext3"


def replay(path: Path, steps: list[tuple[object, int, int]]) -> list[tuple[int, bytes]]:
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, DATA, 0)
        seen = []
        for mode, offset, length in steps:
            if mode == "write":
                os.pwrite(fd, b"w" * length, offset)
            else:
                fallocate(fd, mode, offset, length)  # type: ignore[arg-type]
            size = os.fstat(fd).st_size
            seen.append((size, os.pread(fd, size + 10, 0)))
        os.fsync(fd)
    finally:
        os.close(fd)
    with open(path, "rb") as f:  # a fresh open reads what was committed
        seen.append((os.stat(path).st_size, f.read()))
    return seen


@pytest.mark.parametrize("case", sorted(CASES))
def test_fallocate_as_on_ext4(module_mnt: Path, tmp_path: Path, case: str) -> None:
    if not is_ext4(tmp_path):
        pytest.skip(f"{tmp_path} is not on ext4, the reference")
    expect = replay(tmp_path / "f", CASES[case])
    got = replay(module_mnt / case.replace(" ", "-"), CASES[case])
    assert [size for size, _ in got] == [size for size, _ in expect]
    assert got == expect


def test_holes_are_metadata_whatever_their_size(module_mnt: Path) -> None:
    """A hole over 1 TiB of a sparse file is one record per chunk holding data,
    so it takes no longer than a small one; collapse and insert are refused."""
    fd = os.open(module_mnt / "big", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.ftruncate(fd, 2 << 40)
        for at in (0, 1 << 30, 1 << 40):
            os.pwrite(fd, b"d" * 10_000, at)
        os.fsync(fd)
        started = time.monotonic()
        fallocate(fd, PUNCH_HOLE | KEEP_SIZE, 5000, 1 << 40)  # two of the three writes, cut or whole
        took = time.monotonic() - started
        assert os.pread(fd, 10_000, 0) == b"d" * 5000 + bytes(5000)
        assert os.pread(fd, 10_000, 1 << 30) == bytes(10_000)
        assert os.pread(fd, 10_000, 1 << 40) == bytes(5000) + b"d" * 5000
        assert os.fstat(fd).st_size == 2 << 40
        assert took < 5, f"a hole over 1 TiB took {took:.1f}s"
        for mode in (COLLAPSE_RANGE, INSERT_RANGE):
            with pytest.raises(OSError) as exc:
                fallocate(fd, mode, 0, 1 << 20)
            assert exc.value.errno == errno.EOPNOTSUPP
    finally:
        os.close(fd)


def test_fallocate_rate(module_mnt: Path) -> None:
    """The loop from the issue (it ran at 9 ops/s): fallocate modes and hole
    punching over a few files; printed for the benchmark notes."""
    fds = [os.open(module_mnt / f"r{i}", os.O_CREAT | os.O_RDWR, 0o644) for i in range(4)]
    try:
        for fd in fds:
            os.pwrite(fd, os.urandom(1 << 20), 0)
            os.fsync(fd)
        modes = [0, KEEP_SIZE, PUNCH_HOLE | KEEP_SIZE, ZERO_RANGE, ZERO_RANGE | KEEP_SIZE]
        n = 500
        started = time.monotonic()
        for i in range(n):
            fallocate(fds[i % 4], modes[i % len(modes)], (i * 4096) % (1 << 20), 8192)
        rate = n / (time.monotonic() - started)
        print(f"fallocate_ops_per_s {rate:.0f}")
        assert rate > 50, f"{rate:.0f} fallocate calls/s"  # the loop ran at 9; this is a floor, not the target
    finally:
        for fd in fds:
            os.close(fd)


FS_IOC_FIEMAP = 0xC020660B


def test_fiemap_is_unsupported(module_mnt: Path) -> None:
    """FIEMAP answers EOPNOTSUPP (not implemented); tools that map a file's
    extents fall back to SEEK_DATA/SEEK_HOLE, which see the holes
    (test_seek.py)."""
    import fcntl

    fd = os.open(module_mnt / "sparse", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.pwrite(fd, b"x" * 4096, 1 << 20)
        os.fsync(fd)
        fiemap = bytearray(32)  # struct fiemap, no room for extents
        fiemap[8:16] = (2 << 20).to_bytes(8, "little")  # fm_length
        with pytest.raises(OSError) as raised:
            fcntl.ioctl(fd, FS_IOC_FIEMAP, fiemap)
        assert raised.value.errno == errno.EOPNOTSUPP
    finally:
        os.close(fd)
