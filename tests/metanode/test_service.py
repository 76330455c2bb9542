"""The metanode service over a real (single-replica) RaftNode and real RPC, in-process."""

from __future__ import annotations

import errno
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.errors import CacheFSError
from cachefs.layout import Slice
from cachefs.metanode.client import MetaClient
from cachefs.metanode.invariants import check
from cachefs.metanode.namespace import MetaState
from cachefs.metanode.raft.driver import RaftNode
from cachefs.metanode.service import MetaService
from cachefs.rpc import RpcPool, RpcServer

VOL = "v"


class Single:
    def __init__(self, state: MetaState, service: MetaService, mc: MetaClient) -> None:
        self.state = state
        self.service = service
        self.mc = mc

    def client(self, **kw: float) -> MetaClient:
        return MetaClient(self.mc.pool, self.mc.addrs, **kw)


@pytest.fixture
async def meta(tmp_path: Path, nursery: trio.Nursery) -> AsyncIterator[Single]:
    state = MetaState()
    service = MetaService(state, session_timeout=0.6, node_timeout=0.6)
    server = RpcServer(service, name="metanode", secret=None)
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    addr = f"127.0.0.1:{port}"
    async with RpcPool(secret=None) as pool:
        node = await RaftNode.create(
            1, {1: addr}, tmp_path, state, pool, nursery=nursery, server=server
        )
        service.node = node
        await nursery.start(service.run_housekeeping, 0.1)
        mc = MetaClient(pool, [addr], deadline=10.0)
        with trio.fail_after(10):
            while not node.is_leader:
                await trio.sleep(0.05)
        await mc.mutate(C.CreateVolume(VOL, "replica:1"))
        yield Single(state, service, mc)
        node.close()
        await server.shutdown(grace=0.5)
        nursery.cancel_scope.cancel()


async def test_silent_sessions_expire_and_free_their_unlinked_files(meta: Single) -> None:
    mc = meta.mc
    quiet_client = meta.client(heartbeat_interval=30.0)
    alive_client = meta.client(heartbeat_interval=0.1)
    quiet = (await quiet_client.mount_volume(VOL)).session
    alive = (await alive_client.mount_volume(VOL)).session
    f = await mc.mutate(C.Mknod(VOL, 1, b"f", 0o100644))
    g = await mc.mutate(C.Mknod(VOL, 1, b"g", 0o100644))
    sid = await mc.mutate(C.AllocSlices(2))
    await mc.mutate(C.WriteSlice(VOL, f.ino, 0, sid, 0, 10, 0, time.time_ns()))
    await mc.mutate(C.WriteSlice(VOL, g.ino, 0, sid + 1, 0, 10, 0, time.time_ns()))
    await mc.query(Q.Open(VOL, f.ino, quiet))
    await mc.query(Q.Open(VOL, g.ino, alive))
    await mc.mutate(C.Unlink(VOL, 1, b"f"))
    await mc.mutate(C.Unlink(VOL, 1, b"g"))
    assert (await mc.query(Q.GetAttr(VOL, f.ino))).nlink == 0
    await trio.sleep(1.5)  # the quiet session misses its 0.6 s deadline; the other beats
    assert await mc.query(Q.SessionHeartbeat(alive))
    with pytest.raises(CacheFSError) as info:
        await mc.query(Q.GetAttr(VOL, f.ino))
    assert info.value.errno == errno.ENOENT
    assert not await mc.query(Q.SessionHeartbeat(quiet))
    assert (await mc.query(Q.GetAttr(VOL, g.ino))).size == 10
    assert [r[0] for r in await mc.query(Q.ListTrash(VOL))] == [sid]
    await alive_client.close_session(alive)
    quiet_client.close()
    assert [r[0] for r in await mc.query(Q.ListTrash(VOL))] == [sid, sid + 1]
    assert await mc.mutate(C.PurgeTrash(VOL, [sid, sid + 1])) == 2
    assert await mc.query(Q.ListTrash(VOL)) == []
    check(meta.state)


