"""Pure logic of the data model: chunks, slices and blocks (no IO).

Theory of operation (see DESIGN.md, "Data model"):

- A file is cut into chunks of ``CHUNK_SIZE``. Each chunk has a slice list in
  commit order; a slice ``(id, pos, length, offset)`` says "bytes
  ``[offset, offset+length)`` of slice object ``id`` appear at chunk position
  ``pos``". Newer slices cover older ones; bytes no slice covers read as zeros
  (slice id 0 is an explicit hole).
- A slice object is stored as blocks of ``block_size`` under
  ``BlockKey(id, i)``: block ``i`` holds object bytes
  ``[i*block_size, (i+1)*block_size)``.
- :func:`resolve` turns a slice list into the non-overlapping segments that
  make up a byte range; :func:`segment_blocks` names the block ranges a
  segment needs. Readers fetch exactly those ranges, so a random 4 KiB read
  costs one 4 KiB fetch whatever the block size.
- On the write side, :class:`WritePlan` merges the kernel's writes into runs
  (future slices) per chunk: contiguous or overlapping writes grow the open
  run, anything else seals it. A sealed run becomes one slice, so a small
  random write becomes a small slice and never rewrites a whole block.
  :func:`overlay` lays pending runs over bytes read from committed slices, so
  a reader sees its own uncommitted writes.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from cachefs.ids import CHUNK_SIZE, BlockKey

HOLE = 0


@dataclass(frozen=True, slots=True)
class Slice:
    """One entry of a chunk's slice list (as the metanodes' ``read_chunk`` returns)."""

    id: int
    pos: int
    length: int
    offset: int = 0

    @classmethod
    def from_wire(cls, row: Sequence[int]) -> Slice:
        slice_id, pos, length, offset = row
        if pos < 0 or length < 0 or offset < 0 or pos + length > CHUNK_SIZE:
            raise ValueError(f"slice out of range: {row!r}")
        return cls(int(slice_id), int(pos), int(length), int(offset))


@dataclass(frozen=True, slots=True)
class Segment:
    """Chunk bytes ``[pos, pos+length)`` come from object ``slice_id`` at ``slice_off``."""

    pos: int
    length: int
    slice_id: int
    slice_off: int

    @property
    def end(self) -> int:
        return self.pos + self.length


@dataclass(frozen=True, slots=True)
class BlockPart:
    """Bytes ``[block_off, block_off+length)`` of block ``key`` land at chunk ``pos``."""

    key: BlockKey
    block_off: int
    length: int
    pos: int


def resolve(slices: Iterable[Slice], start: int, end: int) -> list[Segment]:
    """Segments covering chunk bytes ``[start, end)`` exactly, holes included.

    Slices are applied in commit order; each one cuts whatever it overlaps out
    of the segments laid down before it (newest wins).
    """
    if start >= end:
        return []
    starts: list[int] = [start]
    segs: list[Segment] = [Segment(start, end - start, HOLE, 0)]
    for s in slices:
        a, b = max(s.pos, start), min(s.pos + s.length, end)
        if a >= b:
            continue
        new = Segment(a, b - a, s.id, s.offset + (a - s.pos) if s.id != HOLE else 0)
        # Segments tile [start, end) with no gaps, so [a, b) overlaps
        # segs[i:j] and only segs[i] may stick out left, segs[j-1] right.
        i = bisect.bisect_right(starts, a) - 1
        j = i
        head: list[Segment] = []
        tail: list[Segment] = []
        while j < len(segs) and segs[j].pos < b:
            old = segs[j]
            if old.pos < a:
                head.append(Segment(old.pos, a - old.pos, old.slice_id, old.slice_off))
            if old.end > b:
                skip = b - old.pos
                off = old.slice_off + skip if old.slice_id != HOLE else 0
                tail.append(Segment(b, old.end - b, old.slice_id, off))
            j += 1
        replaced = [*head, new, *tail]
        segs[i:j] = replaced
        starts[i:j] = [seg.pos for seg in replaced]
    return _merge_holes(segs)


def _merge_holes(segs: list[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for seg in segs:
        if seg.length == 0:
            continue
        if out and seg.slice_id == HOLE and out[-1].slice_id == HOLE:
            last = out[-1]
            out[-1] = Segment(last.pos, last.length + seg.length, HOLE, 0)
        else:
            out.append(seg)
    return out


def segment_blocks(seg: Segment, block_size: int) -> list[BlockPart]:
    """The block ranges that hold a (non-hole) segment's bytes."""
    parts: list[BlockPart] = []
    off, pos, left = seg.slice_off, seg.pos, seg.length
    while left > 0:
        index, block_off = divmod(off, block_size)
        n = min(left, block_size - block_off)
        parts.append(BlockPart(BlockKey(seg.slice_id, index), block_off, n, pos))
        off += n
        pos += n
        left -= n
    return parts


