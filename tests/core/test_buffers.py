"""The receive-buffer pools: a buffer is handed out again only once nothing refers to it or writes to it."""

from __future__ import annotations

import mmap

from cachefs.buffers import BufferPool, ScratchPool, aligned_buffer

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


def _evict(pool: BufferPool, block: object) -> None:
    """What L1 does: hand over its last reference, then drop it."""
    pool.give(block)
    del block


def test_an_aligned_block_given_back_by_l1_is_taken_again_once_no_view_is_left() -> None:
    """L1 gives back views of the page-aligned memory that L2's direct reads
    filled; the memory is handed out again only when no view of it is left
    (a reply still being sent holds one), and only if it is an
    AlignedBuffer, never another mapping (a file's pages)."""
    pool = BufferPool(keep=2)
    l1 = [memoryview(aligned_buffer(2 * MiB))[: MiB + 5]]  # L1's only reference
    reply = l1[0][:10]  # a reply being sent
    _evict(pool, l1.pop())
    assert pool.take_aligned(MiB) is None and bytes(reply) == bytes(10)  # still seen: not kept
    del reply
    mem = aligned_buffer(2 * MiB)
    again = id(mem)
    l1 = [memoryview(mem)[: 2 * MiB - 100]]
    del mem
    _evict(pool, l1.pop())
    assert pool.take_aligned(MiB) is None  # larger than asked: memory L1 would not count
    got = pool.take_aligned(2 * MiB - 100)  # the page-rounded size
    assert got is not None and id(got) == again and pool.stats["buffers_reused"] == 1
    assert pool.take_aligned(2 * MiB) is None  # taken: not handed out twice
    l1 = [memoryview(mmap.mmap(-1, 2 * MiB))[:MiB]]  # not an AlignedBuffer: never reused
    _evict(pool, l1.pop())
    l1 = [memoryview(aligned_buffer(4096))]  # too small to keep
    _evict(pool, l1.pop())
    assert pool.take_aligned(1) is None and pool.stats["buffers_kept"] == 1


def test_a_block_l1_still_shares_is_not_given_back() -> None:
    pool = BufferPool(keep=2)
    mem = aligned_buffer(MiB)
    block = memoryview(mem)
    del mem
    held = block  # another holder of the same view object
    pool.give(block)
    assert pool.take_aligned(MiB) is None and bytes(held[:3]) == bytes(3)


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
