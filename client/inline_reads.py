"""Whether L2 reads a small range on the event loop or in a worker thread.

A small range (a random 4 KiB read of a file larger than L1) costs about
0.1 ms from a local SSD. Read inline on the trio thread, that is all it
costs. Handed to a worker thread it costs more than the disk read: a queue
hand-off, a wake-up of the loop and the GIL passed back and forth, with
four threads contending for it on two cores. Measured here (random 4 KiB
reads of 4 x 1 GiB files, 4 fio jobs, page cache dropped): 2,500 IOPS
through the threads, 3,100 inline; 3,800 inline from 16 KiB segments.

But an inline read stalls every other request of the mount for as long as
the disk takes, and a slow or busy disk (a network volume, a loaded HDD)
takes milliseconds. So small ranges are read inline while the disk is
fast, as measured: an exponentially weighted mean of what each small read
cost (inline, or the ``pread`` itself in a thread). Past ``stall_max`` they
go to the threads (after a ``RWF_NOWAIT`` try on the loop for what the page
cache holds); below half of it they come back inline. Sans-IO: the caller
times its reads and asks :attr:`InlineReads.inline`.
"""

from __future__ import annotations

from dataclasses import dataclass

STALL_MAX = 0.001  # seconds: the mean inline read time past which reads go to threads
WEIGHT = 1 / 16  # of each new read time in the mean


@dataclass(slots=True)
class InlineReads:
    """The inline-or-thread decision for small reads (see module docstring).

    ``stall_max`` of 0 never reads inline (every range on the disk goes to a
    thread, as on a disk known to be slow)."""

    stall_max: float = STALL_MAX
    weight: float = WEIGHT
    mean: float = 0.0
    inline: bool = True

    def __post_init__(self) -> None:
        if self.stall_max < 0 or not 0 < self.weight <= 1:
            raise ValueError(
                f"bad inline read policy: stall_max={self.stall_max} weight={self.weight}"
            )
        self.inline = self.stall_max > 0

    def observe(self, seconds: float) -> None:
        """One small read took ``seconds`` (of disk or page cache, not of waiting for a thread)."""
        self.mean += self.weight * (seconds - self.mean)
        if self.inline and self.mean > self.stall_max:
            self.inline = False
        elif not self.inline and self.stall_max > 0 and self.mean < self.stall_max / 2:
            self.inline = True