def chunk_ranges(
    offset: int, length: int, chunk_size: int = CHUNK_SIZE
) -> Iterator[tuple[int, int, int, int]]:
    """Cut file range ``[offset, offset+length)`` at chunk boundaries.

    Yields ``(chunk_index, chunk_pos, buf_off, n)``.
    """
    buf_off = 0
    while buf_off < length:
        chunk, pos = divmod(offset + buf_off, chunk_size)
        n = min(length - buf_off, chunk_size - pos)
        yield chunk, pos, buf_off, n
        buf_off += n


def slice_blocks(length: int, block_size: int) -> list[tuple[int, int, int]]:
    """``(index, start, end)`` of each block of a slice object of ``length`` bytes."""
    return [(i, s, min(s + block_size, length)) for i, s in enumerate(range(0, length, block_size))]


@dataclass(slots=True)
class Run:
    """Bytes written but not yet committed: a future slice at ``chunk``/``pos``."""

    chunk: int
    pos: int
    data: bytearray = field(default_factory=bytearray)

    @property
    def end(self) -> int:
        return self.pos + len(self.data)

    @property
    def file_offset(self) -> int:
        return self.chunk * CHUNK_SIZE + self.pos


class WritePlan:
    """Merges writes into runs; sealed runs come out in the order they must commit.

    ``max_run`` bounds one slice (and so the memory one run pins); a run is
    also sealed as soon as a write does not touch it, so writes that arrive in
    order become few large slices and random writes become small ones.
    """

    def __init__(self, max_run: int, chunk_size: int = CHUNK_SIZE) -> None:
        if max_run <= 0:
            raise ValueError("max_run must be positive")
        self.max_run = max_run
        self.chunk_size = chunk_size
        self.open: Run | None = None

    def add(self, offset: int, data: bytes | memoryview) -> list[Run]:
        """Take one write; return the runs it sealed (oldest first)."""
        sealed: list[Run] = []
        view = memoryview(data)
        for chunk, pos, buf_off, n in chunk_ranges(offset, len(view), self.chunk_size):
            piece = view[buf_off : buf_off + n]
            run = self.open
            if (
                run is not None
                and run.chunk == chunk
                and run.pos <= pos <= run.end
                and max(run.end, pos + n) - run.pos <= self.max_run
            ):
                rel = pos - run.pos
                run.data[rel : rel + n] = piece
                continue
            if run is not None:
                sealed.append(run)
            # A piece longer than max_run is split into several runs.
            for start in range(0, n, self.max_run):
                part = piece[start : start + self.max_run]
                self.open = Run(chunk, pos + start, bytearray(part))
                if start + self.max_run < n:
                    sealed.append(self.open)
            # The last part stays open for the next contiguous write.
        return sealed

    def seal(self) -> list[Run]:
        """Seal the open run (flush/fsync/close)."""
        run, self.open = self.open, None
        return [run] if run is not None and run.data else []

    @property
    def open_bytes(self) -> int:
        return len(self.open.data) if self.open is not None else 0


def overlay(
    runs: Iterable[Run], offset: int, buf: bytearray | memoryview, chunk_size: int = CHUNK_SIZE
) -> int:
    """Copy pending runs (oldest first) over ``buf``, which holds file bytes from ``offset``.

    Returns the end (file offset) of the furthest run byte written into ``buf``,
    or ``offset`` when none was; callers use it to learn that a pending write
    lies past the committed size.
    """
    end = offset + len(buf)
    furthest = offset
    for run in runs:
        r0 = run.chunk * chunk_size + run.pos
        r1 = r0 + len(run.data)
        a, b = max(r0, offset), min(r1, end)
        if a < b:
            buf[a - offset : b - offset] = run.data[a - r0 : b - r0]
            furthest = max(furthest, b)
    return furthest


def runs_end(runs: Iterable[Run], chunk_size: int = CHUNK_SIZE) -> int:
    """The file size that pending runs imply (0 if none)."""
    return max((run.chunk * chunk_size + run.end for run in runs), default=0)
