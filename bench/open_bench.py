"""open()+release() latency of one client against a real 3-replica metanode cluster.

A data loader opens thousands of small files once each; every FUSE open and
release calls the metanodes' ``open``/``release`` (what keeps unlinked-but-open
files alive). This measures one client doing ``open`` then ``release`` of a
different file each time, and, in the same run as baselines, a ``getattr``
(a linearizable read) and a ``mknod`` (a replicated, fsynced mutation).
Also reports how many Raft log entries the open/release pairs added.

    python -m bench.open_bench [--json] [--files 300]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from bench.common import create_volume_once_elected, emit, median, print_table, ratio
from cachefs import commands as C
from cachefs import queries as Q
from cachefs.testing.metacluster import MetaCluster

VOL = "bench"


async def _bench(addrs: list[str], files: int) -> dict[str, Any]:
    from cachefs.metanode.client import MetaClient
    from cachefs.rpc import RpcPool

    async with RpcPool(secret=None) as pool:
        mc = MetaClient(pool, addrs, deadline=60.0)
        await create_volume_once_elected(mc, VOL)
        session = (await mc.mount_volume(VOL)).session
        mknod: list[float] = []
        inos = []
        for i in range(files):
            t = time.perf_counter()
            inos.append((await mc.mutate(C.Mknod(VOL, 1, b"f%d" % i, 0o100644))).ino)
            mknod.append(time.perf_counter() - t)
        getattr_: list[float] = []
        for ino in inos:
            t = time.perf_counter()
            await mc.query(Q.GetAttr(VOL, ino))
            getattr_.append(time.perf_counter() - t)
        assert mc.leader is not None
        before = (await pool.call(mc.leader, "meta_status", {}, timeout=5)).result
        pair: list[float] = []
        for ino in inos:
            t = time.perf_counter()
            await mc.query(Q.Open(VOL, ino, session))
            await mc.query(Q.Release(VOL, ino, session))
            pair.append(time.perf_counter() - t)
        after = (await pool.call(mc.leader, "meta_status", {}, timeout=5)).result
        await mc.close_session(session)
    return {
        "files": files,
        "open_release_p50_ms": median(pair) * 1e3,
        "getattr_p50_ms": median(getattr_) * 1e3,
        "mknod_p50_ms": median(mknod) * 1e3,
        "open_release_vs_mknod": ratio(median(pair), median(mknod)),
        "log_entries_per_open_release": (after["commit_index"] - before["commit_index"]) / files,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--files", type=int, default=300)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="open-bench-"))
    cluster = MetaCluster(root, 3, log_level="warning")
    cluster.start_all()
    try:
        result = trio.run(_bench, cluster.addrs, args.files)
    finally:
        cluster.stop_all()
        shutil.rmtree(root, ignore_errors=True)

    def show() -> None:
        print_table(
            "open+release, one client, 3 metanodes (fsync on)",
            ["case", "p50 ms"],
            [
                ["open+release (one file each)", result["open_release_p50_ms"]],
                ["getattr (baseline: read)", result["getattr_p50_ms"]],
                ["mknod (baseline: replicated write)", result["mknod_p50_ms"]],
            ],
            note=f"log entries per open+release: {result['log_entries_per_open_release']:.2f}",
        )

    emit(result, args.json, show)


if __name__ == "__main__":
    main()
