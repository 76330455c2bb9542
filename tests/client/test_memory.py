"""A mount's memory stays bounded under file traffic (issue 16, item 6).

Four writers create, write, read back, rename and unlink files of 64 KiB to
8 MiB on a real cluster mount for :data:`RUN` seconds while the mount's
resident size is sampled. Before the fix it rose for as long as the traffic
ran, and stayed at its peak after it (freed heap pages stayed resident,
and each file being written could hold its own full write buffer). Now no
sample may pass the bound of docs/deploy.md ("Memory of a mount"), the sum
of every budget the mount has: its resident size just after mounting + L1
+ the total write buffer (runs are uploaded from their own buffers) + the
block uploads in flight (each block's copy and its shards) + the block
fetches in flight (readahead's and each reader's own) + a FUSE request
buffer per writer + the heap trimmer's slack + the inodes the kernel holds;
and once the traffic stops, the mount gives memory back: within
:data:`IDLE` seconds it holds no more than what it keeps when nothing is in
flight, its size after mounting + L1 + the inodes + the trimmer's slack
(the old code stayed at its peak, 320 MiB with these options).
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest

from cachefs.client.reader import PREFETCH_PARALLEL
from cachefs.client.volume import ClientOptions
from cachefs.heap import TRIM_PERIOD, TRIM_SLACK

from .conftest import ClusterMount

pytestmark = pytest.mark.needs_fuse

RUN = 36.0  # seconds of traffic
MiB = 1 << 20
WRITERS = 4
L1, BUFFER, BUFFER_TOTAL, READAHEAD = 32 * MiB, 8 * MiB, 24 * MiB, 8 * MiB
BLOCK = 4 * MiB
SHARDS = 3 / 2  # ec:2+1: the shards of a block are 1.5 times its size
UPLOADS = int(ClientOptions().upload_parallel * BLOCK * (1 + SHARDS))  # each block's copy and its shards
FETCHES = (PREFETCH_PARALLEL + WRITERS) * BLOCK  # readahead's block fetches, and each reader's own
FUSE_REQUEST = MiB + 4096  # libfuse's receive buffer (max_write and a header), one per request served
INODE = 1024  # an inode the kernel holds (its table entry, attributes, lease)
FIXED = 64 * MiB  # the most a fresh mount may hold: interpreter, libraries, RPC buffers
IDLE = TRIM_PERIOD + 5  # seconds after the traffic for the heap to come back down
SIZES = [64 << 10, 1 * MiB, 4 * MiB, 8 * MiB]


def resident(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def traffic(root: Path, seed: int, until: float, errors: list[BaseException]) -> None:
    rnd = random.Random(seed)
    try:
        n = 0
        while time.monotonic() < until:
            n += 1
            path = root / f"f{n}"
            data = rnd.randbytes(rnd.choice(SIZES))
            path.write_bytes(data)
            assert path.read_bytes() == data
            moved = root / f"g{n}"
            path.rename(moved)
            if n % 4:  # a quarter of the files stay: inodes the kernel keeps
                moved.unlink()
    except BaseException as exc:
        errors.append(exc)


def test_resident_memory_levels_off_under_file_traffic(cluster, tmp_path: Path) -> None:
    m = ClusterMount(cluster, tmp_path, "--l1-size", str(L1), "--write-buffer", str(BUFFER),
                     "--write-buffer-total", str(BUFFER_TOTAL), "--readahead", str(READAHEAD))  # fmt: skip
    floor = resident(m.pid)
    try:
        work = m.path / f"soak-{tmp_path.name}"
        work.mkdir()
        errors: list[BaseException] = []
        until = time.monotonic() + RUN
        writers = []
        for i in range(WRITERS):
            (work / str(i)).mkdir()
            writers.append(threading.Thread(target=traffic, args=(work / str(i), i, until, errors)))
        for t in writers:
            t.start()
        samples: list[tuple[float, int]] = []
        start = time.monotonic()
        while any(t.is_alive() for t in writers):
            samples.append((time.monotonic() - start, resident(m.pid)))
            time.sleep(0.25)
        for t in writers:
            t.join()
        assert not errors, errors
        peak = max(rss for _, rss in samples)
        inodes = (sum(len(os.listdir(work / str(i))) for i in range(WRITERS)) + 2 * WRITERS) * INODE
        kept = floor + L1 + inodes + TRIM_SLACK  # what stays once nothing is in flight
        settled = time.monotonic() + IDLE
        while resident(m.pid) > kept and time.monotonic() < settled:
            time.sleep(0.25)
        idle = resident(m.pid)
    finally:
        m.stop()
    m.check_log()
    trace = " ".join(f"{at:.0f}s:{rss // MiB}" for at, rss in samples[::8])
    bound = floor + L1 + BUFFER_TOTAL + UPLOADS + FETCHES + WRITERS * FUSE_REQUEST + TRIM_SLACK + inodes
    assert floor < FIXED, f"{floor // MiB} MiB just after mounting"
    assert peak <= bound, f"peak {peak // MiB} MiB, past the bound of {bound // MiB} MiB: {trace}"
    assert idle <= kept, f"{idle // MiB} MiB {IDLE:.0f}s after the traffic, past {kept // MiB} MiB: {trace}"
