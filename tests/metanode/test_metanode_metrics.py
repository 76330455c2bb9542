"""A real ``cachefs metanode`` on its own disk serves what issue 18 lists for it:
Raft role, term, commit and applied index, WAL fsync latency, proposals
batched per append, inodes, dentries, metadata bytes on disk (snapshot and
WAL), sessions and leases, as a scrape shows them."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.metanode.client import MetaClient
from cachefs.rpc import RpcPool
from cachefs.testing.metacluster import MetaCluster
from cachefs.testing.ports import free_port

DIRS = 120  # past --snapshot-entries 100: a snapshot is on disk
WRITERS = 12  # concurrent proposals, so that appends batch them
SNAPSHOT_WAIT = 30.0  # seconds for the snapshot child to finish (a loaded CI machine)


def _samples(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^(cachefs_\S+) (\S+)$", text, re.M)}


async def test_a_metanode_on_disk_serves_its_raft_and_namespace_series(tmp_path: Path) -> None:
    port = free_port()
    cluster = MetaCluster(tmp_path, 1, extra=["--metrics-addr", str(port), "--snapshot-entries", "100"])
    cluster.start_all()
    try:
        async with RpcPool(secret=None) as pool:
            await cluster.wait_leader(pool)
            before = _samples(port)
            meta = MetaClient(pool, cluster.addrs)
            await meta.mutate(C.CreateVolume("v", "replica:1"))
            names = iter(range(DIRS))

            async def writer() -> None:
                for i in names:
                    await meta.mutate(C.Mkdir("v", 1, b"d%d" % i, 0o755))

            async with trio.open_nursery() as nursery:
                for _ in range(WRITERS):
                    nursery.start_soon(writer)
            mount = await meta.mutate(C.MountVolume("v"))
            await meta.query(Q.LeaseLookup("v", 1, b"d0", mount.session))
            # The snapshot is written by a forked child while the node goes on:
            # it may land after the last mutation has returned.
            with trio.fail_after(SNAPSHOT_WAIT):
                while (after := _samples(port))['cachefs_metanode_metadata_bytes{part="snapshot"}'] == 0:
                    await trio.sleep(0.05)
    finally:
        cluster.stop_all()

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    node = '{node="1"}'
    assert grew(f"cachefs_raft_wal_sync_seconds_count{node}") >= 1
    assert grew(f"cachefs_raft_wal_sync_seconds_sum{node}") > 0
    proposals, appends = (grew(f"cachefs_raft_proposals_per_append_{s}{node}") for s in ("sum", "count"))
    # The volume, the dirs, the mount; with WRITERS at once, an append carries several.
    assert proposals >= DIRS + 2 and 1 <= appends < proposals
    assert after['cachefs_metanode_inodes{volume="v"}'] == DIRS + 1  # and the root
    assert after['cachefs_metanode_dentries{volume="v"}'] == DIRS
    assert after['cachefs_metanode_metadata_bytes{part="snapshot"}'] > 0
    assert after['cachefs_metanode_metadata_bytes{part="wal"}'] > 0
    assert after["cachefs_metanode_sessions"] == 1
    assert after['cachefs_metanode_leases{state="held"}'] == 2  # the root's entry d0, and d0
    assert grew('cachefs_metanode_lease_events_total{event="granted"}') == 2
    assert after[f"cachefs_raft_term{node}"] >= 1 and after['cachefs_raft_role{node="1",role="leader"}'] == 1
    assert after[f"cachefs_raft_commit_index{node}"] >= after[f"cachefs_raft_applied_index{node}"] >= DIRS + 2
