"""Which read-through misses a cache node keeps: scan resistance."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from cachefs.ids import BlockKey


class SecondMissAdmission:
    """Admit a block on its second miss within ``window`` seconds.

    One pass over a dataset larger than the cache misses each block once, so
    it admits nothing and the hot set survives (CubeFS's miss counter,
    TinyLFU's doorkeeper). The table of first misses is bounded.
    """

    def __init__(
        self,
        window: float = 300.0,
        max_tracked: int = 1 << 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window = window
        self.max_tracked = max_tracked
        self._clock = clock
        self._first_miss: OrderedDict[BlockKey, float] = OrderedDict()
        self._lock = threading.Lock()

    def admit(self, key: BlockKey) -> bool:
        now = self._clock()
        with self._lock:
            seen = self._first_miss.pop(key, None)
            if seen is not None and now - seen <= self.window:
                return True
            self._first_miss[key] = now
            while len(self._first_miss) > self.max_tracked:
                self._first_miss.popitem(last=False)
            return False
