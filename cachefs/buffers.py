"""Receive buffers used again: block-sized ones once nothing refers to them,
and scratches for replies that are copied out at once (:class:`ScratchPool`).

A cold sequential read receives a new 4 MiB ``bytearray`` for every block:
zeroed by Python, its pages faulted in fresh after the heap trimmer gave the
last ones back (py-spy on a mount reading a cold file: 17% of its samples in
that allocation; a cache node's fills: 7.8% of its CPU). The pool hands out a
buffer whose previous block nobody can see any more instead.

Two ways in:

- ``give``, from the mount's L1 on eviction: in a steady stream one buffer
  leaves as one arrives, and the buffer is kept only if the caller held the
  last reference.
- ``retire``, from a cache node's fill once it is done with the block: its
  readers may still be sending views of it, so it is kept as it is and
  ``take`` reuses it only once its reference count says that nothing but
  the pool holds it.

Theory of operation
-------------------
- A buffer is handed out only when nothing else can see it: its reference
  count says that the pool (or the giver) holds the last reference (a
  ``memoryview`` of it, a reply being sent, a store write in a worker
  thread, an L2 fill waiting in the queue or a slice list's cache would each
  hold one). Blocks are immutable while anyone holds them; a buffer nobody
  holds has no readers to surprise.
- Its old bytes are overwritten by the next payload before anyone sees it:
  the RPC decoder or the backing client's range read fills it whole, and a
  reply cut short (a lost connection, a failed MAC) is never handed to anyone.
- At most ``keep`` buffers wait in each list: memory nobody accounts, and one
  or two cover a streaming reader.
- One thread only (the event loop's): ``take``, ``give`` and ``retire`` do no
  locking.
"""

from __future__ import annotations

import collections
import mmap
import sys

KEEP = 4
MIN_SIZE = 1 << 20  # smaller payloads are cheap to allocate; not kept
# A block's memory after give() released the caller's view of it: give's
# variable and getrefcount's own argument (no other view keeps it exported).
_ONLY_GIVE = 2
# give(buf)'s reference count when its caller held the only one: the
# caller's variable, give's parameter and getrefcount's own argument.
_ONLY_CALLERS = 3
# A retired buffer's count when only the pool holds it: the deque's slot,
# take's loop variable and getrefcount's own argument.
_ONLY_RETIRED = 3


class AlignedBuffer(mmap.mmap):
    """Page-aligned private anonymous memory, which ``O_DIRECT`` reads need.

    Its own type marks the mappings that :class:`BufferPool` may hand out
    again: never a mapping of a file, whose pages a reuse would write to."""


