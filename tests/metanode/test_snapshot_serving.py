"""Snapshots of a large namespace do not stop the leader (issue 3).

Three replicas of the real namespace run in this trio process over real RPC
and WAL directories. The state machine is preloaded with a large tree, then
a snapshot is started; the forked child that serializes it waits on a gate
file, so "while a snapshot is being taken" is a fact the test controls, not
a race against the machine's speed. Clients then read and create through the
leader, which must answer everything without losing leadership. Once the
gate opens, the snapshot on disk must be exactly the state at its index:
restored and replayed with the log after it, it equals the live state, and
a replica restarted from its directory comes back with that same state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.metanode.client import MetaClient
from cachefs.metanode.namespace import MetaState
from cachefs.metanode.raft.core import RaftConfig
from cachefs.metanode.raft.driver import DriverConfig, RaftNode
from cachefs.metanode.raft.storage import decode_snapshot
from cachefs.metanode.service import MetaService
from cachefs.rpc import RpcPool, RpcServer
from cachefs.testing.ports import free_ports

VOL = "vol"
PRELOAD = 50_000  # inodes in the tree before the snapshot
SNAPSHOT_EVERY = 100  # log entries


class GatedState(MetaState):
    """A namespace whose snapshot waits until ``gate`` exists. Only the
    forked child serializes, so only the child waits."""

    gate: Path | None = None

    def snapshot(self) -> bytes:
        gate = type(self).gate
        if gate is not None:
            deadline = time.monotonic() + 60
            while not gate.exists() and time.monotonic() < deadline:
                time.sleep(0.005)
        return super().snapshot()


def preload(state: MetaState, n: int) -> None:
    """The same tree on every replica, as if an earlier log had built it."""
    now = 1_700_000_000 * 10**9
    state.apply(0, C.CreateVolume(VOL, "replica:3", "none", 4 << 20, 64, now_ns=now))
    for d in range(n // 1000):
        dino = state.apply(0, C.Mkdir(VOL, 1, b"d%03d" % d, 0o755, 0, 0, now_ns=now)).ino
        for k in range(1000):
            state.apply(0, C.Mknod(VOL, dino, b"f%04d" % k, 0o100644, 0, 0, 0, now_ns=now))


@dataclass
class Replica:
    scope: trio.CancelScope
    node: RaftNode
    state: GatedState
    stopped: trio.Event


class Cluster:
    def __init__(self, nursery: trio.Nursery, root: Path) -> None:
        self.nursery = nursery
        self.root = root
        self.peers = {i + 1: f"127.0.0.1:{p}" for i, p in enumerate(free_ports(3))}
        self.replicas: dict[int, Replica] = {}
        self.dconfig = DriverConfig(tick_interval=0.02, snapshot_entries=SNAPSHOT_EVERY)

    async def start(self, i: int, state: GatedState) -> Replica:
        rep = await self.nursery.start(self._run, i, state)
        self.replicas[i] = rep
        return rep

    async def _run(self, i: int, state: GatedState, *, task_status: trio.TaskStatus[Replica]) -> None:
        port = int(self.peers[i].rsplit(":", 1)[1])
        stopped = trio.Event()
        try:
            with trio.CancelScope() as scope:
                async with RpcPool(secret=None) as pool, trio.open_nursery() as n:
                    service = MetaService(state)
                    server = RpcServer(service, name=f"meta{i}", secret=None)
                    node = await RaftNode.create(i, self.peers, self.root / f"m{i}", state, pool,
                                                 nursery=n, server=server,
                                                 config=RaftConfig(election_tick=10),
                                                 driver_config=self.dconfig)
                    service.node = node
                    # Serve once raft_step is registered, as the daemon does.
                    await n.start(server.serve, "127.0.0.1", port)
                    task_status.started(Replica(scope, node, state, stopped))
        finally:
            stopped.set()

    async def leader(self) -> Replica:
        with trio.fail_after(20):
            while True:
                leaders = [r for r in self.replicas.values() if r.node.is_leader]
                if len(leaders) == 1:
                    return leaders[0]
                await trio.sleep(0.02)


async def test_leader_serves_during_a_snapshot_and_the_snapshot_is_exact(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    GatedState.gate = gate
    try:
        await _scenario(tmp_path, gate)
    finally:
        GatedState.gate = None


async def _scenario(tmp_path: Path, gate: Path) -> None:
    async with trio.open_nursery() as nursery, RpcPool(secret=None) as pool:
        cluster = Cluster(nursery, tmp_path)
        base = MetaState()
        preload(base, PRELOAD)
        tree = base.snapshot()
        for i in (1, 2, 3):
            state = GatedState()
            state.restore(tree)  # the same tree on every replica
            await cluster.start(i, state)
        leader = await cluster.leader()
        term = leader.node.term
        addr = cluster.peers[leader.node.id]
        mc = MetaClient(pool, [addr], deadline=20.0)
        top = (await mc.mutate(C.Mkdir(VOL, 1, b"new", 0o755))).ino
        d0 = (await mc.query(Q.Lookup(VOL, 1, b"d000"))).ino

        # Enough entries to start a snapshot; its child then waits on the gate.
        n = 0
        with trio.fail_after(30):
            while not leader.node.snapshotting:
                await mc.mutate(C.Mknod(VOL, top, b"a%05d" % n, 0o100644))
                n += 1
        assert leader.node.is_leader and not await trio.Path(gate).exists()

        # While the snapshot is being taken: reads and creates from 8 clients.
        made: list[int] = []

        async def client(c: int) -> None:
            cl = MetaClient(pool, [addr], deadline=20.0)
            for k in range(25):
                ino = (await cl.mutate(C.Mknod(VOL, top, b"c%d-%d" % (c, k), 0o100644))).ino
                made.append(ino)
                assert (await cl.query(Q.GetAttr(VOL, ino))).ino == ino
                assert (await cl.query(Q.Lookup(VOL, 2, b"f0999"))).ino > d0

        with trio.fail_after(30):
            async with trio.open_nursery() as clients:
                for c in range(8):
                    clients.start_soon(client, c)
        assert len(made) == 200
        assert leader.node.snapshotting  # all of it happened while the child waited
        assert leader.node.is_leader and leader.node.term == term

        await trio.Path(gate).touch()
        with trio.fail_after(60):
            while any(r.node.snapshotting or r.node.stats["snapshots"] < 1
                      for r in cluster.replicas.values()):
                await trio.sleep(0.02)

        for k in range(20):  # fewer than SNAPSHOT_EVERY: these stay in the log
            await mc.mutate(C.Mknod(VOL, top, b"z%d" % k, 0o100644))

        # The snapshot on disk is exactly the state at its index: restored,
        # with the log after it replayed, it equals the live state.
        live = leader.state
        files = sorted((tmp_path / f"m{leader.node.id}").glob("snap-*.snap"))
        snap = decode_snapshot(await trio.Path(files[-1]).read_bytes())
        restored = MetaState()
        restored.restore(snap.data)
        assert restored.applied_index == snap.meta.index
        assert restored.lookup(VOL, d0, b"f0999").ino > d0  # the preloaded tree
        replay = [e for e in leader.node.core.log.entries if e.index > snap.meta.index]
        assert replay
        for e in replay:
            if e.data:
                restored.apply(e.index, e.data)
        assert restored.applied_index == live.applied_index
        assert restored.snapshot() == live.snapshot()

        # A replica restarted from its directory comes back with that state.
        follower = next(i for i in cluster.replicas if i != leader.node.id)
        gone = cluster.replicas.pop(follower)
        gone.scope.cancel()
        await gone.stopped.wait()
        back = await cluster.start(follower, GatedState())
        with trio.fail_after(30):
            while back.node.applied < live.applied_index:
                await trio.sleep(0.02)
        assert back.state.snapshot() == live.snapshot()
        nursery.cancel_scope.cancel()
