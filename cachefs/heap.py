"""This process's heap: what holds it (traced on demand) and giving back what is free.

A client's big objects are blocks and write runs, 64 KiB to 4 MiB each, made
and dropped many times a second. glibc serves most of them from the main
heap, and a small object left live above a freed region pins it: in a soak
of file create/write/read/unlink (64 MiB L1, 16 MiB write buffer) the mount
grew to 300-390 MiB while the live Python objects stayed near 100 MiB, and
``malloc_trim(0)`` gave back half of it at once. Neither
``MALLOC_ARENA_MAX`` nor a fixed ``MALLOC_MMAP_THRESHOLD_`` changed that.
:class:`HeapTrimmer` therefore calls ``malloc_trim`` whenever the resident
size has grown by :data:`TRIM_SLACK` since the last trim (checked every
:data:`TRIM_CHECK` seconds: at a few hundred MB/s of blocks made and dropped,
a check once a second let the heap overshoot the slack by tens of MiB), and
at least every :data:`TRIM_PERIOD` seconds: the resident size stays within
that slack of the live heap, and comes back down to it after a burst.

A trim gives back only what is free. Buffers caught in reference cycles
are not, until the cyclic collector runs: a block put used to leave its
shards in one (its closures name each other; see
``BackingClient.put_block``), and a soak's resident size after each trim
then climbed from 83 to 205 MiB in 15 s before a full collection dropped it
to 120 at once. Code on the data path must not leave big buffers in cycles.

:class:`MemoryTracer` is how that was found: tracemalloc snapshots diffed
over time. The mount runs it on SIGUSR2 (the first starts tracing, each
later one logs the allocation sites that grew since the one before).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

TRIM_SLACK = 32 << 20  # resident growth since the last trim that starts another
TRIM_PERIOD = 10.0  # seconds: the longest between two trims
TRIM_CHECK = 0.25  # seconds between two looks at the resident size (a read of /proc/self/statm)
FRAMES = 8  # frames kept per traced allocation
TOP = 15


def rss() -> int:
    """This process's resident bytes (0 where /proc is not there)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None on a libc without it (musl)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class HeapTrimmer:
    """Gives free heap pages back to the kernel once the resident size has
    grown by ``slack`` bytes since the last time, or ``period`` seconds after
    it (see the module docstring)."""

    def __init__(
        self, slack: int = TRIM_SLACK, period: float = TRIM_PERIOD, resident: Callable[[], int] = rss
    ) -> None:
        self.slack = slack
        self.period = period
        self._resident = resident
        self._trim = _malloc_trim()
        self._floor = resident()  # the resident size right after the last trim
        self._last = time.monotonic()
        self.trims = 0
        self.released = 0  # bytes the trims gave back

    @property
    def available(self) -> bool:
        return self._trim is not None

    def due(self) -> bool:
        """Whether a trim is due; costs a read of /proc/self/statm."""
        now = self._resident()
        if self._trim is None:
            return False
        if now >= self._floor + self.slack or time.monotonic() - self._last >= self.period:
            return True
        self._floor = min(self._floor, now)
        return False

    def check(self) -> bool:
        """Trim if due; True when it trimmed."""
        if not self.due():
            return False
        self.trim()
        return True

    def trim(self) -> None:
        """Give free heap pages back now: a trim of a mount's heap took 1-40 ms
        (more on a loaded machine), so the mount calls this in a thread."""
        if self._trim is None:
            return
        now = self._resident()
        started = time.monotonic()
        self._trim(0)
        after = self._resident()
        self._last = time.monotonic()
        self.trims += 1
        self.released += max(0, now - after)
        self._floor = after
        log.debug("malloc_trim: resident %d -> %d MiB in %.1f ms",
                  now >> 20, after >> 20, (self._last - started) * 1e3)  # fmt: skip


class MemoryTracer:
    """tracemalloc on demand: the first :meth:`step` starts tracing (it costs
    CPU and memory, so it is off until asked), each later one reports the
    allocation sites that grew most since the step before, and the largest."""

    def __init__(self, top: int = TOP) -> None:
        self.top = top
        self._last: tracemalloc.Snapshot | None = None

    def step(self) -> str:
        if not tracemalloc.is_tracing():
            tracemalloc.start(FRAMES)
            self._last = None
            return f"tracemalloc started ({FRAMES} frames); signal again to see what grows"
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)]
        )
        traced, peak = tracemalloc.get_traced_memory()
        lines = [f"traced {traced / 2**20:.1f} MiB (peak {peak / 2**20:.1f} MiB)"]
        if self._last is not None:
            lines.append(f"grew most since the last report (top {self.top}):")
            lines += [f"  {stat}" for stat in snapshot.compare_to(self._last, "lineno")[: self.top]]
        lines.append(f"largest (top {self.top}):")
        lines += [f"  {stat}" for stat in snapshot.statistics("lineno")[: self.top]]
        self._last = snapshot
        return "\n".join(lines)
