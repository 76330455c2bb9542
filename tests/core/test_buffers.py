"""The receive-buffer pools: a buffer is handed out again only once nothing refers to it or writes to it."""

from __future__ import annotations

from cachefs.buffers import BufferPool, ScratchPool

MiB = 1 << 20


def test_a_retired_buffer_is_taken_once_its_last_view_is_gone() -> None:
    pool = BufferPool(keep=2)
    buf = bytearray(b"x" * MiB)
    view = memoryview(buf)[:3]  # what a reply being sent holds
    pool.retire(buf)
    pool.retire(buf)  # retired twice: kept once
    first = id(buf)
    del buf
    assert id(pool.take(MiB)) != first and bytes(view) == b"xxx"  # still seen: a new buffer
    del view
    again = pool.take(MiB)
    assert id(again) == first and pool.stats["buffers_reused"] == 1
    assert pool.take(MiB) is not again  # taken: not handed out twice


def test_retire_keeps_block_sized_bytearrays_only_and_at_most_keep() -> None:
    pool = BufferPool(keep=2)
    for small in (bytearray(1000), bytes(MiB), memoryview(bytearray(MiB))):
        pool.retire(small)
    assert pool.stats["buffers_kept"] == 0
    for mark in (1, 2, 3):
        pool.retire(bytearray([mark]) * MiB)
    taken = [pool.take(MiB) for _ in range(3)]
    assert sorted(t[0] for t in taken) == [0, 2, 3]  # the oldest was forgotten; a fresh one instead
    assert len(pool.take(2 * MiB)) == 2 * MiB  # no retired buffer of that size


def test_a_scratch_comes_back_only_from_a_call_that_succeeded() -> None:
    pool = ScratchPool(MiB, keep=2)
    first, second = pool.take(), pool.take()
    assert first is not None and second is not None and first is not second
    assert len(first) == MiB
    assert pool.take() is None  # both lent: the caller receives into a buffer of its own
    pool.give(first)
    assert pool.take() is first  # the same buffer again, no new allocation
    pool.lose(second)  # its call failed: a late reply may still land in it
    third = pool.take()
    assert third is not None and third is not second and third is not first
    assert pool.take() is None  # first and third lent
    pool.give(None)  # a call that got no scratch gives nothing back
    pool.lose(None)
    assert pool.take() is None