def aligned_buffer(size: int) -> AlignedBuffer:
    """Fresh memory for an ``O_DIRECT`` read of ``size`` bytes (a multiple of the page size).

    Private: ``mmap``'s default, a shared anonymous mapping, is shmem, whose
    pages cost as much to fault in as the page cache's."""
    return AlignedBuffer(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class BufferPool:
    """``take`` for receive buffers; ``give`` (sole holder) or ``retire`` (maybe shared) to return them.

    ``take_aligned`` hands out again the :class:`AlignedBuffer` of a block L1
    gave back (L2's direct reads of whole blocks land in those): faulting in
    fresh pages for each 4 MiB block, and unmapping them after, was a third of
    a mount's CPU in a stream of first reads from L2 (perf)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._aligned: list[AlignedBuffer] = []
        self._free: dict[int, list[bytearray]] = {}
        self._count = 0
        self._retired: collections.deque[bytearray] = collections.deque(maxlen=keep)
        self.stats = {"buffers_reused": 0, "buffers_kept": 0}

    def take(self, size: int) -> bytearray:
        """A buffer of ``size`` bytes with unspecified contents (the caller fills it whole)."""
        free = self._free.get(size)
        if free:
            self._count -= 1
            self.stats["buffers_reused"] += 1
            return free.pop()
        for buf in self._retired:
            if len(buf) == size and sys.getrefcount(buf) == _ONLY_RETIRED:
                self._retired.remove(buf)  # no await, no other thread: nobody takes a reference meanwhile
                self.stats["buffers_reused"] += 1
                return buf
        return bytearray(size)

    def take_aligned(self, size: int) -> AlignedBuffer | None:
        """A kept :class:`AlignedBuffer` of ``size`` bytes rounded up to the
        page size (contents unspecified: the caller's read fills it), or
        None. Exactly that size: L1 counts the block, not the memory under
        it, so a larger buffer would hold memory nobody counts."""
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        for i, buf in enumerate(self._aligned):
            if len(buf) == size:
                del self._aligned[i]
                self._count -= 1
                self.stats["buffers_reused"] += 1
                return buf
        return None

    def give(self, buf: object) -> None:
        """Keep ``buf`` for a later ``take`` if the caller held its only reference.

        The caller must pass its own last reference (a local variable it drops
        afterwards): anything else that still refers to ``buf`` keeps it out.
        A view of an :class:`AlignedBuffer` is released here (the caller must
        not use it again), and its memory kept if no other view of it is left.
        """
        if type(buf) is memoryview:
            self._give_aligned(buf)
            return
        if (
            type(buf) is not bytearray
            or len(buf) < MIN_SIZE
            or self._count >= self.keep
            or sys.getrefcount(buf) != _ONLY_CALLERS
        ):
            return
        self._free.setdefault(len(buf), []).append(buf)
        self._count += 1
        self.stats["buffers_kept"] += 1

    def _give_aligned(self, view: memoryview) -> None:
        mem = view.obj
        if (
            type(mem) is not AlignedBuffer
            or len(mem) < MIN_SIZE
            or self._count >= self.keep
            or sys.getrefcount(view) != _ONLY_CALLERS + 1  # and the caller's give()
        ):
            return
        view.release()
        if sys.getrefcount(mem) != _ONLY_GIVE:  # another view of it lives on
            return
        self._aligned.append(mem)
        self._count += 1
        self.stats["buffers_kept"] += 1

    def retire(self, buf: object) -> None:
        """Keep ``buf`` for a ``take`` once nothing else refers to it (the
        oldest retired buffer is forgotten when ``keep`` are waiting)."""
        if type(buf) is bytearray and len(buf) >= MIN_SIZE and all(b is not buf for b in self._retired):
            self._retired.append(buf)
            self.stats["buffers_kept"] += 1


class ScratchPool:
    """Receive buffers for replies that are copied out at once, lent one per call.

    A mount copies each block of a ``get_many`` batch out of the reply into
    its own ``bytes`` (L1 must not keep a whole batch alive for one block).
    The reply's buffer is garbage the moment that is done, and batches vary
    in size, so :class:`BufferPool`'s exact-size lists never reused one: a
    fresh zeroed buffer per batch was 8% of a mount's CPU in a warm
    DataLoader epoch (py-spy). A scratch is large enough for any batch, and
    a reply lands in its first bytes (``RpcPool.call(scratch=...)``).

    Theory of operation
    -------------------
    - A scratch is lent to one call at a time (``take``), and comes back
      (``give``) only from a call that succeeded, after its views of the
      reply are copied out and dropped: the reply is complete, so nothing
      writes to it any more, and nobody reads it.
    - A call that failed or was cancelled may still have a reply arriving
      into its scratch, so that scratch is never lent again (``lose``): it
      is freed once the connection lets go of it.
    - At most ``keep`` scratches exist at once; a call that finds none free
      gets ``None`` and receives into a buffer of its own, as before.
    - A scratch is an anonymous mapping, so only the pages replies have
      touched are resident: batches of small files use a fraction of it.
    - One thread only (the event loop's), like :class:`BufferPool`.
    """

    def __init__(self, size: int, keep: int = 2) -> None:
        self.size = size
        self.keep = keep
        self._free: list[mmap.mmap] = []
        self._lent = 0

    def take(self) -> mmap.mmap | None:
        """A scratch of ``size`` bytes to lend to one call, or None if ``keep`` are lent."""
        if self._free:
            self._lent += 1
            return self._free.pop()
        if self._lent >= self.keep:
            return None
        self._lent += 1
        return mmap.mmap(-1, self.size)

    def give(self, buf: mmap.mmap | None) -> None:
        """Take back a scratch whose call succeeded and whose reply nobody reads any more."""
        if buf is not None:
            self._lent -= 1
            self._free.append(buf)

    def lose(self, buf: mmap.mmap | None) -> None:
        """Forget a scratch whose call failed: a late reply may still write to it."""
        if buf is not None:
            self._lent -= 1
