"""RaftNode over real RPC on 127.0.0.1 with real WAL directories.

Three replicas run in this trio process, each in its own cancel scope (its
own RPC server, pool and node), so "kill" is a cancelled scope and "restart"
opens the same data directory again.
"""

from __future__ import annotations

import resource
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio

from cachefs.credentials import Credential, metanode_name
from cachefs.errors import Corrupt, InvalidArgument, NotFound, NotLeader
from cachefs.metanode.raft import messages as wire
from cachefs.metanode.raft.core import RaftConfig
from cachefs.metanode.raft.driver import RAFT_SYNC_BATCH, DriverConfig, RaftNode
from cachefs.metanode.raft.messages import AppendResp, Entry
from cachefs.metanode.raft.storage import record_spans
from cachefs.rpc import CallContext, RpcPool, RpcServer, rpc_method
from cachefs.testing.ports import free_ports

from .sim import KV

SECRET = b"raft-test-secret"


def member(i: int) -> Credential:
    """The credential metanode ``i`` authenticates with (Raft checks a message's src against it)."""
    return Credential.server(SECRET, metanode_name(i))

CONFIG = RaftConfig(election_tick=10, heartbeat_tick=1)


class Machine(KV):
    """The simulation's key-value model, plus a command that fails in apply."""

    def apply(self, index: int, command: bytes) -> object:
        if command == b"missing":
            raise NotFound("no such key")
        return super().apply(index, command)


def put(client: str, seq: int, key: str, value: int) -> bytes:
    return msgpack.packb([client, seq, "put", key, value, None])


@dataclass
class Replica:
    scope: trio.CancelScope
    node: RaftNode
    sm: Machine


class Cluster:
    def __init__(self, nursery: trio.Nursery, root: Path, n: int = 3,
                 driver_config: DriverConfig | None = None) -> None:
        self.nursery = nursery
        self.root = root
        self.peers = {i + 1: f"127.0.0.1:{p}" for i, p in enumerate(free_ports(n))}
        self.replicas: dict[int, Replica] = {}
        self.dconfig = driver_config or DriverConfig(tick_interval=0.02)
        self.node_class: dict[int, type[RaftNode]] = {}  # replica -> its RaftNode class

    async def start(self, i: int) -> Replica:
        rep = await self.nursery.start(self._run, i)
        self.replicas[i] = rep
        return rep

    async def _run(self, i: int, *, task_status: trio.TaskStatus[Replica]) -> None:
        port = int(self.peers[i].rsplit(":", 1)[1])
        with trio.CancelScope() as scope:
            async with RpcPool(secret=member(i)) as pool, trio.open_nursery() as n:
                server = RpcServer(name=f"meta{i}", secret=SECRET)
                sm = Machine()
                node = await self.node_class.get(i, RaftNode).create(i, self.peers, self.root / f"m{i}", sm, pool,
                                             nursery=n, server=server, config=CONFIG,
                                             driver_config=self.dconfig)
                # Serve once the node's methods are there, as the daemon does (a
                # call that came before would find no raft_step).
                await n.start(server.serve, "127.0.0.1", port)
                task_status.started(Replica(scope, node, sm))

    def kill(self, i: int) -> None:
        self.replicas.pop(i).scope.cancel()

    async def leader(self, timeout: float = 10.0) -> Replica:
        with trio.fail_after(timeout):
            while True:
                leaders = [r for r in self.replicas.values() if r.node.is_leader]
                if len(leaders) == 1:
                    return leaders[0]
                await trio.sleep(0.02)

    async def converged(self, index: int, timeout: float = 10.0) -> None:
        with trio.fail_after(timeout):
            while any(r.node.applied < index for r in self.replicas.values()):
                await trio.sleep(0.02)


async def propose_all(node: RaftNode, commands: list[bytes]) -> list[object]:
    results: list[object] = [None] * len(commands)

    async def one(k: int) -> None:
        results[k] = await node.propose(commands[k])

    async with trio.open_nursery() as n:
        for k in range(len(commands)):
            n.start_soon(one, k)
    return results


