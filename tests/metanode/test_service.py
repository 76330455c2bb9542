"""The metanode service over a real (single-replica) RaftNode and real RPC, in-process."""

from __future__ import annotations

import errno
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from cachefs.errors import CacheFSError
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
        await mc.create_volume(VOL, "replica:1")
        yield Single(state, service, mc)
        node.close()
        await server.shutdown(grace=0.5)
        nursery.cancel_scope.cancel()


async def test_silent_sessions_expire_and_free_their_unlinked_files(meta: Single) -> None:
    mc = meta.mc
    quiet_client = meta.client(heartbeat_interval=30.0)
    alive_client = meta.client(heartbeat_interval=0.1)
    quiet = (await quiet_client.mount_volume(VOL))["session"]
    alive = (await alive_client.mount_volume(VOL))["session"]
    f = await mc.mknod(VOL, 1, b"f", 0o100644)
    g = await mc.mknod(VOL, 1, b"g", 0o100644)
    sid = await mc.alloc_slices(2)
    await mc.write_slice(VOL, f["ino"], 0, sid, 0, 10, 0, time.time_ns())
    await mc.write_slice(VOL, g["ino"], 0, sid + 1, 0, 10, 0, time.time_ns())
    await mc.open(VOL, f["ino"], quiet)
    await mc.open(VOL, g["ino"], alive)
    await mc.unlink(VOL, 1, b"f")
    await mc.unlink(VOL, 1, b"g")
    assert (await mc.getattr(VOL, f["ino"]))["nlink"] == 0
    await trio.sleep(1.5)  # the quiet session misses its 0.6 s deadline; the other beats
    assert await mc.session_heartbeat(alive)
    with pytest.raises(CacheFSError) as info:
        await mc.getattr(VOL, f["ino"])
    assert info.value.errno == errno.ENOENT
    assert not await mc.session_heartbeat(quiet)
    assert (await mc.getattr(VOL, g["ino"]))["size"] == 10
    assert [r[0] for r in await mc.list_trash(VOL)] == [sid]
    await alive_client.close_session(VOL, alive)
    quiet_client.close()
    assert [r[0] for r in await mc.list_trash(VOL)] == [sid, sid + 1]
    assert await mc.purge_trash(VOL, [sid, sid + 1]) == 2
    assert await mc.list_trash(VOL) == []
    check(meta.state)


async def test_node_heartbeats_are_soft_state(meta: Single) -> None:
    mc = meta.mc
    applied = meta.state.applied_index
    for i in range(3):
        await mc.register_node("datanode", f"dn{i}", f"127.0.0.1:{9000 + i}", f"z{i}", 1 << 30)
    await mc.register_node("cachenode", "c0", "127.0.0.1:9100", "z0", 1 << 30)
    assert meta.state.applied_index == applied + 4
    applied = meta.state.applied_index
    for _ in range(10):
        await mc.node_heartbeat("datanode", "dn0", 12345)
    assert meta.state.applied_index == applied  # no log entry per beat
    cmap = await mc.cluster_map()
    dn0 = next(n for n in cmap["datanodes"] if n["id"] == "dn0")
    assert dn0["used"] == 12345 and dn0["state"] == "up"
    assert len(cmap["pgs"][VOL]) == 64 and all(len(pg) == 1 for pg in cmap["pgs"][VOL])
    for _ in range(12):  # dn0 keeps beating; the others fall silent
        await mc.node_heartbeat("datanode", "dn0", 1)
        await trio.sleep(0.1)
    states = {n["id"]: n["state"] for n in (await mc.cluster_map())["datanodes"]}
    assert states == {"dn0": "up", "dn1": "down", "dn2": "down"}
    with pytest.raises(CacheFSError) as info:
        await mc.node_heartbeat("datanode", "nobody", 1)
    assert info.value.errno == errno.ENOENT
    await mc.remove_node("datanode", "dn2")
    assert {n["id"] for n in (await mc.cluster_map())["datanodes"]} == {"dn0", "dn1"}


