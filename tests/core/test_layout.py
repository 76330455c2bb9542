"""Property tests of the slice/block arithmetic against a plain bytearray model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cachefs.ids import BlockKey
from cachefs.layout import (
    HOLE,
    ChunkMap,
    Slice,
    WritePlan,
    chunk_ranges,
    overlay,
    resolve,
    runs_end,
    segment_blocks,
    slice_blocks,
)

CHUNK = 64
BLOCK = 8

slices_st = st.lists(
    st.tuples(st.integers(0, CHUNK - 1), st.integers(1, CHUNK), st.integers(0, 20), st.booleans()),
    max_size=12,
)


def _object_bytes(slice_id: int, size: int = 200) -> bytes:
    return bytes((slice_id * 31 + i) % 251 + 1 for i in range(size))


@settings(max_examples=300, deadline=None)
@given(raw=slices_st, start=st.integers(0, CHUNK), length=st.integers(0, CHUNK))
def test_resolve_matches_bytewise_model(raw, start, length) -> None:
    end = min(CHUNK, start + length)
    slices = []
    model = bytearray(CHUNK)
    for n, (pos, ln, off, hole) in enumerate(raw, start=1):
        ln = min(ln, CHUNK - pos)
        sid = HOLE if hole else n
        slices.append(Slice(sid, pos, ln, off))
        model[pos : pos + ln] = bytes(ln) if hole else _object_bytes(sid)[off : off + ln]
    segs = resolve(slices, start, end)
    # The segments tile [start, end) exactly, in order.
    assert sum(s.length for s in segs) == max(0, end - start)
    cursor = start
    got = bytearray()
    for seg in segs:
        assert seg.pos == cursor and seg.length > 0
        cursor = seg.end
        if seg.slice_id == HOLE:
            got += bytes(seg.length)
            continue
        # Build the bytes from blocks, as a reader would.
        obj = _object_bytes(seg.slice_id)
        piece = bytearray(seg.length)
        for part in segment_blocks(seg, BLOCK):
            block = obj[part.key.index * BLOCK : (part.key.index + 1) * BLOCK]
            assert part.key.slice_id == seg.slice_id
            assert part.block_off >= 0 and part.block_off + part.length <= BLOCK
            piece[part.pos - seg.pos : part.pos - seg.pos + part.length] = block[
                part.block_off : part.block_off + part.length
            ]
        got += piece
    assert bytes(got) == bytes(model[start:end])


@settings(max_examples=300, deadline=None)
@given(raw=slices_st, start=st.integers(0, CHUNK - 1), length=st.integers(1, CHUNK))
def test_chunk_map_covering_is_resolve_of_one_segment(raw, start, length) -> None:
    end = min(CHUNK, start + length)
    slices = [Slice(HOLE if hole else n, pos, min(ln, CHUNK - pos), off)
              for n, (pos, ln, off, hole) in enumerate(raw, start=1)]  # fmt: skip
    segs = resolve(slices, start, end)
    one = segs[0] if len(segs) == 1 and segs[0].slice_id != HOLE else None
    assert ChunkMap(slices, CHUNK).covering(start, end) == one


def test_segment_blocks_names_only_needed_ranges() -> None:
    # A 4 KiB read inside a 4 MiB block fetches 4 KiB, not the block.
    (seg,) = resolve([Slice(7, 0, 8 << 20, 0)], 5 << 20, (5 << 20) + 4096)
    (part,) = segment_blocks(seg, 4 << 20)
    assert part.key == BlockKey(7, 1)
    assert (part.block_off, part.length) == (1 << 20, 4096)


@given(offset=st.integers(0, 1000), length=st.integers(0, 500))
@settings(max_examples=100, deadline=None)
def test_chunk_ranges_cover(offset, length) -> None:
    pieces = list(chunk_ranges(offset, length, CHUNK))
    assert sum(p[3] for p in pieces) == length
    for chunk, pos, buf_off, n in pieces:
        assert pos >= 0 and pos + n <= CHUNK and n > 0
        assert chunk * CHUNK + pos == offset + buf_off


def test_slice_blocks() -> None:
    assert slice_blocks(20, 8) == [(0, 0, 8), (1, 8, 16), (2, 16, 20)]
    assert slice_blocks(0, 8) == []


writes_st = st.lists(
    st.tuples(st.integers(0, 3 * CHUNK), st.binary(min_size=1, max_size=40), st.booleans()),
    min_size=1,
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(writes=writes_st, max_run=st.integers(1, 48), open_limit=st.integers(0, 200))
def test_write_plan_commit_and_overlay_match_model(writes, max_run, open_limit) -> None:
    """Writes cut into runs, committed as slices, read back (with pending runs
    overlaid) equal a bytearray that took the same writes."""
    plan = WritePlan(max_run, CHUNK, open_limit=open_limit)
    model = bytearray()
    chunks: dict[int, list[Slice]] = {}
    objects: dict[int, bytes] = {}
    next_id = 1
    for offset, data, flush in writes:
        if len(model) < offset + len(data):
            model.extend(bytes(offset + len(data) - len(model)))
        model[offset : offset + len(data)] = data
        sealed = plan.add(offset, data)
        if flush:
            sealed += plan.seal()
        # Open extents: sorted, disjoint, counted, within the memory limit.
        keys = [(r.chunk, r.pos, r.end) for r in plan.extents]
        assert keys == sorted(keys)
        assert all(a[0] != b[0] or a[2] < b[1] for a, b in zip(keys, keys[1:], strict=False))
        assert plan.open_bytes == sum(len(r.data) for r in plan.extents) <= max(open_limit, 0)
        for run in sealed:
            assert len(run.data) > 0 and run.end <= CHUNK
            objects[next_id] = bytes(run.data)
            chunks.setdefault(run.chunk, []).append(Slice(next_id, run.pos, len(run.data), 0))
            next_id += 1
    pending = list(plan.extents)
    committed_end = max(
        (c * CHUNK + s.pos + s.length for c, sl in chunks.items() for s in sl), default=0
    )
    size = max(committed_end, runs_end(pending, CHUNK))
    assert size == len(model)
    buf = bytearray(size)
    for chunk, pos, buf_off, n in chunk_ranges(0, size, CHUNK):
        for seg in resolve(chunks.get(chunk, []), pos, pos + n):
            if seg.slice_id != HOLE:
                data = objects[seg.slice_id][seg.slice_off : seg.slice_off + seg.length]
                buf[buf_off + seg.pos - pos : buf_off + seg.end - pos] = data
    overlay(pending, 0, buf, CHUNK)
    assert bytes(buf) == bytes(model)


def test_small_random_write_is_a_small_slice() -> None:
    plan = WritePlan(4 << 20)
    assert plan.add(10 << 20, b"x" * 4096) == []
    assert plan.add(0, b"y" * 4096) == []
    assert sorted((r.pos, len(r.data)) for r in plan.seal()) == [(0, 4096), (10 << 20, 4096)]
    assert plan.seal() == []


def test_rewrites_before_a_flush_are_stored_once() -> None:
    plan = WritePlan(1 << 20, open_limit=8 << 20)
    for i in range(100):
        assert plan.add((i * 7919 * 4096) % (4 << 20), bytes([i]) * 65536) == []
    assert plan.open_bytes <= (4 << 20) + 65536
    assert sum(len(r.data) for r in plan.seal()) <= (4 << 20) + 65536


def test_a_streaming_writer_seals_full_runs() -> None:
    plan = WritePlan(1 << 20)
    sealed = []
    for i in range(40):
        sealed += plan.add(i * 131072, b"s" * 131072)
    assert [len(r.data) for r in sealed] == [1 << 20] * 5 and plan.open_bytes == 0
