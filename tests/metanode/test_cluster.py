"""Three real ``cachefs metanode`` processes: failover and full restart."""

from __future__ import annotations

import errno
import time
from pathlib import Path

import pytest
import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.errors import CacheFSError
from cachefs.layout import Slice
from cachefs.messages import Attr
from cachefs.metanode.client import MetaClient
from cachefs.rpc import RpcPool
from cachefs.testing.metacluster import MetaCluster

VOL = "v"


@pytest.fixture
def cluster(tmp_path: Path):
    # snapshots every 500 entries: the WAL is cut many times, and the replica
    # restarted after the kill may need an InstallSnapshot to catch up
    c = MetaCluster(tmp_path, extra=["--snapshot-entries", "500"])
    c.start_all()
    try:
        yield c
    finally:
        c.stop_all()


async def snapshot_view(mc: MetaClient) -> dict:
    """Everything a client can see: the tree with attributes, slices, statfs."""
    view: dict = {"statfs": await mc.query(Q.StatFs(VOL)), "map": await mc.query(Q.ClusterMap())}
    stack = [1]
    while stack:
        ino = stack.pop()
        cookie = 0
        while True:
            page = await mc.query(Q.ReadDir(VOL, ino, cookie, 500))
            if not page:
                break
            cookie = page[-1][2]
            for name, attr, _cookie in page:
                view[(ino, bytes(name))] = attr
                if attr.mode & 0o170000 == 0o040000:
                    stack.append(attr.ino)
                elif attr.size:
                    view[("slices", attr.ino)] = await mc.query(Q.ReadChunk(VOL, attr.ino, 0))
    return view


async def test_kill_leader_during_creates_then_restart_all(cluster: MetaCluster) -> None:
    async with RpcPool(secret=None) as pool:
        await cluster.wait_leader(pool)
        admin = MetaClient(pool, cluster.addrs)
        await admin.mutate(C.CreateVolume(VOL, "replica:3"))
        acked: dict[bytes, int] = {}
        gaps: list[float] = []
        stop = trio.Event()

        async def writer(w: int) -> None:
            mc = MetaClient(pool, cluster.addrs, deadline=20.0)
            d = (await mc.mutate(C.Mkdir(VOL, 1, b"w%d" % w, 0o755))).ino
            last = time.monotonic()
            i = 0
            while not stop.is_set() and i < 5000:
                name = b"f%05d" % i
                attr = await mc.mutate(C.Mknod(VOL, d, name, 0o100644))
                sid = await mc.mutate(C.AllocSlices(1))
                await mc.mutate(C.WriteSlice(VOL, attr.ino, 0, sid, 0, 100 + i, 0, time.time_ns()))
                acked[b"w%d/" % w + name] = attr.ino
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                i += 1

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for w in range(8):
                    nursery.start_soon(writer, w)
                await trio.sleep(1.5)
                leader = await cluster.wait_leader(pool)
                before_kill = len(acked)
                cluster.kill(leader)  # SIGKILL: no goodbye
                await trio.sleep(4.0)
                stop.set()
        assert before_kill > 0 and len(acked) > before_kill, "the workload did not resume"
        assert max(gaps) < 5.0, f"clients stalled for {max(gaps):.1f}s after the leader died"

        # nothing acknowledged was lost, nothing was applied twice
        mc = MetaClient(pool, cluster.addrs)
        for w in range(8):
            d = (await mc.query(Q.Lookup(VOL, 1, b"w%d" % w))).ino
            names = {bytes(e[0]) for e in await mc.query(Q.ReadDir(VOL, d, 0, 10_000))}
            mine = {k.split(b"/")[1] for k in acked if k.startswith(b"w%d/" % w)}
            assert names == mine
        for key, ino in list(acked.items())[::50]:
            w, name = key.split(b"/")
            d = (await mc.query(Q.Lookup(VOL, 1, w))).ino
            attr = await mc.query(Q.Lookup(VOL, d, name))
            assert attr.ino == ino and attr.size == 100 + int(name[1:])

        # the killed replica comes back and catches up; then a full restart restores all
        cluster.start(leader)
        await cluster.wait_leader(pool)
        before = await snapshot_view(mc)
        cluster.stop_all()
        cluster.start_all()
        await cluster.wait_leader(pool)
        mc2 = MetaClient(pool, cluster.addrs)
        after = await snapshot_view(mc2)
        assert after == before
        with pytest.raises(CacheFSError) as info:
            await mc2.mutate(C.Mknod(VOL, 1, b"w0", 0o100644))
        assert info.value.errno == errno.EEXIST


