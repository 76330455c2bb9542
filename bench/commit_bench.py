"""Commit latency of one metadata mutation on a real 3-replica metanode cluster (fsync on).

One client creates files (``mknod``, a Raft commit each) in a loop, one at a
time, against the leader, for ``--seconds``; the client-observed latency
(p50/p90/p99) is set beside what the leader's own metrics say about the same
window: proposal to commit and to apply (``cachefs_raft_propose_*_seconds``)
and its WAL write + fsync (``cachefs_raft_wal_sync_seconds``). ``--rtt`` runs
the replicas behind the benchmarks' WAN relay (``bench/wan.py``): every
replica-to-replica call (and the client's) crosses a link of that round-trip
time. ``--py-spy DIR`` also samples the leader with py-spy for the window and
prints where its CPU went (own time per function).

    python -m bench.commit_bench [--json] [--seconds 5] [--rtt 0 --rtt 2] [--py-spy DIR]
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import trio

from bench.common import create_volume_once_elected, emit, print_table
from bench.wan import LinkProfile, Relay
from cachefs import commands as C
from cachefs.testing.metacluster import MetaCluster
from cachefs.testing.ports import free_ports

VOL = "bench"
HISTOGRAMS = {
    "commit": "cachefs_raft_propose_commit_seconds",
    "apply": "cachefs_raft_propose_apply_seconds",
    "fsync": "cachefs_raft_wal_sync_seconds",
}


def _scrape(port: int) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram in ``HISTOGRAMS`` on one replica."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for key, name in HISTOGRAMS.items():
        total = count = 0.0
        for line in text.splitlines():
            if line.startswith(f"{name}_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith(f"{name}_count"):
                count += float(line.rsplit(" ", 1)[1])
        out[key] = (total, count)
    return out


def _py_spy() -> str:
    """py-spy from this venv (``pip install py-spy``), else from PATH."""
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.exists() else shutil.which("py-spy") or "py-spy"


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# Leaf frames where a thread waits rather than works (py-spy --nonblocking
# cannot always tell): left out of the shares.
_IDLE = ("EpollIOManager.get_events", "_PollLikeSelector.select", "WorkerThread._work",
         "wait_task_rescheduled", "_WalWriter._work")  # (the last: waiting for a job)


def _hot(raw: Path, top: int = 15) -> list[tuple[str, float]]:
    """Own time per function from py-spy's collapsed stacks, as a share of
    the busy samples (waits left out); first the share of samples that were
    busy at all, as ``(busy)``."""
    own: collections.Counter[str] = collections.Counter()
    total = busy = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        leaf = stack.rsplit(";", 1)[-1]
        total += int(n)
        if not leaf.startswith(_IDLE):
            own[leaf] += int(n)
            busy += int(n)
    if not busy:
        return []
    return [("(busy)", busy / total)] + [(f, n / busy) for f, n in own.most_common(top)]


async def _loop(addr: str, seconds: float) -> list[float]:
    from cachefs.metanode.client import MetaClient
    from cachefs.rpc import RpcPool

    async with RpcPool(secret=None) as pool:
        mc = MetaClient(pool, [addr], deadline=60.0)
        await create_volume_once_elected(mc, VOL)
        d = (await mc.mutate(C.Mkdir(VOL, 1, b"d", 0o755))).ino
        for k in range(200):  # warm up: connections, the leader's first snapshot of nothing
            await mc.mutate(C.Mknod(VOL, d, b"w%d" % k, 0o100644))
        lat = []
        deadline = time.perf_counter() + seconds
        k = 0
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            await mc.mutate(C.Mknod(VOL, d, b"f%d" % k, 0o100644))
            lat.append(time.perf_counter() - t)
            k += 1
        return lat


def run_case(rtt_ms: float, seconds: float, spy: Path | None) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="commit-bench-"))
    relay = None
    try:
        metrics = free_ports(3)
        node_extra = {i: ["--metrics-addr", f"127.0.0.1:{p}"] for i, p in enumerate(metrics)}
        if rtt_ms:
            relay_ports = free_ports(3)
            cluster = MetaCluster(root, 3, peer_addrs=[f"127.0.0.1:{p}" for p in relay_ports],
                                  node_extra=node_extra)
            relay = Relay(root, dict(zip(relay_ports, cluster.addrs, strict=True)),
                          LinkProfile(f"rtt{rtt_ms:g}ms", rtt_ms, 1000.0))
            relay.start()
        else:
            cluster = MetaCluster(root, 3, node_extra=node_extra)
        cluster.start_all()
        try:
            async def leader() -> int:
                from cachefs.rpc import RpcPool

                async with RpcPool(secret=None) as pool:
                    return await cluster.wait_leader(pool, timeout=60)

            lead = trio.run(leader)
            before = _scrape(metrics[lead])
            spy_proc = None
            if spy is not None:
                spy.mkdir(parents=True, exist_ok=True)
                raw = spy / f"leader-rtt{rtt_ms:g}.txt"
                spy_proc = subprocess.Popen(
                    [_py_spy(), "record", "-p", str(cluster.procs[lead].pid),
                     "-d", str(int(seconds) + 2), "-r", "200", "-f", "raw", "-o", str(raw), "--nonblocking"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            lat = trio.run(_loop, cluster.addrs[lead], seconds)
            after = _scrape(metrics[lead])
            if spy_proc is not None:
                spy_proc.wait(timeout=60)
        finally:
            cluster.stop_all()
        res: dict[str, Any] = {
            "rtt_ms": rtt_ms, "ops": len(lat), "per_s": len(lat) / seconds,
            "p50_ms": 1e3 * _pct(lat, 0.5), "p90_ms": 1e3 * _pct(lat, 0.9),
            "p99_ms": 1e3 * _pct(lat, 0.99), "mean_ms": 1e3 * sum(lat) / len(lat),
        }
        for key in HISTOGRAMS:
            total = after[key][0] - before[key][0]
            count = after[key][1] - before[key][1]
            res[f"leader_{key}_mean_ms"] = 1e3 * total / count if count else float("nan")
        if spy is not None:
            res["leader_hot"] = _hot(spy / f"leader-rtt{rtt_ms:g}.txt")
        return res
    finally:
        if relay is not None:
            relay.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rtt", type=float, action="append",
                    help="replica link round-trip times in ms (default: 0 and 2)")
    ap.add_argument("--py-spy", type=Path, default=None, metavar="DIR")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cases = [run_case(rtt, args.seconds, args.py_spy) for rtt in (args.rtt or [0.0, 2.0])]
    cols = ["rtt_ms", "per_s", "p50_ms", "p90_ms", "p99_ms", "mean_ms", "leader_commit_mean_ms",
            "leader_apply_mean_ms", "leader_fsync_mean_ms"]

    def show() -> None:
        print_table("one client, one mknod at a time (3 metanodes, fsync on)", cols,
                    [[c[k] for k in cols] for c in cases])
        for c in cases:
            for fn, share in c.get("leader_hot", []):
                print(f"  rtt {c['rtt_ms']:g} ms, leader own time {100 * share:5.1f}%  {fn}")

    emit({"cases": cases}, args.json, show)


if __name__ == "__main__":
    main()
