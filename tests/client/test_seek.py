"""lseek(2) SEEK_DATA and SEEK_HOLE on a mount, beside local ext4 (client/seek.py).

Each layout is made by the same calls on the mount and on a file on local
ext4 (writes, truncates, fallocate's holes; one mount for the module, a file
per test), and both files are asked the same SEEK_DATA and SEEK_HOLE
questions: every answer, ENXIO included, must be ext4's. Before the lseek
hook the kernel answered every SEEK_DATA with the offset asked and every
SEEK_HOLE with the size: no holes at all.

One answer differs from ext4's on purpose: a ZERO_RANGE is a hole record
here, as a PUNCH_HOLE is (both read as zeros and store nothing), while ext4
keeps the range allocated and answers it as data. Without a mount, the
answers from random slice lists (writes and hole records over three
chunks) are checked against a model of the file's 4 KiB blocks.
"""

from __future__ import annotations

import errno
import itertools
import os
from pathlib import Path

import pytest
import trio
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cachefs.client.seek import GRAIN, seek_offset
from cachefs.layout import HOLE, Slice

from .test_fallocate import KEEP_SIZE, PUNCH_HOLE, ZERO_RANGE, fallocate, is_ext4

KiB, MiB = 1 << 10, 1 << 20
CHUNK = 64 * MiB

# (name, steps): ("write", offset, length), ("truncate", size, 0), or (fallocate mode, offset, length)
LAYOUTS = {
    "dense": [("write", 0, 200_000)],
    "sparse writes": [("write", 0, 8 * KiB), ("write", 1 * MiB, 4 * KiB), ("write", 5 * MiB + 10, 100),
                      ("truncate", 8 * MiB, 0)],  # fmt: skip
    "punched": [("write", 0, 1 * MiB), (PUNCH_HOLE | KEEP_SIZE, 64 * KiB, 200 * KiB),
                (PUNCH_HOLE | KEEP_SIZE, 300_001, 10_000), (PUNCH_HOLE | KEEP_SIZE, 1 * MiB - 4 * KiB, 4 * KiB)],  # fmt: skip
    "across chunks": [("write", CHUNK - 4 * KiB, 8 * KiB), ("write", 2 * CHUNK + 3 * MiB, 4 * KiB),
                      ("truncate", 2 * CHUNK + 8 * MiB, 0)],  # fmt: skip
    "allocated past the end": [("write", 0, 10_000), (0, 10_000, 1 * MiB)],
    "empty": [],
}


def make(path: Path, steps: list[tuple[object, int, int]]) -> int:
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
    for what, offset, length in steps:
        if what == "write":
            os.pwrite(fd, os.urandom(length), offset)
        elif what == "truncate":
            os.ftruncate(fd, offset)
        else:
            fallocate(fd, what, offset, length)  # type: ignore[arg-type]
    return fd


def probes(size: int) -> list[int]:
    """Offsets to ask from: block edges, odd bytes, the chunk edges, the end."""
    near = [0, 1, 4095, 4096, 8191, 8192, 65_536, 300_000, 1 * MiB - 1, 1 * MiB, 5 * MiB, CHUNK - 4096,
            CHUNK, CHUNK + 4096, 2 * CHUNK, 2 * CHUNK + 3 * MiB + 1]  # fmt: skip
    return sorted({p for p in near if p < size} | {max(size - 1, 0), size, size + 1})


def answers(fd: int, size: int) -> list[tuple[int, str, int | str]]:
    seen: list[tuple[int, str, int | str]] = []
    for offset in probes(size):
        for name, whence in (("data", os.SEEK_DATA), ("hole", os.SEEK_HOLE)):
            try:
                seen.append((offset, name, os.lseek(fd, offset, whence)))
            except OSError as exc:
                seen.append((offset, name, errno.errorcode[exc.errno]))
    return seen