async def test_node_heartbeats_are_soft_state(meta: Single) -> None:
    mc = meta.mc
    applied = meta.state.applied_index
    for i in range(3):
        await mc.mutate(C.RegisterNode("datanode", f"dn{i}", f"127.0.0.1:{9000 + i}", f"z{i}", 1 << 30))
    await mc.mutate(C.RegisterNode("cachenode", "c0", "127.0.0.1:9100", "z0", 1 << 30))
    assert meta.state.applied_index == applied + 4
    applied = meta.state.applied_index
    for _ in range(10):
        await mc.query(Q.NodeHeartbeat("datanode", "dn0", 12345))
    assert meta.state.applied_index == applied  # no log entry per beat
    cmap = await mc.query(Q.ClusterMap())
    dn0 = next(n for n in cmap["datanodes"] if n["id"] == "dn0")
    assert dn0["used"] == 12345 and dn0["state"] == "up"
    assert len(cmap["pgs"][VOL]) == 64 and all(len(pg) == 1 for pg in cmap["pgs"][VOL])
    for _ in range(12):  # dn0 keeps beating; the others fall silent
        await mc.query(Q.NodeHeartbeat("datanode", "dn0", 1))
        await trio.sleep(0.1)
    states = {n["id"]: n["state"] for n in (await mc.query(Q.ClusterMap()))["datanodes"]}
    assert states == {"dn0": "up", "dn1": "down", "dn2": "down"}
    with pytest.raises(CacheFSError) as info:
        await mc.query(Q.NodeHeartbeat("datanode", "nobody", 1))
    assert info.value.errno == errno.ENOENT
    await mc.mutate(C.RemoveNode("datanode", "dn2"))
    assert {n["id"] for n in (await mc.query(Q.ClusterMap()))["datanodes"]} == {"dn0", "dn1"}


async def test_rpc_surface(meta: Single) -> None:
    mc = meta.mc
    d = await mc.mutate(C.Mkdir(VOL, 1, b"d", 0o755))
    await mc.mutate(C.SetQuota(VOL, d.ino, max_inodes=2))
    await mc.mutate(C.Mknod(VOL, d.ino, b"a", 0o100644))
    s = await mc.mutate(C.Symlink(VOL, d.ino, b"s", b"a"))
    assert await mc.query(Q.ReadLink(VOL, s.ino)) == b"a"
    with pytest.raises(CacheFSError) as info:
        await mc.mutate(C.Mknod(VOL, d.ino, b"b", 0o100644))
    assert info.value.errno == errno.EDQUOT
    assert (await mc.query(Q.GetUsage(VOL, d.ino))).inodes == 2
    a = await mc.query(Q.Lookup(VOL, d.ino, b"a"))
    await mc.mutate(C.Link(VOL, a.ino, 1, b"a-link"))
    await mc.mutate(C.Rename(VOL, 1, b"a-link", 1, b"renamed"))
    await mc.mutate(C.SetXattr(VOL, a.ino, b"user.x", b"1"))
    assert await mc.query(Q.ListXattr(VOL, a.ino)) == [b"user.x"]
    assert await mc.query(Q.GetXattr(VOL, a.ino, b"user.x")) == b"1"
    await mc.mutate(C.RemoveXattr(VOL, a.ino, b"user.x"))
    attr = await mc.mutate(C.SetAttr(VOL, a.ino, mode=0o600, size=5))
    assert attr.size == 5 and attr.mode & 0o777 == 0o600
    sid = await mc.mutate(C.AllocSlices(3))
    await mc.mutate(C.WriteSlice(VOL, a.ino, 0, sid, 0, 10, 0, 1))
    await mc.mutate(C.WriteSlice(VOL, a.ino, 0, sid + 1, 5, 10, 0, 2))
    assert await mc.query(Q.ReadChunk(VOL, a.ino, 0)) == [Slice(sid, 0, 10, 0), Slice(sid + 1, 5, 10, 0)]
    await mc.mutate(C.CompactChunk(VOL, a.ino, 0, [sid, 0, 10, 0, sid + 1, 5, 10, 0], sid + 2, 15))
    assert await mc.query(Q.ReadChunk(VOL, a.ino, 0)) == [Slice(sid + 2, 0, 15, 0)]
    names = [e[0] for e in await mc.query(Q.ReadDir(VOL, 1, 0, 100))]
    assert names == [b"d", b"renamed"]
    st = await mc.query(Q.StatFs(VOL))
    assert st.used_inodes == 4 and st.namemax == 255
    vols = await mc.query(Q.ListVolumes())
    assert vols[VOL]["policy"] == "replica:1" and vols[VOL]["used_inodes"] == 4
    await mc.mutate(C.Unlink(VOL, d.ino, b"s"))
    await mc.mutate(C.Unlink(VOL, d.ino, b"a"))
    await mc.mutate(C.Unlink(VOL, 1, b"renamed"))
    await mc.mutate(C.Rmdir(VOL, 1, b"d"))
    with pytest.raises(CacheFSError) as info:
        await mc.mutate(C.Rmdir(VOL, 1, b"d"))
    assert info.value.errno == errno.ENOENT
    with pytest.raises(CacheFSError) as info:
        await mc.mutate(C.CreateVolume("bad name", "replica:1"))
    assert info.value.errno == errno.EINVAL
    check(meta.state)


