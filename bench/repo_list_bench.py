"""Lazy listing of a linked bucket: how long reading every directory takes, and what it costs the leader.

    python -m bench.repo_list_bench [--objects 20000] [--prefixes 100] [--readers 8]
                                    [--py-spy FILE] [--json]

A real SeaweedFS S3 gateway and three real metanode processes on loopback.
The bucket holds ``--objects`` objects spread over ``--prefixes``
prefixes, linked ``--import lazy``; then ``--readers`` tasks at once look
up and read each prefix's directory (each first read lists that prefix
on the leader, page by page). Reported: the wall time of the reads, the
leader's CPU seconds over them (from /proc: less noisy than wall time on
a shared machine) and the CPU of its listing worker processes, and the
wall time of the first read of the link's own directory. ``--py-spy``
records the leader during the reads (py-spy must be installed).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from bench.common import create_volume_once_elected, emit, print_table
from bench.repo_bench import put_objects
from cachefs import commands as C
from cachefs import queries as Q
from cachefs.testing.metacluster import MetaCluster
from cachefs.testing.s3server import SeaweedS3, credentials_env

BUCKET = "lazy"
VOLUME = "bench"


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User + system CPU of ``pid`` itself, and of its children (listing workers), live or reaped."""
    own = children = 0.0
    for p in [pid, *_children(pid)]:
        try:
            fields = [int(f) for f in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[11:15]]
        except OSError:
            continue
        tick = os.sysconf("SC_CLK_TCK")
        if p == pid:
            own += (fields[0] + fields[1]) / tick
            children += (fields[2] + fields[3]) / tick
        else:
            children += sum(fields) / tick
    return own, children


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


async def read_all(cluster: MetaCluster, endpoint: str, args: argparse.Namespace) -> dict[str, Any]:
    from cachefs.metanode.client import MetaClient
    from cachefs.rpc import RpcPool

    async with RpcPool(secret=None) as pool:
        mc = MetaClient(pool, cluster.addrs, deadline=600.0)
        await create_volume_once_elected(mc, VOLUME)
        leader = cluster.procs[await cluster.wait_leader(pool)].pid
        d = await mc.mutate(C.Mkdir(VOLUME, 1, b"lazy", 0o755, 0, 0))
        await mc.mutate(C.LinkRepo(VOLUME, d.ino, BUCKET, "", endpoint, "", "lazy"))
        spy = None
        if args.py_spy:
            form = "speedscope" if args.py_spy.endswith(".json") else "flamegraph"
            spy = subprocess.Popen(["py-spy", "record", "-p", str(leader), "-o", args.py_spy, "-r", "50",  # noqa: ASYNC220
                                    "--subprocesses", "--idle", "-f", form])
            await trio.sleep(1.0)
        cpu0 = cpu_seconds(leader)
        started = time.perf_counter()
        top = await mc.query(Q.ReadDir(VOLUME, d.ino, 0, 1000))
        first_s = time.perf_counter() - started
        names = [e.name for e in top]
        seen = 0
        limiter = trio.CapacityLimiter(args.readers)

        async def read(name: bytes) -> None:
            nonlocal seen
            async with limiter:
                attr = await mc.query(Q.Lookup(VOLUME, d.ino, name))
                cookie = 0
                while True:
                    entries = await mc.query(Q.ReadDir(VOLUME, attr.ino, cookie, 1000))
                    if not entries:
                        break
                    seen += len(entries)
                    cookie = entries[-1].cookie

        async with trio.open_nursery() as nursery:
            for name in names:
                nursery.start_soon(read, name)
        wall = time.perf_counter() - started
        cpu = cpu_seconds(leader)
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on an interrupt
            spy.wait()
        assert seen == args.objects, f"read {seen} entries of {args.objects}"
        return {"objects": args.objects, "prefixes": len(names), "readers": args.readers,
                "first_readdir_s": round(first_s, 3), "read_all_s": round(wall, 2),
                "leader_cpu_s": round(cpu[0] - cpu0[0], 2), "workers_cpu_s": round(cpu[1] - cpu0[1], 2),
                "objects_per_s": round(args.objects / wall)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=20_000)
    parser.add_argument("--prefixes", type=int, default=100)
    parser.add_argument("--readers", type=int, default=8, help="directories read at once")
    parser.add_argument("--py-spy", default="", help="record the leader to this file (.svg or .json)")
    parser.add_argument("--weed-dir", default="", help="keep SeaweedFS's data here: a later run with the same "
                        "--objects and --prefixes reuses the bucket instead of filling it again")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    os.environ.update(credentials_env())  # the metanodes list the bucket with it
    with tempfile.TemporaryDirectory(prefix="repo-list-bench-") as tmp:
        root = Path(tmp)
        weed_dir = Path(args.weed_dir) if args.weed_dir else root / "weed"
        filled = weed_dir / f"filled-{args.objects}-{args.prefixes}"
        weed = SeaweedS3(weed_dir)
        weed.start()
        cluster = MetaCluster(root, 3)
        try:
            import boto3

            started = time.perf_counter()
            if not filled.exists():
                boto3.client("s3", endpoint_url=weed.endpoint).create_bucket(Bucket=BUCKET)
                keys = ((f"p{i % args.prefixes:03d}/o{i:07d}", b"x") for i in range(args.objects))
                put_objects(weed.endpoint, keys, bucket=BUCKET)
                filled.touch()
            put_s = time.perf_counter() - started
            cluster.start_all()
            result = trio.run(read_all, cluster, weed.endpoint, args)
            result["put_s"] = round(put_s, 1)
        finally:
            cluster.stop_all()
            weed.stop()
    emit(result, args.json, lambda: print_table(
        "lazy listing: every directory of a linked bucket read", ["measure", "value"],
        [[k, v] for k, v in result.items()]))


if __name__ == "__main__":
    main()
