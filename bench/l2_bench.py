"""CPU per 1,000 random 4 KiB reads served by L2, in this process (no FUSE).

    python -m bench.l2_bench --blocks 64 --reads 4000 --repeat 3 --json

The part of a mount's random read that L2 owns (the store's lookup, open,
``pread``, checksum, and the hop to a worker thread for a range not in the
page cache), measured as process CPU time (all threads) per 1,000 reads, on
a store of ``--blocks`` 4 MiB blocks read by 4 concurrent tasks. Variants,
interleaved in each round: block files opened per read (``open_files=0``,
as before L2 kept them) and kept open (the default); each in two modes:
``pagecache`` (the block files read once before: every read inline) and
``disk`` (their pages dropped with ``POSIX_FADV_DONTNEED``, our own files
only: reads hop to a thread until the page cache holds them). Also counted:
the share of reads that hopped, and bytes read from the disk per read
(``/proc/self/io``; the kernel's readahead shows here). Exact counts are
steadier than CPU on a loaded machine; CPU is the median of the rounds.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from bench.common import emit, median, print_table, ratio
from cachefs.client.l2 import L2Cache
from cachefs.ids import BlockKey

BLOCK = 4 << 20
READ = 4096
TASKS = 4


def _read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _set_pages(root: Path, cached: bool) -> None:
    for path in (root / "blocks").glob("*/*"):
        fd = os.open(path, os.O_RDONLY)
        try:
            if cached:
                while os.read(fd, 1 << 20):
                    pass
            else:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


async def _fill(root: Path, blocks: int) -> list[BlockKey]:
    keys = [BlockKey(7000, i) for i in range(blocks)]
    async with trio.open_nursery() as nursery:
        l2 = L2Cache.open(root, 2 * blocks * BLOCK, "bench", free_space_ratio=0.0, nursery=nursery)
        for key in keys:
            await trio.to_thread.run_sync(l2.store.put, "bench", key, random.randbytes(BLOCK))
        nursery.cancel_scope.cancel()
    return keys


async def _run(root: Path, keys: list[BlockKey], open_files: int | None, mode: str, reads: int,
               seed: int) -> dict[str, float]:  # fmt: skip
    _set_pages(root, cached=mode == "pagecache")
    rng = random.Random(seed)
    plan = [(rng.choice(keys), rng.randrange(BLOCK // READ) * READ) for _ in range(reads)]
    async with trio.open_nursery() as nursery:
        l2 = L2Cache.open(root, 2 * len(keys) * BLOCK, "bench", free_space_ratio=0.0, nursery=nursery,
                          open_files=open_files)  # fmt: skip

        async def task(part: list[tuple[BlockKey, int]]) -> None:
            for key, offset in part:
                assert await l2.read(key, offset, READ) is not None

        disk0, cpu0, wall0 = _read_bytes(), time.process_time(), time.perf_counter()
        async with trio.open_nursery() as tasks:
            for i in range(TASKS):
                tasks.start_soon(task, plan[i::TASKS])
        cpu, wall, disk = time.process_time() - cpu0, time.perf_counter() - wall0, _read_bytes() - disk0
        hops = l2.stats["l2_disk_reads"]
        nursery.cancel_scope.cancel()
    return {
        "cpu_ms_per_1k": cpu * 1000 / (reads / 1000),
        "hop_share": hops / reads,
        "disk_kib_per_read": disk / 1024 / reads,
        "reads_per_s": reads / wall,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="l2-bench-", dir=args.workdir))
    runs: dict[str, list[dict[str, float]]] = {}
    try:
        keys = trio.run(_fill, root, args.blocks)
        variants = {"opened_per_read": 0, "kept_open": None}
        for r in range(args.repeat):
            order = list(variants.items())
            if r % 2:
                order.reverse()
            for name, open_files in order:
                for mode in ("pagecache", "disk"):
                    result = trio.run(_run, root, keys, open_files, mode, args.reads, r)
                    runs.setdefault(f"{name}_{mode}", []).append(result)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {case: {k: round(median([x[k] for x in xs]), 3) for k in xs[0]} for case, xs in runs.items()}
    return {
        "blocks": args.blocks,
        "reads": args.reads,
        "repeat": args.repeat,
        "median": med,
        "runs": runs,
        "l2_cpu_kept_vs_opened_pagecache": ratio(med["kept_open_pagecache"]["cpu_ms_per_1k"],
                                                 med["opened_per_read_pagecache"]["cpu_ms_per_1k"]),
        "l2_cpu_kept_vs_opened_disk": ratio(med["kept_open_disk"]["cpu_ms_per_1k"],
                                            med["opened_per_read_disk"]["cpu_ms_per_1k"]),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="CPU per 1,000 random 4 KiB L2 reads")
    parser.add_argument("--blocks", type=int, default=64, help="4 MiB blocks in the store")
    parser.add_argument("--reads", type=int, default=4000, help="reads per case (4 tasks)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="directory of the store (default: /tmp)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args)

    def show() -> None:
        rows = [[case, *m.values()] for case, m in result["median"].items()]
        print_table("L2 random 4 KiB reads (medians)", ["case", "CPU ms/1k", "hop share", "disk KiB/read",
                                                        "reads/s"], rows, note="shared machine: CPU is noisy")  # fmt: skip

    emit(result, args.json, show)


if __name__ == "__main__":
    main()
