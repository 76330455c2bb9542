"""Every FUSE op is timed into cachefs_mount_op_latency_seconds{op} and its errors
counted by errno, as a real mount serves them; the timing costs little per op."""

from __future__ import annotations

import os
import re
import time
import urllib.request
from pathlib import Path

import pytest

from cachefs.opstats import BUCKETS, OpStats
from cachefs.testing.ports import free_port

from .conftest import LocalMount


def test_buckets_are_cumulative_and_count_every_observation() -> None:
    ops = OpStats()
    for seconds in (0.00001, 0.00005, 0.003, 0.003, 99.0):
        ops.observe("read", seconds)
    buckets, total = ops.histogram("read")
    assert [b for b, _ in buckets] == [*map(str, BUCKETS), "+Inf"]
    counts = dict(buckets)
    assert counts["5e-05"] == 2 and counts["0.0025"] == 2 and counts["0.005"] == 4 and counts["+Inf"] == 5
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:], strict=False))
    assert total == pytest.approx(99.00611)


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def _value(text: str, sample: str) -> float:
    found = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.needs_fuse
def test_a_mount_times_every_op_and_counts_errors_by_errno(needs_fuse, tmp_path: Path) -> None:
    port = free_port()
    m = LocalMount(tmp_path, "--metrics-port", str(port))
    try:
        before = _scrape(port)
        (m.path / "f").write_bytes(b"x" * 100_000)
        for _ in range(3):
            with open(m.path / "f", "rb", buffering=0) as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                assert len(f.read()) == 100_000
        assert not (m.path / "missing").exists()
        text = _scrape(port)
        for op in ("lookup", "create", "write", "open", "read", "flush", "release"):
            sample = f'cachefs_mount_op_latency_seconds_count{{op="{op}"}}'
            assert _value(text, sample) > _value(before, sample), op
            assert _value(text, f'cachefs_mount_op_latency_seconds_bucket{{le="+Inf",op="{op}"}}') == \
                _value(text, sample), op
        assert _value(text, 'cachefs_mount_op_errors_total{errno="ENOENT",op="lookup"}') >= 1
        assert _value(text, 'cachefs_mount_op_latency_seconds_sum{op="read"}') > 0
        # The write path, mount-wide (the file's writer is gone after its close).
        assert _value(text, "cachefs_mount_write_bytes_total") - _value(before, "cachefs_mount_write_bytes_total") \
            == 100_000
        assert _value(text, "cachefs_mount_committed_bytes_total") >= 100_000
        commits = _value(text, "cachefs_mount_commit_latency_seconds_count")
        assert commits >= 1 and commits == _value(text, "cachefs_mount_slices_committed_total")
        assert _value(text, 'cachefs_mount_commit_latency_seconds_bucket{le="+Inf"}') == commits
    finally:
        assert m.stop() == 0


def test_the_timing_costs_a_few_hundred_nanoseconds_per_op() -> None:
    """What ``_fuse`` adds to every request: two clock reads and one observe.
    Timed in this thread's CPU time, the best of five rounds: on a shared
    machine wall time also counts the rounds the scheduler gave to others."""
    ops = OpStats()
    n, rounds = 40_000, 5
    per_op = float("inf")
    for _ in range(rounds):
        started = time.thread_time()
        for _ in range(n):
            t0 = time.perf_counter()
            ops.observe("read", time.perf_counter() - t0)
        per_op = min(per_op, (time.thread_time() - started) / n)
    assert sum(ops.counts["read"]) == n * rounds
    assert per_op < 5e-6, f"{per_op * 1e9:.0f} ns per op"
