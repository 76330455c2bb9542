"""Importing a linked bucket's listing: lazily as directories are read, or in full at link time.

    python -m bench.repo_list_bench [--objects 20000] [--prefixes 100] [--readers 8]
                                    [--import lazy|full] [--weed-dir DIR] [--py-spy FILE] [--json]

A real SeaweedFS S3 gateway and three real metanode processes on loopback.
The bucket holds ``--objects`` objects spread over ``--prefixes``
prefixes, linked ``--import lazy``; then ``--readers`` tasks at once look
up and read each prefix's directory (each first read lists that prefix
on the leader, page by page). Reported: the wall time of the reads, the
leader's CPU seconds over them (from /proc: less noisy than wall time on
a shared machine) and the CPU of its listing worker processes, and the
wall time of the first read of the link's own directory. ``--py-spy``
records the leader during the reads (py-spy must be installed).

``--import full``: instead, ``cachefs repo link --import full`` of the
bucket (the CLI process lists it and proposes a page at a time, as a user
runs it; its start-up included): ``import_s``, and ``repo_import_100k_s``
(bench.repo_bench's key) when ``--objects`` is 100,000; the CPU seconds of
the CLI, the leader, the followers and SeaweedFS over it (where the time
goes on a shared machine), and the leader's resident bytes per imported
object (the Raft log's copy of the pages included).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
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


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def import_full(cluster: MetaCluster, weed: SeaweedS3, args: argparse.Namespace) -> dict[str, Any]:
    """``cachefs repo link --import full`` of the whole bucket, timed."""
    from cachefs.metanode.client import MetaClient
    from cachefs.rpc import RpcPool

    async with RpcPool(secret=None) as pool:
        mc = MetaClient(pool, cluster.addrs, deadline=600.0)
        await create_volume_once_elected(mc, VOLUME)
        leader = cluster.procs[await cluster.wait_leader(pool)].pid
        followers = [p.pid for p in cluster.procs.values() if p.pid != leader]
        assert weed.proc is not None
        pids = {"leader": leader, "followers": followers, "weed": weed.proc.pid}
        before = {k: [cpu_seconds(p)[0] for p in (v if isinstance(v, list) else [v])] for k, v in pids.items()}
        rss0 = rss_bytes(leader)
        cli0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        proc = await trio.run_process(
            [sys.executable, "-m", "cachefs.cli", "repo", "link", VOLUME, "/full", f"s3://{BUCKET}/",
             "--endpoint", weed.endpoint, "--import", "full", "--json", "--insecure", "--meta", ",".join(cluster.addrs)],
            capture_stdout=True, capture_stderr=True, check=False,
        )  # fmt: skip
        wall = time.perf_counter() - started
        cli1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        assert proc.returncode == 0, proc.stderr.decode()[-2000:]
        imported = json.loads(proc.stdout)["import"]
        assert imported["created"] == args.objects, imported
        cpu = {k: round(sum(cpu_seconds(p)[0] for p in (v if isinstance(v, list) else [v])) - sum(before[k]), 2)
               for k, v in pids.items()}  # fmt: skip
        return {"objects": args.objects, "prefixes": args.prefixes, "import": "full", "import_s": round(wall, 2),
                "repo_import_100k_s": round(wall, 2) if args.objects == 100_000 else None,
                "cli_cpu_s": round(cli1.ru_utime + cli1.ru_stime - cli0.ru_utime - cli0.ru_stime, 2),
                **{f"{k}_cpu_s": v for k, v in cpu.items()},
                "leader_rss_per_object": round((rss_bytes(leader) - rss0) / args.objects)}  # fmt: skip


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
    parser.add_argument("--import", dest="import_mode", choices=["lazy", "full"], default="lazy",
                        help="lazy: read every directory of a lazy link; full: time `repo link --import full`")
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
            if args.import_mode == "full":
                result = trio.run(import_full, cluster, weed, args)
            else:
                result = trio.run(read_all, cluster, weed.endpoint, args)
            result["put_s"] = round(put_s, 1)
        finally:
            cluster.stop_all()
            weed.stop()
    emit(result, args.json, lambda: print_table(
        f"{args.import_mode} import of a linked bucket", ["measure", "value"],
        [[k, v] for k, v in result.items()]))


if __name__ == "__main__":
    main()