async def test_rpc_surface(meta: Single) -> None:
    mc = meta.mc
    d = await mc.mkdir(VOL, 1, b"d", 0o755)
    await mc.set_quota(VOL, d["ino"], max_inodes=2)
    await mc.mknod(VOL, d["ino"], b"a", 0o100644)
    s = await mc.symlink(VOL, d["ino"], b"s", b"a")
    assert await mc.readlink(VOL, s["ino"]) == b"a"
    with pytest.raises(CacheFSError) as info:
        await mc.mknod(VOL, d["ino"], b"b", 0o100644)
    assert info.value.errno == errno.EDQUOT
    assert (await mc.get_usage(VOL, d["ino"]))["inodes"] == 2
    a = await mc.lookup(VOL, d["ino"], b"a")
    await mc.link(VOL, a["ino"], 1, b"a-link")
    await mc.rename(VOL, 1, b"a-link", 1, b"renamed")
    await mc.setxattr(VOL, a["ino"], b"user.x", b"1")
    assert await mc.listxattr(VOL, a["ino"]) == [b"user.x"]
    assert await mc.getxattr(VOL, a["ino"], b"user.x") == b"1"
    await mc.removexattr(VOL, a["ino"], b"user.x")
    attr = await mc.setattr(VOL, a["ino"], mode=0o600, size=5)
    assert attr["size"] == 5 and attr["mode"] & 0o777 == 0o600
    sid = await mc.alloc_slices(3)
    await mc.write_slice(VOL, a["ino"], 0, sid, 0, 10, 0, 1)
    await mc.write_slice(VOL, a["ino"], 0, sid + 1, 5, 10, 0, 2)
    assert await mc.read_chunk(VOL, a["ino"], 0) == [[sid, 0, 10, 0], [sid + 1, 5, 10, 0]]
    await mc.compact_chunk(VOL, a["ino"], 0, [sid, sid + 1], sid + 2, 15)
    assert await mc.read_chunk(VOL, a["ino"], 0) == [[sid + 2, 0, 15, 0]]
    names = [e[0] for e in await mc.readdir(VOL, 1, 0, 100)]
    assert names == [b"d", b"renamed"]
    st = await mc.statfs(VOL)
    assert st["used_inodes"] == 4 and st["namemax"] == 255
    vols = await mc.list_volumes()
    assert vols[VOL]["policy"] == "replica:1" and vols[VOL]["used_inodes"] == 4
    await mc.unlink(VOL, d["ino"], b"s")
    await mc.unlink(VOL, d["ino"], b"a")
    await mc.unlink(VOL, 1, b"renamed")
    await mc.rmdir(VOL, 1, b"d")
    with pytest.raises(CacheFSError) as info:
        await mc.rmdir(VOL, 1, b"d")
    assert info.value.errno == errno.ENOENT
    with pytest.raises(CacheFSError) as info:
        await mc.create_volume("bad name", "replica:1")
    assert info.value.errno == errno.EINVAL
    check(meta.state)


async def test_open_and_release_add_no_log_entries(meta: Single) -> None:
    """Soft state on the leader: no log entry, no WAL fsync; an unlink of an
    open file keeps it, and the last release purges it (one entry)."""
    mc = meta.mc
    session = (await mc.mount_volume(VOL))["session"]
    inos = [(await mc.mknod(VOL, 1, b"f%d" % i, 0o100644))["ino"] for i in range(20)]
    node = meta.service.node
    assert node is not None
    applied, syncs = meta.state.applied_index, node.storage.syncs
    for ino in inos:
        assert (await mc.open(VOL, ino, session))["ino"] == ino
        await mc.release(VOL, ino, session)
    await mc.open(VOL, inos[0], session)
    await mc.open(VOL, inos[0], session)  # a retry counts once
    assert meta.state.applied_index == applied
    assert node.storage.syncs == syncs
    await mc.unlink(VOL, 1, b"f0")
    assert (await mc.getattr(VOL, inos[0]))["nlink"] == 0
    assert meta.state.volumes[VOL].orphans == {inos[0]}
    await trio.sleep(0.3)  # housekeeping must not purge what is open
    assert (await mc.getattr(VOL, inos[0]))["nlink"] == 0
    await mc.unlink(VOL, 1, b"f1")  # not open: freed at once, no orphan
    assert meta.state.volumes[VOL].orphans == {inos[0]}
    await mc.release(VOL, inos[0], session)
    with trio.fail_after(5):
        while meta.state.volumes[VOL].orphans:
            await trio.sleep(0.02)
    with pytest.raises(CacheFSError) as info:
        await mc.open(VOL, inos[0], session)
    assert info.value.errno == errno.ENOENT
    check(meta.state)


async def test_a_new_leader_keeps_unlinked_files_until_sessions_announce(meta: Single) -> None:
    """After a change of term the leader knows no opens: drops are kept until
    every session of the volume announced its open set with a heartbeat."""
    mc = meta.mc
    session = (await mc.mount_volume(VOL))["session"]
    f = (await mc.mknod(VOL, 1, b"f", 0o100644))["ino"]
    g = (await mc.mknod(VOL, 1, b"g", 0o100644))["ino"]
    await mc.open(VOL, f, session)
    meta.service.opens.reset()  # what a new term does
    await mc.unlink(VOL, 1, b"f")
    await mc.unlink(VOL, 1, b"g")  # not open, but the leader cannot know yet
    await trio.sleep(0.3)
    assert meta.state.volumes[VOL].orphans == {f, g}
    assert await mc.call("session_heartbeat", {"session": session, "opens": [f]})
    with trio.fail_after(5):
        while meta.state.volumes[VOL].orphans != {f}:
            await trio.sleep(0.02)
    await mc.close_session(VOL, session)  # unmount frees what it held
    assert meta.state.volumes[VOL].orphans == set()
    check(meta.state)