@pytest.mark.needs_fuse
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_seek_data_and_hole_as_on_ext4(module_mnt: Path, tmp_path: Path, layout: str) -> None:
    if not is_ext4(tmp_path):
        pytest.skip(f"{tmp_path} is not on ext4, the reference")
    results = []
    for path in (tmp_path / "f", module_mnt / f"seek-{layout.replace(' ', '-')}"):
        fd = make(path, LAYOUTS[layout])
        try:
            size = os.fstat(fd).st_size
            # asked on the fd that wrote (writes still buffered), then after a fresh open
            first = answers(fd, size)
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY)
        try:
            results.append((size, first, answers(fd, size)))
        finally:
            os.close(fd)
    expect, got = results
    assert got[0] == expect[0]
    assert got[1] == expect[1]
    assert got[2] == expect[2]


@pytest.mark.needs_fuse
def test_a_zeroed_range_is_a_hole(module_mnt: Path) -> None:
    fd = make(module_mnt / "seek-zeroed", [("write", 0, 512 * KiB), (ZERO_RANGE, 128 * KiB, 128 * KiB),
                                           (ZERO_RANGE, 400_000, 5000)])  # fmt: skip
    try:
        assert os.lseek(fd, 0, os.SEEK_HOLE) == 128 * KiB
        assert os.lseek(fd, 128 * KiB, os.SEEK_DATA) == 256 * KiB
        assert os.lseek(fd, 256 * KiB, os.SEEK_HOLE) == 512 * KiB  # 400,000 + 5000: no whole block
        assert os.pread(fd, 128 * KiB, 128 * KiB) == bytes(128 * KiB)
    finally:
        os.close(fd)


# The answers from slice lists alone, against a model of the file block by block.
SPAN = 3 * CHUNK  # the file's reach: three chunks, so answers cross chunk boundaries
runs = st.tuples(st.integers(0, SPAN - 1), st.integers(1, 3 * MiB), st.booleans())  # (offset, length, hole)


def model(writes: list[tuple[int, int, bool]], size: int) -> list[bool]:
    """Whether each 4 KiB block of the file holds a byte of data: the newest
    run over each byte decides, as the slice lists' commit order does."""
    cuts = sorted({0, size} | {p for offset, length, _ in writes for p in (offset, offset + length) if p < size})
    blocks = [False] * (-(-size // GRAIN))
    for lo, hi in itertools.pairwise(cuts):
        newest = None
        for offset, length, hole in writes:
            if offset <= lo < offset + length:
                newest = hole
        if newest is False:
            for b in range(lo // GRAIN, (hi - 1) // GRAIN + 1):
                blocks[b] = True
    return blocks


def expected(blocks: list[bool], size: int, offset: int, data: bool) -> int | None:
    if offset >= size:
        return None
    for b in range(offset // GRAIN, len(blocks)):
        if blocks[b] == data:
            return max(offset, b * GRAIN) if data else min(max(offset, b * GRAIN), size)
    return None if data else size


@settings(max_examples=100, deadline=None)
@example(2 * CHUNK, [(CHUNK - GRAIN, 2 * GRAIN, False)], [CHUNK - GRAIN])  # data across a chunk edge
@given(st.integers(1, SPAN), st.lists(runs, max_size=6), st.lists(st.integers(0, SPAN + GRAIN), max_size=8))
def test_seek_answers_match_a_block_model(size: int, runs: list[tuple[int, int, bool]], offsets: list[int]) -> None:
    writes = [(offset, min(length, size - offset), hole) for offset, length, hole in runs if offset < size]
    lists: dict[int, list[Slice]] = {}
    for n, (offset, length, hole) in enumerate(writes, start=1):
        end = offset + length
        while offset < end:  # a run is cut at chunk edges, as the writer cuts slices
            chunk, pos = divmod(offset, CHUNK)
            cut = min(end, (chunk + 1) * CHUNK)
            lists.setdefault(chunk, []).append(Slice(HOLE if hole else n, pos, cut - offset))
            offset = cut

    async def slices(chunk: int) -> list[Slice]:
        return lists.get(chunk, [])

    blocks = model(writes, size)
    for offset in offsets:
        for data in (True, False):
            got = trio.run(seek_offset, slices, size, offset, data)
            assert got == expected(blocks, size, offset, data), (offset, data)