async def test_open_and_release_add_no_log_entries(meta: Single) -> None:
    """Soft state on the leader: no log entry, no WAL fsync; an unlink of an
    open file keeps it, and the last release purges it (one entry)."""
    mc = meta.mc
    session = (await mc.mount_volume(VOL)).session
    inos = [(await mc.mutate(C.Mknod(VOL, 1, b"f%d" % i, 0o100644))).ino for i in range(20)]
    node = meta.service.node
    assert node is not None
    applied, syncs = meta.state.applied_index, node.storage.syncs
    for ino in inos:
        assert (await mc.query(Q.Open(VOL, ino, session))).ino == ino
        await mc.query(Q.Release(VOL, ino, session))
    await mc.query(Q.Open(VOL, inos[0], session))
    await mc.query(Q.Open(VOL, inos[0], session))  # a retry counts once
    assert meta.state.applied_index == applied
    assert node.storage.syncs == syncs
    await mc.mutate(C.Unlink(VOL, 1, b"f0"))
    assert (await mc.query(Q.GetAttr(VOL, inos[0]))).nlink == 0
    assert meta.state.volumes[VOL].orphans == {inos[0]}
    await trio.sleep(0.3)  # housekeeping must not purge what is open
    assert (await mc.query(Q.GetAttr(VOL, inos[0]))).nlink == 0
    await mc.mutate(C.Unlink(VOL, 1, b"f1"))  # not open: freed at once, no orphan
    assert meta.state.volumes[VOL].orphans == {inos[0]}
    await mc.query(Q.Release(VOL, inos[0], session))
    with trio.fail_after(5):
        while meta.state.volumes[VOL].orphans:
            await trio.sleep(0.02)
    with pytest.raises(CacheFSError) as info:
        await mc.query(Q.Open(VOL, inos[0], session))
    assert info.value.errno == errno.ENOENT
    check(meta.state)


async def test_a_new_leader_keeps_unlinked_files_until_sessions_announce(meta: Single) -> None:
    """After a change of term the leader knows no opens: drops are kept until
    every session of the volume announced its open set with a heartbeat."""
    mc = meta.mc
    session = (await mc.mount_volume(VOL)).session
    f = (await mc.mutate(C.Mknod(VOL, 1, b"f", 0o100644))).ino
    g = (await mc.mutate(C.Mknod(VOL, 1, b"g", 0o100644))).ino
    await mc.query(Q.Open(VOL, f, session))
    meta.service.opens.reset()  # what a new term does
    await mc.mutate(C.Unlink(VOL, 1, b"f"))
    await mc.mutate(C.Unlink(VOL, 1, b"g"))  # not open, but the leader cannot know yet
    await trio.sleep(0.3)
    assert meta.state.volumes[VOL].orphans == {f, g}
    assert await mc.query(Q.SessionHeartbeat(session, (f,)))
    with trio.fail_after(5):
        while meta.state.volumes[VOL].orphans != {f}:
            await trio.sleep(0.02)
    await mc.close_session(session)  # unmount frees what it held
    assert meta.state.volumes[VOL].orphans == set()
    check(meta.state)
