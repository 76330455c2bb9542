"""The L1 cache: whole blocks in this process's memory, LRU bounded in bytes.

Blocks are immutable (a key never names other bytes), so an entry is never
stale and needs no invalidation; the only policy is what to evict. A block is
kept as the buffer it arrived in (a ``bytearray`` from the RPC layer is the
reply's own buffer, never written again), not copied into ``bytes``. The cache is
a plain object used from trio tasks on one thread: no locks, and no ``await``
happens inside any method, so every method is atomic with respect to the others.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from cachefs.ids import BlockKey

Block = bytes | bytearray | memoryview  # read-only by convention (an L2 read is a view of its buffer)


@dataclass(slots=True)
class L1Stats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    inserted_bytes: int = 0


class L1Cache:
    """``get``/``put`` of whole blocks; evicts least recently used past ``capacity`` bytes."""

    def __init__(self, capacity: int, recycle: Callable[[Block], None] | None = None) -> None:
        """``recycle``: given each evicted block as its last reference (see
        :class:`cachefs.buffers.BufferPool`)."""
        if capacity < 0:
            raise ValueError("L1 capacity must be >= 0")
        self.capacity = capacity
        self._recycle = recycle
        self.used = 0
        self.stats = L1Stats()
        self._blocks: OrderedDict[BlockKey, Block] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._blocks

    def get(self, key: BlockKey) -> Block | None:
        data = self._blocks.get(key)
        if data is None:
            self.stats.misses += 1
            return None
        self._blocks.move_to_end(key)
        self.stats.hits += 1
        return data

    def peek(self, key: BlockKey) -> Block | None:
        """The block if cached, neither counted nor made recent (a copy of
        it elsewhere, not a read of it)."""
        return self._blocks.get(key)

    def put(self, key: BlockKey, data: Block, *, cold: bool = False) -> None:
        """Insert (or refresh) a block; a block larger than the whole cache is not kept.

        ``cold`` inserts it as the next to be evicted: blocks this client just
        wrote are kept while there is room, but a stream of writes (a
        checkpoint) then only evicts its own blocks, never the read cache.
        """
        size = len(data)
        if size > self.capacity:
            return
        old = self._blocks.pop(key, None)
        if old is not None:
            self.used -= len(old)
        while self.used + size > self.capacity and self._blocks:
            _, victim = self._blocks.popitem(last=False)
            self.used -= len(victim)
            self.stats.evictions += 1
            if self._recycle is not None:
                self._recycle(victim)
            del victim  # recycle saw the last reference; drop it before the next
        self._blocks[key] = data
        if cold:
            self._blocks.move_to_end(key, last=False)
        self.used += size
        self.stats.inserted_bytes += size

    def discard(self, key: BlockKey) -> None:
        old = self._blocks.pop(key, None)
        if old is not None:
            self.used -= len(old)

    def clear(self) -> None:
        self._blocks.clear()
        self.used = 0
