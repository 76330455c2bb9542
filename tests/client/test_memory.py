"""A mount's memory stays under the bound it exports (issue 16, item 6).

Four writers create, write, read back, rename and unlink files of 64 KiB to
8 MiB on a real cluster mount for :data:`RUN` seconds while the mount's
resident size is sampled. Before the fix it rose for as long as the traffic
ran, and stayed at its peak after it (freed heap pages stayed resident,
and each file being written could hold its own full write buffer). Now no
sample may pass ``cachefs_mount_memory_bound_bytes``, read from the mount's
``.cachefs/stats`` at the same moment: the sum of every budget the mount has
(client/memory.py, docs/deploy.md "Memory of a mount"), with the FUSE
workers capped at :data:`WORKERS`, whose receive buffers are the one part
only concurrency bounded. Once the traffic stops, the mount gives memory
back: within :data:`IDLE` seconds it holds no more than what it keeps when
nothing is in flight, its fixed part + L1 + the inodes + the trimmer's
slack (the old code stayed at its peak, 320 MiB with these options).
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest

from cachefs.backing.policy import VolumePolicy
from cachefs.client.memory import FIXED_MAX, FUSE_BUFFER, upload_factor
from cachefs.heap import TRIM_PERIOD

from .conftest import ClusterMount

RUN = 36.0  # seconds of traffic
MiB = 1 << 20
WRITERS = 4
WORKERS = 8  # --fuse-workers: FUSE requests served at once
L1, BUFFER, BUFFER_TOTAL, READAHEAD = 32 * MiB, 8 * MiB, 24 * MiB, 8 * MiB
IDLE = TRIM_PERIOD + 5  # seconds after the traffic for the heap to come back down
SIZES = [64 << 10, 1 * MiB, 4 * MiB, 8 * MiB]
BUDGET = 'cachefs_mount_memory_budget_bytes{part="'
BOUND = "cachefs_mount_memory_bound_bytes "


def resident(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def budget(mnt: Path) -> tuple[int, dict[str, int]]:
    """The bound the mount exports now, and its parts."""
    bound, parts = None, {}
    for line in (mnt / ".cachefs" / "stats").read_text().splitlines():
        if line.startswith(BUDGET):
            parts[line.split('"')[1]] = int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith(BOUND):
            bound = int(float(line.removeprefix(BOUND)))
    assert bound is not None, "the mount exports no memory bound"
    return bound, parts


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


@pytest.mark.needs_fuse
def test_resident_memory_stays_under_the_exported_bound(cluster, tmp_path: Path) -> None:
    m = ClusterMount(cluster, tmp_path, "--l1-size", str(L1), "--write-buffer", str(BUFFER),
                     "--write-buffer-total", str(BUFFER_TOTAL), "--readahead", str(READAHEAD),
                     "--fuse-workers", str(WORKERS))  # fmt: skip
    try:
        bound, parts = budget(m.path)
        assert parts["fixed"] < FIXED_MAX, f"{parts['fixed'] // MiB} MiB when the mount began serving"
        assert (parts["l1"], parts["write_buffers"], parts["fuse_buffers"]) == (L1, BUFFER_TOTAL,
                                                                                WORKERS * FUSE_BUFFER)
        assert bound == sum(parts.values())
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
        samples: list[tuple[float, int, int]] = []  # (when, resident, bound)
        start = time.monotonic()
        while any(t.is_alive() for t in writers):
            rss = resident(m.pid)
            samples.append((time.monotonic() - start, rss, budget(m.path)[0]))
            time.sleep(0.25)
        for t in writers:
            t.join()
        assert not errors, errors
        _, parts = budget(m.path)
        kept = parts["fixed"] + parts["l1"] + parts["metadata"] + parts["heap_slack"]  # nothing in flight
        settled = time.monotonic() + IDLE
        while resident(m.pid) > kept and time.monotonic() < settled:
            time.sleep(0.25)
        idle = resident(m.pid)
    finally:
        m.stop()
    m.check_log()
    trace = " ".join(f"{at:.0f}s:{rss // MiB}/{limit // MiB}" for at, rss, limit in samples[::8])
    over = [(at, rss, limit) for at, rss, limit in samples if rss > limit]
    assert not over, f"resident past the exported bound (MiB): {over[:5]}; {trace}"
    peak = max(rss for _, rss, _ in samples)
    print(f"peak {peak // MiB} MiB, bound {bound // MiB} MiB, idle {idle // MiB} MiB: {trace}")
    assert idle <= kept, f"{idle // MiB} MiB {IDLE:.0f}s after the traffic, past {kept // MiB} MiB: {trace}"


def test_an_upload_holds_its_copy_its_compressed_form_and_its_shards() -> None:
    assert upload_factor(VolumePolicy.parse("ec:2+1")) == 2.5
    assert upload_factor(VolumePolicy.parse("ec:4+2", compression="zstd")) == 3.5
    assert upload_factor(VolumePolicy.parse("replica:3")) == 1  # one buffer, sent three times
    assert upload_factor(None) >= upload_factor(VolumePolicy.parse("ec:1+1", compression="zstd"))
