"""Metadata throughput and latency of a real 3-replica metanode cluster (fsync on).

Cases, each with 1 and 32 concurrent clients (tasks with their own MetaClient,
so their own session and seq numbers, over one connection pool):
creates (``mknod``, a Raft commit each), ``getattr`` and ``lookup``
(linearizable reads through read-index), and listing a 10,000-entry
directory with ``readdir`` pages of 1,000. The baseline, measured in the same
run against the same leader, is the RPC layer's built-in ``health`` call: the
floor any metadata call pays for framing and a round trip. Latencies are
p50/p99 per call; rates are the median over ``--repeat`` runs.

``--no-read-lease`` runs the metanodes with one read-index round per read
instead of the leader lease. ``--inodes N`` also measures the state machine's memory: N files of one slice
each, built in a fresh process, resident bytes per inode, and how long a
snapshot takes inline and how long the fork that replaces it pauses.

    python -m bench.meta_bench [--json] [--seconds 2] [--repeat 3] [--inodes 1000000]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
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
CLIENTS = (1, 32)
LISTING = 10_000


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _timed(clients: int, seconds: float, make_op: Any) -> tuple[float, list[float]]:
    """Run ``clients`` tasks calling their op until ``seconds`` pass: (ops/s, latencies)."""
    lat: list[float] = []
    done = 0
    ops = [await make_op(c) for c in range(clients)]
    deadline = time.perf_counter() + seconds

    async def worker(op: Any) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            await op()
            lat.append(time.perf_counter() - t)
            done += 1

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for op in ops:
            nursery.start_soon(worker, op)
    return done / (time.perf_counter() - start), lat


async def _bench(addrs: list[str], seconds: float, repeat: int) -> dict[str, Any]:
    from cachefs.metanode.client import MetaClient
    from cachefs.rpc import RpcPool

    out: dict[str, Any] = {}
    async with RpcPool(secret=None) as pool:
        admin = MetaClient(pool, addrs, deadline=60.0)
        await create_volume_once_elected(admin, VOL)
        leader = admin.leader
        assert leader is not None
        run_id = [0]

        async def health_op(c: int) -> Any:
            async def op() -> None:
                await pool.call(leader, "health", {}, timeout=10.0)

            return op

        async def create_op(c: int) -> Any:
            mc = MetaClient(pool, [leader, *addrs])
            run_id[0] += 1
            d = (await mc.mutate(C.Mkdir(VOL, 1, f"c{run_id[0]}".encode(), 0o755))).ino
            n = iter(range(10**9))

            async def op() -> None:
                await mc.mutate(C.Mknod(VOL, d, b"f%d" % next(n), 0o100644))

            return op

        target = await admin.mutate(C.Mkdir(VOL, 1, b"target", 0o755))
        await admin.mutate(C.Mknod(VOL, target.ino, b"file", 0o100644))

        async def getattr_op(c: int) -> Any:
            mc = MetaClient(pool, [leader, *addrs])

            async def op() -> None:
                await mc.query(Q.GetAttr(VOL, target.ino))

            return op

        async def lookup_op(c: int) -> Any:
            mc = MetaClient(pool, [leader, *addrs])

            async def op() -> None:
                await mc.query(Q.Lookup(VOL, target.ino, b"file"))

            return op

        cases = {
            "health (baseline)": health_op,
            "create": create_op,
            "getattr": getattr_op,
            "lookup": lookup_op,
        }
        for name, make in cases.items():
            for clients in CLIENTS:
                rates, lats = [], []
                for _ in range(repeat):
                    rate, lat = await _timed(clients, seconds, make)
                    rates.append(rate)
                    lats.extend(lat)
                out[(name, clients)] = {
                    "per_s": median(rates),
                    "p50_ms": _pct(lats, 0.5) * 1e3,
                    "p99_ms": _pct(lats, 0.99) * 1e3,
                }

        # a 10,000-entry directory, listed in pages of 1,000
        big = (await admin.mutate(C.Mkdir(VOL, 1, b"big", 0o755))).ino
        async with trio.open_nursery() as nursery:
            for c in range(32):

                async def fill(c: int = c) -> None:
                    mc = MetaClient(pool, [leader, *addrs])
                    for i in range(c, LISTING, 32):
                        await mc.mutate(C.Mknod(VOL, big, b"e%05d" % i, 0o100644))

                nursery.start_soon(fill)
        times = []
        for _ in range(max(repeat, 3)):
            t = time.perf_counter()
            cookie, total = 0, 0
            while True:
                page = await admin.query(Q.ReadDir(VOL, big, cookie, 1000))
                if not page:
                    break
                total += len(page)
                cookie = page[-1][2]
            times.append(time.perf_counter() - t)
            assert total == LISTING, total
        out["readdir_10k_s"] = median(times)
    return out


def measure_memory(n: int) -> dict[str, float]:
    """Resident bytes per inode for ``n`` files of one slice each (run in a fresh process)."""
    import gc

    from cachefs.metanode.namespace import MetaState

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    state = MetaState()
    counter = itertools.count(1)
    now = time.time_ns()

    def do(cls: type[C.Command], *args: Any) -> Any:
        n = next(counter)  # log index and client seq alike, as a real log would have them
        return state.apply(n, cls(*args, client_id="bench-client", seq=n, now_ns=now + n))

    do(C.CreateVolume, VOL, "replica:3", "none", 4 << 20, 64)
    gc.collect()
    base = rss()
    t = time.perf_counter()
    sid = do(C.AllocSlices, n)
    per_dir = 1000
    made = 0
    for d in range((n + per_dir - 1) // per_dir):
        dino = do(C.Mkdir, VOL, 1, b"d%06d" % d, 0o755, 0, 0).ino
        for _ in range(min(per_dir, n - made)):
            ino = do(C.Mknod, VOL, dino, b"sample-%08d.jpg" % made, 0o100644, 0, 0, 0).ino
            do(C.WriteSlice, VOL, ino, 0, sid + made, 0, 110_000, 0, now + made)
            made += 1
    build = time.perf_counter() - t
    gc.collect()
    used = rss() - base
    t = time.perf_counter()
    blob = state.snapshot()
    snap = time.perf_counter() - t
    # What a metanode pauses for when it snapshots: the fork of its process
    # (the child serializes the copy-on-write view; see raft/driver.py).
    stalls = []
    for _ in range(3):
        t = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        stalls.append(time.perf_counter() - t)
        os.waitpid(pid, 0)
    return {
        "inodes": n,
        "bytes_per_inode": used / n,
        "build_s": build,
        "snapshot_s": snap,
        "snapshot_fork_pause_s": median(stalls),
        "snapshot_bytes": len(blob),
    }


def main(argv: list[str] | None = None) -> int | None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per timed case")
    parser.add_argument("--repeat", type=int, default=3, help="runs per case (median reported)")
    parser.add_argument(
        "--inodes", type=int, default=0, help="also measure bytes per inode at N files"
    )
    parser.add_argument(
        "--no-read-lease",
        action="store_true",
        help="run the metanodes with a read-index round per read",
    )
    parser.add_argument("--memory-only", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_only:
        print(json.dumps(measure_memory(args.memory_only)))
        return 0
    root = Path(tempfile.mkdtemp(prefix="meta-bench-"))
    cluster = MetaCluster(root, 3, extra=["--no-read-lease"] if args.no_read_lease else [], log_level="warning")
    cluster.start_all()
    try:
        res = trio.run(_bench, cluster.addrs, args.seconds, args.repeat)
    finally:
        cluster.stop_all()
        shutil.rmtree(root, ignore_errors=True)
    mem = None
    if args.inodes:
        raw = subprocess.run(
            [sys.executable, "-m", "bench.meta_bench", "--memory-only", str(args.inodes)],
            capture_output=True,
            check=True,
            text=True,
        )
        mem = json.loads(raw.stdout)
    base1 = res[("health (baseline)", 1)]["per_s"]
    base32 = res[("health (baseline)", 32)]["per_s"]
    result: dict[str, Any] = {
        "creates_per_s_1client": res[("create", 1)]["per_s"],
        "creates_per_s_32clients": res[("create", 32)]["per_s"],
        "getattr_per_s_1client": res[("getattr", 1)]["per_s"],
        "getattr_per_s_32clients": res[("getattr", 32)]["per_s"],
        "lookups_per_s_1client": res[("lookup", 1)]["per_s"],
        "lookups_per_s_32clients": res[("lookup", 32)]["per_s"],
        "create_p50_ms_1client": res[("create", 1)]["p50_ms"],
        "create_p99_ms_1client": res[("create", 1)]["p99_ms"],
        "create_p99_ms_32clients": res[("create", 32)]["p99_ms"],
        "getattr_p50_ms_1client": res[("getattr", 1)]["p50_ms"],
        "readdir_10k_entries_s": res["readdir_10k_s"],
        "baseline_health_per_s_1client": base1,
        "baseline_health_per_s_32clients": base32,
        "create_vs_baseline_32clients": ratio(res[("create", 32)]["per_s"], base32),
        "getattr_vs_baseline_32clients": ratio(res[("getattr", 32)]["per_s"], base32),
    }
    if mem:
        result["bytes_per_inode"] = mem["bytes_per_inode"]
        result["memory"] = mem

    def show() -> None:
        rows = []
        for (name, clients), r in sorted((k, v) for k, v in res.items() if isinstance(k, tuple)):
            base = base1 if clients == 1 else base32
            rows.append(
                [name, clients, r["per_s"], r["p50_ms"], r["p99_ms"], ratio(r["per_s"], base)]
            )
        print_table(
            "metanode (3 replicas, fsync on)",
            ["op", "clients", "ops/s", "p50 ms", "p99 ms", "x baseline"],
            rows,
            note=f"readdir of {LISTING:,} entries: {res['readdir_10k_s'] * 1e3:.0f} ms "
            f"(median); shared 2-core machine",
        )
        if mem:
            print(
                f"memory: {mem['bytes_per_inode']:.0f} bytes/inode at {mem['inodes']:,} files "
                f"of one slice (snapshot {mem['snapshot_bytes'] / 2**20:.1f} MiB in "
                f"{mem['snapshot_s']:.1f} s, serialized in a forked child: the metanode "
                f"pauses {mem['snapshot_fork_pause_s'] * 1e3:.0f} ms for the fork)"
            )

    emit(result, args.json, show)
    return 0


if __name__ == "__main__":
    sys.exit(main())
