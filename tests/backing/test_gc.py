"""The metanode leader collects garbage in the background (real processes).

Three ``cachefs metanode`` processes with a short ``--gc-grace``, one
``cachefs datanode``, and the client library writing, overwriting and
deleting files. After the grace the blocks of trashed slices are gone from
the datanode, while every block still referenced (and those of a file that
is unlinked but still open) is kept until nothing can read it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.backing.client import BackingClient
from cachefs.backing.cluster import MetaClusterView
from cachefs.backing.gc import GarbageCollector
from cachefs.client.api import FileSystem, connect
from cachefs.errors import SliceExpired
from cachefs.ids import BlockKey
from cachefs.metanode.client import MetaClient
from cachefs.rpc import RpcPool
from cachefs.testing.metacluster import MetaCluster
from cachefs.testing.ports import free_ports

VOL = "v"
BLOCK = 64 << 10
GRACE = 2.0


@pytest.fixture
def gc_cluster(tmp_path: Path, request: pytest.FixtureRequest):
    """Three metanodes that collect garbage every 0.3 s (after a grace of GRACE
    seconds, or the test's parameter), and one datanode (not the shared
    tests/backing datanodes)."""
    grace = getattr(request, "param", GRACE)
    c = MetaCluster(tmp_path, extra=["--gc-interval", "0.3", "--gc-grace", str(grace)])
    c.start_all()
    (dn_port,) = free_ports(1)
    dn_addr = f"127.0.0.1:{dn_port}"
    log = open(tmp_path / "dn.log", "ab")  # noqa: SIM115 - the child owns it
    dn = subprocess.Popen(
        [sys.executable, "-m", "cachefs.cli", "datanode", "--zone", "z1", "--data-dir",
         str(tmp_path / "dn"), "--capacity", "1G", "--listen", dn_addr, "--meta", ",".join(c.addrs),
         "--node-id", "dn1", "--heartbeat", "0.5", "--insecure", "--log-level", "info"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    log.close()
    try:
        yield c, dn_addr
    finally:
        dn.terminate()
        dn.wait(timeout=10)
        c.stop_all()
    for i in range(3):
        text = (tmp_path / f"meta{i}.log").read_text(errors="replace")
        assert "Traceback" not in text, text


async def _setup(cluster: MetaCluster) -> None:
    async with RpcPool(secret=None) as pool:
        await cluster.wait_leader(pool)
        mc = MetaClient(pool, cluster.addrs)
        await mc.mutate(C.CreateVolume(VOL, "replica:1", "none", BLOCK, 8))
        with trio.fail_after(120):  # a hang guard: under load the datanode can take 20 s and more to register
            while not (await mc.query(Q.ClusterMap()))["pgs"].get(VOL):
                await trio.sleep(0.1)


async def _stored(dn_addr: str) -> set[int]:
    """Slice ids with at least one block on the datanode."""
    async with RpcPool(secret=None) as pool:
        reply = await pool.call(dn_addr, "list", {"volume": VOL, "cursor": "", "limit": 100_000}, timeout=10)
        return {BlockKey.from_bytes(bytes(k)).slice_id for k, _i, _s in reply.result["shards"]}


async def _referenced(addrs: list[str], names: list[bytes]) -> set[int]:
    async with RpcPool(secret=None) as pool:
        mc = MetaClient(pool, addrs)
        out: set[int] = set()
        for name in names:
            ino = (await mc.query(Q.Lookup(VOL, 1, name))).ino
            out |= {s.id for s in await mc.query(Q.ReadChunk(VOL, ino, 0))}
        return out


async def _check(addrs: list[str], dn_addr: str) -> tuple[list[str], list[str]]:
    async with RpcPool(secret=None) as pool:
        mc = MetaClient(pool, addrs)
        view = MetaClusterView(mc)
        await view.refresh()
        report = await GarbageCollector(mc, BackingClient(pool, view)).check(VOL, [dn_addr])
        return report.missing, report.unreferenced


def _wait_stored(dn_addr: str, want: set[int], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := trio.run(_stored, dn_addr)) != want:
        assert time.monotonic() < deadline, f"stored slices {sorted(got)}, want {sorted(want)}"
        time.sleep(0.2)


def test_the_leader_deletes_trashed_blocks_after_the_grace(gc_cluster) -> None:
    c, dn_addr = gc_cluster
    trio.run(_setup, c)
    fs: FileSystem = connect(c.addrs, VOL, secret=None)
    try:
        for name, byte in ((b"a", b"a"), (b"b", b"b"), (b"c", b"c"), (b"d", b"d")):
            with fs.open("/" + name.decode(), "wb") as f:
                f.write(byte * (3 * BLOCK + 100))
        d_slices = trio.run(_referenced, c.addrs, [b"d"])
        old = trio.run(_referenced, c.addrs, [b"a", b"b", b"c"]) | d_slices
        assert trio.run(_stored, dn_addr) == old
        with fs.open("/a", "wb") as f:  # overwrite: a's first slice goes to the trash
            f.write(b"A" * (2 * BLOCK))
        fs.remove("/b")
        trashed_at = time.monotonic()
        held = fs.open("/d", "rb")  # open, then unlinked: must stay readable
        fs.remove("/d")
        keep = trio.run(_referenced, c.addrs, [b"a", b"c"])
        _wait_stored(dn_addr, keep | d_slices)
        assert time.monotonic() - trashed_at >= GRACE  # not one block before the grace
        assert held.read() == b"d" * (3 * BLOCK + 100)
        held.close()  # the orphan is purged, its slices trashed, then collected
        _wait_stored(dn_addr, keep)
        assert fs.open("/a", "rb").read() == b"A" * (2 * BLOCK)
        assert fs.open("/c", "rb").read() == b"c" * (3 * BLOCK + 100)
    finally:
        fs.close()
    assert trio.run(_check, c.addrs, dn_addr) == ([], [])


async def _upload_uncommitted(addrs: list[str]) -> int:
    """What a writer that dies before its commit leaves: two blocks of a slice nothing references."""
    async with RpcPool(secret=None) as pool:
        mc = MetaClient(pool, addrs)
        view = MetaClusterView(mc)
        await view.refresh()
        backing = BackingClient(pool, view)
        slice_id = await mc.mutate(C.AllocSlices(1))
        for index in range(2):
            await backing.put_block(VOL, BlockKey(slice_id, index), os.urandom(BLOCK))
        return slice_id


async def _late_commit(addrs: list[str], slice_id: int) -> None:
    async with RpcPool(secret=None) as pool:
        mc = MetaClient(pool, addrs)
        ino = (await mc.query(Q.Lookup(VOL, 1, b"keep"))).ino
        await mc.mutate(C.WriteSlice(VOL, ino, 1, slice_id, 0, 2 * BLOCK, 0, time.time_ns()))


LEAK_GRACE = 5.0


@pytest.mark.parametrize("gc_cluster", [LEAK_GRACE], indirect=True)
def test_blocks_never_committed_are_deleted_once_their_slice_is_sealed(gc_cluster) -> None:
    """Blocks of a slice whose writer died before the commit: `gc --check` reports
    them as unreferenced; a grace after the slice's allocation the leader seals it
    and deletes them (never before), a late commit of it is refused, a later leak
    goes the same way, and the committed file beside it is kept whole."""
    c, dn_addr = gc_cluster
    trio.run(_setup, c)
    with connect(c.addrs, VOL, secret=None) as fs:
        fs.write_bytes("/keep", b"k" * (3 * BLOCK))
        keep = trio.run(_referenced, c.addrs, [b"keep"])
        allocated = time.monotonic()
        dead = trio.run(_upload_uncommitted, c.addrs)
        assert trio.run(_stored, dn_addr) == keep | {dead}
        missing, unreferenced = trio.run(_check, c.addrs, dn_addr)
        assert time.monotonic() - allocated < LEAK_GRACE  # else the sweep may have run: retune
        assert missing == [] and unreferenced == sorted(BlockKey(dead, i).hex() for i in range(2))
        _wait_stored(dn_addr, keep, timeout=LEAK_GRACE + 30)
        assert time.monotonic() - allocated >= LEAK_GRACE  # not one block before the grace
        with pytest.raises(SliceExpired):
            trio.run(_late_commit, c.addrs, dead)
        again = trio.run(_upload_uncommitted, c.addrs)  # the next sweeps ask only about new slices
        assert trio.run(_stored, dn_addr) == keep | {again}
        _wait_stored(dn_addr, keep, timeout=LEAK_GRACE + 30)
        assert fs.read_bytes("/keep") == b"k" * (3 * BLOCK)
    assert trio.run(_check, c.addrs, dn_addr) == ([], [])
