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
# The largest file: chunk indexes are 32-bit (the metanodes refuse a size past it).
MAX_FILE_SIZE = CHUNK_SIZE * ((1 << 32) - 1)


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


class ChunkMap:
    """A chunk's slice list resolved once over the whole chunk, for reads that
    want the one segment under a small range: a bisect per read instead of
    applying every slice again (a random 4 KiB reader's largest cost)."""

    __slots__ = ("_starts", "segments")

    def __init__(self, slices: Iterable[Slice], size: int = CHUNK_SIZE) -> None:
        self.segments = resolve(slices, 0, size)
        self._starts = [seg.pos for seg in self.segments]

    def covering(self, start: int, end: int) -> Segment | None:
        """``resolve(slices, start, end)``'s one segment when it is one and
        not a hole; None when a slice boundary or a hole falls in the range."""
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0:
            return None
        seg = self.segments[i]
        if seg.end < end or seg.slice_id == HOLE:
            return None
        return Segment(start, end - start, seg.slice_id, seg.slice_off + (start - seg.pos))


def block_keys(slices: Iterable[Slice], start: int, end: int, block_size: int) -> list[BlockKey]:
    """The keys of the blocks that hold chunk bytes ``[start, end)`` (holes hold none)."""
    return [part.key for seg in resolve(slices, start, end) if seg.slice_id != HOLE
            for part in segment_blocks(seg, block_size)]  # fmt: skip


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
    # Only ever appended to: a sequential writer's extent, sealed when full.
    stream: bool = True

    @property
    def end(self) -> int:
        return self.pos + len(self.data)


class WritePlan:
    """Dirty extents of one file; sealed runs come out in the order they must commit.

    The open extents are disjoint and all newer than every sealed run, so
    they can be overwritten in place: a region rewritten many times before a
    flush is stored once (what a kernel's dirty pages give a local
    filesystem). Three things seal extents:

    - streaming: an extent grown at its end to ``max_run`` bytes is sealed, so
      a sequential writer uploads while it writes;
    - memory: past ``open_limit`` open bytes the oldest extents are sealed;
    - ``seal()`` (flush, fsync, close) seals everything.

    Each sealed extent becomes one slice holding exactly its bytes, so a small
    random write never rewrites a whole block.
    """

    def __init__(self, max_run: int, chunk_size: int = CHUNK_SIZE, open_limit: int | None = None) -> None:
        if max_run <= 0:
            raise ValueError("max_run must be positive")
        self.max_run = max_run
        self.chunk_size = chunk_size
        self.open_limit = open_limit if open_limit is not None else 4 * max_run
        self.extents: list[Run] = []  # sorted by (chunk, pos), disjoint
        self._keys: list[tuple[int, int]] = []
        self._age: dict[int, int] = {}  # id(run) -> creation order
        self._clock = 0
        self.open_bytes = 0

    @property
    def open(self) -> Run | None:
        """The most recently created open extent (None when all are sealed)."""
        if not self.extents:
            return None
        return max(self.extents, key=lambda r: self._age[id(r)])

    def _insert(self, run: Run, age: int | None = None) -> None:
        i = bisect.bisect_left(self._keys, (run.chunk, run.pos))
        self.extents.insert(i, run)
        self._keys.insert(i, (run.chunk, run.pos))
        if age is None:
            self._clock += 1
            age = self._clock
        self._age[id(run)] = age
        self.open_bytes += len(run.data)

    def _remove(self, i: int) -> tuple[Run, int]:
        run = self.extents.pop(i)
        del self._keys[i]
        self.open_bytes -= len(run.data)
        return run, self._age.pop(id(run))

    def add(self, offset: int, data: bytes | memoryview) -> list[Run]:
        """Take one write; return the runs it sealed (oldest first)."""
        sealed: list[Run] = []
        view = memoryview(data)
        for chunk, pos, buf_off, n in chunk_ranges(offset, len(view), self.chunk_size):
            self._add_piece(chunk, pos, view[buf_off : buf_off + n], sealed)
        while self.open_bytes > self.open_limit and self.extents:
            oldest = min(range(len(self.extents)), key=lambda i: self._age[id(self.extents[i])])
            sealed.append(self._remove(oldest)[0])
        return sealed

    def _add_piece(self, chunk: int, pos: int, piece: memoryview, sealed: list[Run]) -> None:
        end = pos + len(piece)
        # Extents of this chunk that overlap or touch [pos, end].
        lo = bisect.bisect_left(self._keys, (chunk, pos))
        if lo > 0 and self.extents[lo - 1].chunk == chunk and self.extents[lo - 1].end >= pos:
            lo -= 1
        hi = lo
        while hi < len(self.extents) and self.extents[hi].chunk == chunk and self.extents[hi].pos <= end:
            hi += 1
        if hi - lo == 1:
            run = self.extents[lo]
            if run.pos <= pos and end <= run.end:  # inside one extent: overwrite in place
                run.data[pos - run.pos : end - run.pos] = piece
                run.stream = False
                return
            if run.pos <= pos and pos <= run.end:  # grows one extent at its end
                grow = end - run.end
                run.data[pos - run.pos :] = piece
                self.open_bytes += grow
                if run.stream and len(run.data) >= self.max_run:
                    sealed.append(self._remove(lo)[0])
                return
        touched = [self._remove(lo) for _ in range(hi - lo)]
        if not touched:
            self._insert(Run(chunk, pos, bytearray(piece)))
            return
        stop = max(end, touched[-1][0].end)
        base = touched[0][0]
        if base.pos <= pos:
            # Grow the first extent in place: copying its bytes again would
            # make every random write cost the size of the extent it lands in.
            merged = base
            merged.data.extend(bytes(stop - merged.end))
            rest = touched[1:]
        else:
            merged = Run(chunk, pos, bytearray(stop - pos))
            rest = touched
        for r, _ in rest:
            merged.data[r.pos - merged.pos : r.end - merged.pos] = r.data
        merged.data[pos - merged.pos : end - merged.pos] = piece
        merged.stream = False
        self._insert(merged, min(age for _, age in touched))

    def seal(self) -> list[Run]:
        """Seal every open extent (flush/fsync/close)."""
        runs = sorted(self.extents, key=lambda r: self._age[id(r)])
        self.extents.clear()
        self._keys.clear()
        self._age.clear()
        self.open_bytes = 0
        return runs

    def seal_oldest(self) -> list[Run]:
        """Seal the oldest open extent (the write buffer is full)."""
        if not self.extents:
            return []
        oldest = min(range(len(self.extents)), key=lambda i: self._age[id(self.extents[i])])
        return [self._remove(oldest)[0]]


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
