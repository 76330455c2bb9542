"""Block-sized receive buffers, used again once L1 lets go of them.

A cold sequential read receives a new 4 MiB ``bytearray`` for every block:
zeroed by Python, its pages faulted in fresh after the heap trimmer gave the
last ones back (py-spy on a mount reading a cold file: 17% of its samples in
that allocation). L1 drops a block when a new one comes in, so in a steady
stream one buffer leaves as one arrives: the pool hands the RPC layer that
buffer for the next reply of the same size instead.

Theory of operation
-------------------
- A buffer is taken back only when nothing else can see it: its reference
  count says that L1, which just evicted it, held the last reference (a
  ``memoryview`` of it, a reply in a FUSE handler, an L2 fill waiting in the
  queue or a slice list's cache would each hold one). Blocks are immutable
  while anyone holds them; a buffer nobody holds has no readers to surprise.
- Its old bytes are overwritten by the next payload before anyone sees it:
  the RPC decoder fills it whole before the reply completes, and a reply cut
  short (a lost connection, a failed MAC) is never handed to anyone.
- At most ``KEEP`` buffers wait here: memory the mount does not account in
  L1, and one or two cover a streaming reader.
"""

from __future__ import annotations

import sys

KEEP = 4
MIN_SIZE = 1 << 20  # smaller payloads are cheap to allocate; not kept
# give(buf)'s reference count when its caller held the only one: the
# caller's variable, give's parameter and getrefcount's own argument.
_ONLY_CALLERS = 3


class BufferPool:
    """``take`` for the RPC layer's reply payloads, ``give`` from L1's evictions."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._free: dict[int, list[bytearray]] = {}
        self._count = 0
        self.stats = {"buffers_reused": 0, "buffers_kept": 0}

    def take(self, size: int) -> bytearray:
        """A buffer of ``size`` bytes with unspecified contents (the caller fills it whole)."""
        free = self._free.get(size)
        if free:
            self._count -= 1
            self.stats["buffers_reused"] += 1
            return free.pop()
        return bytearray(size)

    def give(self, buf: object) -> None:
        """Keep ``buf`` for a later ``take`` if the caller held its only reference.

        The caller must pass its own last reference (a local variable it drops
        afterwards): anything else that still refers to ``buf`` keeps it out.
        """
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