async def test_followers_redirect_and_retries_are_answered_once(cluster: MetaCluster) -> None:
    async with RpcPool(secret=None) as pool:
        leader = await cluster.wait_leader(pool)
        follower = (leader + 1) % 3
        with trio.fail_after(20):  # two replicas elect a leader; the third may still be starting
            while (await cluster.status(pool, follower)) is None:
                await trio.sleep(0.1)
        with pytest.raises(CacheFSError) as info:
            await pool.call(cluster.addrs[follower], "getattr", {"a": [VOL, 1]})
        assert info.value.code == "ENOTLEADER"
        assert info.value.details["leader"] == cluster.addrs[leader]
        mc = MetaClient(pool, [cluster.addrs[follower]])  # only a follower's address
        await mc.mutate(C.CreateVolume(VOL, "ec:4+2", "zstd", 1 << 20, 16))
        assert mc.leader == cluster.addrs[leader]
        # [client_id, seq, volume, parent, name, mode]: the retry of one request
        args = {"a": ["c", 42, VOL, 1, b"x", 0o100644]}
        first = (await pool.call(cluster.addrs[leader], "mknod", args)).result
        again = (await pool.call(cluster.addrs[leader], "mknod", args)).result
        assert again == first  # a retried create returns the inode, not EEXIST
        with pytest.raises(CacheFSError) as info:
            await pool.call(cluster.addrs[leader], "mknod", {"a": ["c", 43, VOL, 1, b"y" * 256, 0o100644]})
        assert info.value.errno == errno.ENAMETOOLONG
        with pytest.raises(CacheFSError) as info:
            await pool.call(cluster.addrs[leader], "mknod", {"a": ["c", 44, VOL, 1, b"z", "rw"]})
        assert info.value.errno == errno.EINVAL


async def test_a_paused_leader_never_serves_a_stale_read(cluster: MetaCluster) -> None:
    """SIGSTOP the leader (a long GC pause), change a file through the new leader,
    SIGCONT the old one and read from it at once: its read lease has expired, so
    it must refuse (NotLeader) or answer the new value, never the old one."""
    import signal

    async with RpcPool(secret=None) as pool:
        old = await cluster.wait_leader(pool)
        mc = MetaClient(pool, cluster.addrs)
        await mc.mutate(C.CreateVolume(VOL, "replica:3"))
        ino = (await mc.mutate(C.Mknod(VOL, 1, b"x", 0o100644))).ino
        for _ in range(20):  # reads that keep the old leader's lease warm
            reply = await pool.call(cluster.addrs[old], "getattr", {"a": [VOL, ino]})
            assert Attr.from_wire(reply.result).size == 0
        cluster.procs[old].send_signal(signal.SIGSTOP)
        try:
            others = MetaClient(
                pool, [a for i, a in enumerate(cluster.addrs) if i != old], deadline=20.0
            )
            await others.mutate(C.SetAttr(VOL, ino, size=5))
        finally:
            cluster.procs[old].send_signal(signal.SIGCONT)
        answers = []
        with trio.move_on_after(1.5):
            while True:
                try:
                    reply = await pool.call(
                        cluster.addrs[old], "getattr", {"a": [VOL, ino]}, timeout=1.0
                    )
                    answers.append(Attr.from_wire(reply.result).size)
                except CacheFSError as exc:
                    answers.append(exc.code)
        assert answers and 0 not in answers, answers


async def test_unlinked_open_file_survives_a_leader_kill_between_open_and_unlink(
    cluster: MetaCluster,
) -> None:
    """The open is soft state on the killed leader only; the new leader keeps
    every unlinked file until the holder announced its opens, then purges
    what nobody holds, and the open file when it is released."""
    async with RpcPool(secret=None) as pool:
        await cluster.wait_leader(pool)
        admin = MetaClient(pool, cluster.addrs)
        await admin.mutate(C.CreateVolume(VOL, "replica:3"))
        holder = MetaClient(pool, cluster.addrs, heartbeat_interval=60.0)
        session = (await holder.mount_volume(VOL)).session
        f = (await admin.mutate(C.Mknod(VOL, 1, b"f", 0o100644))).ino
        g = (await admin.mutate(C.Mknod(VOL, 1, b"g", 0o100644))).ino
        sid = await admin.mutate(C.AllocSlices(1))
        await admin.mutate(C.WriteSlice(VOL, f, 0, sid, 0, 100, 0, time.time_ns()))
        await holder.query(Q.Open(VOL, f, session))
        cluster.kill(await cluster.wait_leader(pool))
        await admin.mutate(C.Unlink(VOL, 1, b"f"))  # on the new leader, which never heard of the open
        await admin.mutate(C.Unlink(VOL, 1, b"g"))
        await trio.sleep(1.5)  # housekeeping runs: nothing may be purged yet
        assert (await admin.query(Q.GetAttr(VOL, f))).nlink == 0
        assert await admin.query(Q.ReadChunk(VOL, f, 0)) == [Slice(sid, 0, 100, 0)]
        assert (await admin.query(Q.GetAttr(VOL, g))).nlink == 0  # kept: the leader cannot know
        assert await holder.query(Q.SessionHeartbeat(session, [f]))
        with trio.fail_after(10):  # g is purged, f stays
            while True:
                try:
                    await admin.query(Q.GetAttr(VOL, g))
                except CacheFSError as exc:
                    assert exc.errno == errno.ENOENT
                    break
                await trio.sleep(0.05)
        assert (await admin.query(Q.GetAttr(VOL, f))).size == 100
        assert await admin.query(Q.ListTrash(VOL)) == []
        await holder.query(Q.Release(VOL, f, session))
        with trio.fail_after(10):
            while not await admin.query(Q.ListTrash(VOL)):
                await trio.sleep(0.05)
        assert [r[0] for r in await admin.query(Q.ListTrash(VOL))] == [sid]
        with pytest.raises(CacheFSError) as info:
            await admin.query(Q.GetAttr(VOL, f))
        assert info.value.errno == errno.ENOENT
        await holder.close_session(session)