async def test_elect_propose_kill_leader_restart(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        cluster = Cluster(nursery, tmp_path)
        for i in (1, 2, 3):
            await cluster.start(i)
        leader = await cluster.leader()

        # 40 concurrent proposals: applied once each, and group commit means
        # far fewer fsyncs than proposals.
        syncs_before = leader.node.storage.syncs
        results = await propose_all(leader.node, [put(f"c{k}", 1, f"k{k}", k) for k in range(40)])
        assert results == [True] * 40
        assert leader.node.storage.syncs - syncs_before < 40
        assert leader.node.stats["appends"] < 40

        # A retried (client, seq) is answered, not applied again.
        assert await leader.node.propose(put("c0", 1, "k0", 999)) is True
        assert leader.sm.data["k0"] == 0

        # An error raised by apply is that command's answer.
        with pytest.raises(NotFound):
            await leader.node.propose(b"missing")

        # Followers redirect; the leader serves linearizable reads.
        follower = next(r for r in cluster.replicas.values() if r is not leader)
        with pytest.raises(NotLeader) as info:
            await follower.node.propose(put("c", 41, "x", 1))
        assert info.value.details["leader"] == cluster.peers[leader.node.id]
        with pytest.raises(NotLeader):
            await follower.node.read_index()
        await leader.node.read_index()
        assert leader.sm.data["k39"] == 39

        # Kill the leader: a new one is elected and nothing committed is lost.
        old = leader.node.id
        committed = dict(leader.sm.data)
        cluster.kill(old)
        new = await cluster.leader()
        assert new.node.id != old
        await new.node.read_index()
        for key, value in committed.items():
            assert new.sm.data[key] == value
        assert await new.node.propose(put("d", 1, "after", 1)) is True

        # The old leader comes back from its data dir and catches up.
        back = await cluster.start(old)
        await cluster.converged(new.node.applied)
        assert back.sm.data == new.sm.data
        assert not back.node.is_leader or back.node.term > new.node.term

        # Stop everything; all three restart from their data dirs.
        final = dict(new.sm.data)
        for i in list(cluster.replicas):
            cluster.kill(i)
        await trio.sleep(0.05)
        for i in (1, 2, 3):
            await cluster.start(i)
        leader = await cluster.leader()
        await leader.node.read_index()
        assert leader.sm.data == final
        assert await leader.node.propose(put("d", 2, "again", 2)) is True
        await cluster.converged(leader.node.applied)
        assert all(r.sm.data == leader.sm.data for r in cluster.replicas.values())
        nursery.cancel_scope.cancel()


async def test_the_leader_commits_on_its_followers_acks_while_its_own_fsync_is_held(
        tmp_path: Path) -> None:
    """Asynchronous WAL writes on the leader: with its own write of A held,
    the two followers' acknowledgements are a quorum, so A is committed,
    applied and answered before the leader's disk has it (Raft counts the
    leader's own log only once it is durable); B, proposed meanwhile, too.
    Once the disk lets go, the leader's log is stable again. And a batch of
    concurrent proposals shares its fsyncs (the entries-per-sync metric)."""
    async with trio.open_nursery() as nursery:
        cluster = Cluster(nursery, tmp_path)
        for i in (1, 2, 3):
            await cluster.start(i)
        leader = await cluster.leader()
        node = leader.node
        # One commit first: the followers are replicating (not probed), so
        # an Append leaves for each proposal at once.
        assert await node.propose(put("w", 1, "w", 0)) is True
        a, b = put("a", 1, "a", 1), put("b", 1, "b", 2)
        held = threading.Event()
        save = node.storage.save

        def gated_save(entries: tuple[Entry, ...], *args: object) -> None:
            if any(e.data == a for e in entries):
                assert held.wait(20), "the test never let this write go"
            save(entries, *args)

        node.storage.save = gated_save  # type: ignore[method-assign]
        results: dict[bytes, object] = {}

        async def propose(cmd: bytes) -> None:
            results[cmd] = await node.propose(cmd)

        for cmd in (a, b):
            nursery.start_soon(propose, cmd)
            with trio.fail_after(10):
                while cmd not in results:
                    await trio.sleep(0.005)
            assert results[cmd] is True
        assert leader.sm.data["a"] == 1 and leader.sm.data["b"] == 2
        assert node.core.log.stable < node.commit_index - 1  # neither is on its disk yet
        assert node.core.writing >= 1
        held.set()
        with trio.fail_after(10):
            while node.core.log.stable < node.last_index or node.core.writing:
                await trio.sleep(0.005)
        node.storage.save = save  # type: ignore[method-assign]

        batch = RAFT_SYNC_BATCH.labels(str(node.id))
        count, total = _histogram(batch)
        assert await propose_all(node, [put(f"c{k}", 1, f"k{k}", k) for k in range(40)]) == [True] * 40
        with trio.fail_after(10):  # committed on the followers' acks: the leader's own fsyncs may lag
            while node.core.log.stable < node.last_index or node.core.writing:
                await trio.sleep(0.005)
        count2, total2 = _histogram(batch)
        assert total2 - total == 40
        assert count2 - count < 40  # more than one proposal per fsync
        nursery.cancel_scope.cancel()


@pytest.mark.allow_log("cachefs.metanode.raft.driver", match=r"refused a AppendResp: from \d+ to \d+ in a reply")
async def test_followers_acknowledge_in_the_reply_to_the_leaders_call(tmp_path: Path) -> None:
    """An Append's AppendResp rides back on the raft_step call that brought
    it: the followers make (almost) no calls of their own while the leader
    commits one proposal after another; and a reply that speaks for anyone
    but the peer called is refused."""
    async with trio.open_nursery() as nursery:
        cluster = Cluster(nursery, tmp_path)
        for i in (1, 2, 3):
            await cluster.start(i)
        leader = await cluster.leader()
        assert await leader.node.propose(put("w", 1, "w", 0)) is True
        followers = [r.node for r in cluster.replicas.values() if r is not leader]
        calls = [f.stats["calls"] for f in followers]
        answered = [f.stats["answered"] for f in followers]
        for k in range(40):
            assert await leader.node.propose(put("s", k + 1, f"k{k}", k)) is True
        for f, before, acks in zip(followers, calls, answered, strict=True):
            assert f.stats["calls"] - before < 10  # a call per acknowledgement before
            assert f.stats["answered"] - acks >= 40

        node, peer = leader.node, followers[0].id
        other = followers[1].id
        refused = node.stats["refused"]
        forged = wire.encode_batch([AppendResp(node.term, other, node.id, node.last_index)])
        node._take_answers(peer, forged)  # claims to be the other follower
        node._take_answers(peer, b"\xc1not msgpack")
        assert node.stats["refused"] == refused + 2
        nursery.cancel_scope.cancel()


class OlderNode(RaftNode):
    """A replica of the version before answers in replies: its raft_step
    takes no ``answer`` and its sender makes plain calls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._plain_peers.update(self.peers)

    @rpc_method
    def raft_step(  # type: ignore[override]
        self, *, payload: bytes | None = None, ctx: CallContext | None = None
    ) -> None:
        assert RaftNode.raft_step(self, payload=payload, ctx=ctx) is None


async def test_a_replica_of_the_older_version_gets_plain_calls(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        cluster = Cluster(nursery, tmp_path)
        cluster.node_class[3] = OlderNode
        for i in (1, 2, 3):
            await cluster.start(i)
        leader = await cluster.leader()
        for k in range(10):
            assert await leader.node.propose(put("o", k + 1, f"k{k}", k)) is True
        await cluster.converged(leader.node.applied)
        assert cluster.replicas[3].sm.data == leader.sm.data
        if leader.node.id != 3:
            assert 3 in leader.node._plain_peers
        nursery.cancel_scope.cancel()


def _histogram(h: object) -> tuple[float, float]:
    """(count, sum) of one labelled histogram."""
    samples = {s.name: s.value for metric in h.collect() for s in metric.samples}  # type: ignore[attr-defined]
    return samples["cachefs_raft_entries_per_sync_count"], samples["cachefs_raft_entries_per_sync_sum"]


@pytest.mark.allow_log("cachefs.metanode.raft.driver", match=r"refused a InstallSnapshot: .* out of order")
async def test_lagging_follower_gets_a_snapshot(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        cluster = Cluster(nursery, tmp_path,
                          driver_config=DriverConfig(tick_interval=0.02, snapshot_entries=10,
                                                        snapshot_chunk=40))
        for i in (1, 2, 3):
            await cluster.start(i)
        leader = await cluster.leader()
        lagger = next(i for i in cluster.replicas if i != leader.node.id)
        cluster.kill(lagger)
        for k in range(4):  # several snapshots, so the log no longer reaches back
            await propose_all(leader.node, [put(f"c{j}", k + 1, f"k{j}", 10 * k + j)
                                            for j in range(10)])
        with trio.fail_after(10):  # snapshots are taken in the background
            while leader.node.core.log.snap_index <= 20 or leader.node.stats["snapshots"] < 2:
                await trio.sleep(0.01)
        assert list((tmp_path / f"m{leader.node.id}").glob("snap-*.snap"))
        back = await cluster.start(lagger)
        await cluster.converged(leader.node.applied)
        assert back.sm.data == leader.sm.data
        assert back.node.core.log.snap_index >= 20  # it came as a snapshot
        peer = next(i for i in cluster.replicas if i != back.node.id)  # src=itself is refused as not a peer
        with pytest.raises(InvalidArgument, match="out of order"):  # chunks must come in order
            await back.node.raft_snapshot(src=peer, xfer=7, chunk=1, chunks=2, payload=b"x")
        nursery.cancel_scope.cancel()


@pytest.mark.allow_log("cachefs.metanode.raft.driver", match=r"save failed \(\[Errno 27\] File too large\); retrying")
async def test_a_full_disk_stalls_a_replica_without_killing_it(tmp_path: Path) -> None:
    """A file size limit makes every WAL append fail (as ENOSPC would): the
    replicas log, count and retry; once writes succeed again the proposal
    made meanwhile commits, on nodes that never stopped."""
    async with trio.open_nursery() as nursery:
        cluster = Cluster(nursery, tmp_path)
        for i in (1, 2, 3):
            await cluster.start(i)
        leader = await cluster.leader()
        # WALs far bigger than anything else this process writes meanwhile
        # (pytest's capture files), so the limit only bites them.
        await leader.node.propose(put("c", 1, "b" * (1 << 20), 0))
        await cluster.converged(leader.node.applied)
        limit = max(r.node.storage.wal_size() for r in cluster.replicas.values())
        old = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        result: list[object] = []
        try:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))

            async def propose() -> None:
                result.append(await leader.node.propose(put("c", 2, "during", 1)))

            nursery.start_soon(propose)
            with trio.fail_after(10):
                while sum(r.node.stats["storage_errors"] for r in cluster.replicas.values()) < 3:
                    await trio.sleep(0.02)
            assert not result
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old)
            signal.signal(signal.SIGXFSZ, handler)
        with trio.fail_after(10):
            while not result:
                await trio.sleep(0.02)
        assert result == [True]
        assert all(not r.node._closed for r in cluster.replicas.values())
        await cluster.converged(leader.node.applied)
        assert all(r.sm.data["during"] == 1 for r in cluster.replicas.values())
        nursery.cancel_scope.cancel()


@pytest.mark.allow_log("cachefs.metanode.raft.driver", match="rebuilding from the leader")
async def test_a_replica_with_a_damaged_wal_refuses_to_start_and_is_rebuilt(
    tmp_path: Path,
) -> None:
    """A record damaged before the WAL's tail: the replica refuses to start
    (naming file and offset) instead of forgetting what it acknowledged. The
    documented way back (move the data dir aside, restart) brings it back by
    snapshot install from the leader."""
    async with trio.open_nursery() as nursery:
        cluster = Cluster(nursery, tmp_path,
                          driver_config=DriverConfig(tick_interval=0.02, snapshot_entries=10))
        for i in (1, 2, 3):
            await cluster.start(i)
        leader = await cluster.leader()
        victim = next(i for i in cluster.replicas if i != leader.node.id)
        for k in range(3):
            await propose_all(leader.node, [put(f"c{j}", k + 1, f"k{j}", 10 * k + j)
                                            for j in range(10)])
        await cluster.converged(leader.node.applied)
        with trio.fail_after(10):
            while leader.node.core.log.snap_index < 20:
                await trio.sleep(0.01)
        v = cluster.replicas[victim].node
        with trio.fail_after(10):  # its own compactions done, and none due after 3 more entries
            filler = 0
            while v.core.log.snap_index < 20 or v.snapshotting or v.core.applied - v.core.log.snap_index > 6:
                if not v.snapshotting and v.core.log.snap_index >= 20 and v.core.applied == leader.node.applied:
                    # Its last compaction came early in the batch (at 20 of 31, say): none is
                    # due until 10 more, so more entries bring the next one on.
                    filler += 1
                    await leader.node.propose(put("f", filler, "f", filler))
                await trio.sleep(0.01)
        for k in range(3):  # Readys after the compaction's rewrite
            await leader.node.propose(put("e", k + 1, "e", k))
        await cluster.converged(leader.node.applied)
        cluster.kill(victim)
        await trio.sleep(0.05)
        wal = tmp_path / f"m{victim}" / "wal.log"
        raw = bytearray(wal.read_bytes())
        records = record_spans(bytes(raw))
        assert len(records) >= 3
        at = records[1][0]  # the record after BASE, with whole records after it
        raw[at + 12] ^= 0x20
        wal.write_bytes(bytes(raw))
        with pytest.RaisesGroup(pytest.RaisesExc(Corrupt, match=f"WAL {wal}: CRC mismatch at "
                                                 f"byte {at} .* rebuild this replica"),
                                flatten_subgroups=True):
            await cluster.start(victim)
        (tmp_path / f"m{victim}").rename(tmp_path / f"m{victim}.damaged")
        back = await cluster.start(victim)
        await propose_all(leader.node, [put("d", 1, "after", 1)])
        await cluster.converged(leader.node.applied)
        assert back.sm.data == leader.sm.data
        assert back.node.core.log.snap_index >= 20  # it came back as a snapshot
        nursery.cancel_scope.cancel()
