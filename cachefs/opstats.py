"""Latency histograms and errors by errno, keyed by op, cheap enough for the read path.

Every FUSE handler is timed (client/fs.py's ``_fuse``), and so is every RPC a
mount makes (``RpcPool.calls``), so an observation must cost next to nothing:
plain lists and ints touched only by the trio thread (no lock, no label
lookup), which the metrics thread reads for a scrape (client/mount.py's
collector). A scrape may see an op's sum one observation ahead of its
buckets; the buckets and the count always agree.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter

# Upper bounds in seconds: a cached getattr answers in tens of µs, a cold read
# of a block from backing storage in tens of ms, a commit in up to seconds.
BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
           0.5, 1.0, 2.5, 10.0)


class OpStats:
    """Latency of each op (a FUSE request, an RPC method), and the errors each returned, by errno."""

    __slots__ = ("counts", "sums", "errors")

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}  # per op: one count per bucket, then +Inf
        self.sums: dict[str, float] = {}
        self.errors: Counter[tuple[str, int]] = Counter()

    def observe(self, op: str, seconds: float) -> None:
        counts = self.counts.get(op)
        if counts is None:
            counts = self.counts[op] = [0] * (len(BUCKETS) + 1)
            self.sums[op] = 0.0
        counts[bisect_left(BUCKETS, seconds)] += 1
        self.sums[op] += seconds

    def error(self, op: str, errno: int) -> None:
        self.errors[(op, errno)] += 1

    def histogram(self, op: str) -> tuple[list[tuple[str, int]], float]:
        """Cumulative ``(le, count)`` buckets as Prometheus wants them, and the sum."""
        cumulative, total = [], 0
        for bound, count in zip((*map(str, BUCKETS), "+Inf"), list(self.counts[op]), strict=True):
            total += count
            cumulative.append((bound, total))
        return cumulative, self.sums[op]
