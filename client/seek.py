"""SEEK_DATA and SEEK_HOLE (lseek(2)) over a file's slice lists.

A file's data is what its chunks' slices cover, hole records aside
(:data:`~cachefs.layout.HOLE`: fallocate's PUNCH_HOLE and ZERO_RANGE); what
no slice covers (a sparse write's gap, a truncate or a plain fallocate past
the end) reads as zeros and is a hole. Answers are in :data:`GRAIN` units,
as on ext4 with 4 KiB blocks: a block with any byte of data is data (ext4
allocates whole blocks, and a punch over part of one zeroes that part and
keeps the block), so the same calls give the same offsets as on local ext4
(tests/client/test_seek.py). The end of the file is a hole, and there is no
data at or past it.

Cost: one slice list per chunk looked at (cached per content version, as
for reads), so a SEEK_DATA over a hole of N chunks asks for N lists.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from cachefs.ids import CHUNK_SIZE
from cachefs.layout import HOLE, Slice, resolve

GRAIN = 4096  # ext4's block: the unit of data and holes


def data_extents(slices: Sequence[Slice]) -> list[tuple[int, int]]:
    """A chunk's data as sorted, disjoint ``[start, end)`` ranges rounded out to GRAIN."""
    extents: list[tuple[int, int]] = []
    for seg in resolve(slices, 0, CHUNK_SIZE):
        if seg.slice_id == HOLE:
            continue
        start, end = seg.pos // GRAIN * GRAIN, -(-seg.end // GRAIN) * GRAIN
        if extents and start <= extents[-1][1]:
            extents[-1] = (extents[-1][0], max(extents[-1][1], end))
        else:
            extents.append((start, end))
    return extents


def _next(extents: list[tuple[int, int]], pos: int, data: bool) -> int | None:
    """The first chunk offset >= ``pos`` in data (or in a hole), None if the chunk has none."""
    for start, end in extents:
        if end <= pos:
            continue
        if data:
            return max(start, pos)
        if pos < start:
            return pos
        pos = end
    return None if data or pos >= CHUNK_SIZE else pos


async def seek_offset(
    slices: Callable[[int], Awaitable[Sequence[Slice]]], size: int, offset: int, data: bool
) -> int | None:
    """The first offset >= ``offset`` of a file of ``size`` bytes that is data
    (``data``) or in a hole; ``slices(chunk)`` gives a chunk's slice list.
    None where lseek(2) fails with ENXIO: ``offset`` at or past the end, or
    no data after it."""
    if offset < 0 or offset >= size:
        return None
    chunk, pos = divmod(offset, CHUNK_SIZE)
    while chunk * CHUNK_SIZE < size:
        found = _next(data_extents(await slices(chunk)), pos, data)
        if found is not None:
            at = chunk * CHUNK_SIZE + found
            if data:
                return at if at < size else None
            return min(at, size)
        chunk, pos = chunk + 1, 0
    return None if data else size
