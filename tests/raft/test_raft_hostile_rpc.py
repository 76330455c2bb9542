"""Hostile peers against real RaftNodes over RPC.

A hostile peer sends well-formed ``raft_step`` batches and ``raft_snapshot``
transfers, built by the strategies of ``hostile.py``, while honest proposals
go on. No node may die. Messages from non-members (over the cluster
secret's own identity, which is no member's) must change nothing: what was
committed stays, and the cluster keeps committing. Messages over a member's
own credential (a member gone rogue, the worst a peer can be) may disturb
the cluster but must not crash it or break a core's own invariants; a
connection can speak only for the member it is authenticated as.

InstallSnapshot's memory is bounded: chunks are spooled to disk, and the
decompressed size is capped by ``DriverConfig.max_snapshot``. The peak RSS
growth (``VmHWM`` after resetting it through ``/proc/self/clear_refs``) is
measured and bounded here.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path

import msgpack
import pytest
import trio
import zstandard
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from cachefs.errors import CacheFSError, InvalidArgument, ProtocolError
from cachefs.metanode.raft import messages as wire
from cachefs.metanode.raft import transfer
from cachefs.metanode.raft.driver import DriverConfig
from cachefs.metanode.raft.messages import (
    HardState,
    InstallSnapshot,
    Message,
    Snapshot,
    SnapshotMeta,
)
from cachefs.metanode.raft.storage import RaftStorage
from cachefs.rpc import RpcPool

from . import hostile
from .sim import KV
from .test_raft_driver import SECRET, Cluster, member, propose_all, put
from .test_raft_hostile import check_core

MEMBERS = (1, 2, 3)
MiB = 1 << 20


def draw(strategy: st.SearchStrategy, n: int) -> list:
    """``n`` examples of ``strategy``, reproducibly (hypothesis as a generator:
    the cluster under test is too slow to start once per example)."""
    out: list = []

    @settings(max_examples=n, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(x: object) -> None:
        out.append(x)

    collect()
    return out


def snapshot_calls(members: tuple[int, ...]) -> st.SearchStrategy[list[tuple[dict, bytes]]]:
    """A raft_snapshot call sequence: a whole transfer of a hostile message,
    or chunks with arbitrary numbering and bytes."""
    whole = hostile.messages(members, kinds=("snapshot",)).map(
        lambda m: [({"src": m.src, "xfer": 1, "chunk": 0, "chunks": 1}, transfer.encode(m))])
    loose = st.lists(st.tuples(
        st.fixed_dictionaries({"src": hostile.ids(members), "xfer": st.integers(0, 3),
                               "chunk": st.integers(-1, 3), "chunks": st.integers(0, 3)}),
        st.binary(max_size=64)), min_size=1, max_size=4)
    return st.one_of(whole, loose)


async def hostile_storm(cluster: Cluster, batches: list[list[Message]],
                        snaps: list[list[tuple[dict, bytes]]]) -> int:
    """Send everything to random nodes while honest proposals go on; the
    number of calls the nodes answered with an error. Each message goes
    over a connection authenticated as the member it claims to be from (a
    member gone rogue: the worst a peer can be); an outsider's over the
    cluster secret's identity, which is no member."""
    rng = random.Random(7)
    errors = 0
    async with AsyncExitStack() as stack:
        pools = {src: await stack.enter_async_context(RpcPool(secret=member(src) if src else SECRET))
                 for src in (*MEMBERS, None)}

        def pool_of(src: int) -> RpcPool:
            return pools.get(src, pools[None])

        for k, batch in enumerate(batches):
            addr = cluster.peers[rng.choice(MEMBERS)]
            by_src: dict[int, list[Message]] = {}
            for m in batch:
                by_src.setdefault(m.src, []).append(m)
            for src, msgs in by_src.items():
                try:
                    await pool_of(src).call(addr, "raft_step", payload=wire.encode_batch(msgs), timeout=5)
                except CacheFSError:
                    errors += 1
            if k < len(snaps):
                for args, payload in snaps[k]:
                    try:
                        await pool_of(args["src"]).call(addr, "raft_snapshot", args, payload=payload, timeout=5)
                    except CacheFSError:
                        errors += 1
            if k % 10 == 0:
                leaders = [r for r in cluster.replicas.values() if r.node.is_leader]
                if leaders:
                    try:
                        with trio.fail_after(2):
                            await leaders[0].node.propose(put("honest", k + 1, "h", k))
                    except (CacheFSError, trio.TooSlowError):
                        pass  # the storm may cost leadership; it must not cost a node
    return errors


def alive(cluster: Cluster) -> None:
    for r in cluster.replicas.values():
        assert not r.node._closed, f"node {r.node.id} stopped"
        check_core(r.node.core)


@pytest.mark.allow_log("cachefs.metanode.raft.driver", match=r"refused a \w+: .*not a peer")
async def test_non_members_change_nothing(tmp_path: Path) -> None:
    outsiders = (4, 99)

    def from_outsiders(batch: list[Message]) -> list[Message]:
        return [type(m)(*((getattr(m, f) if f != "src" else outsiders[i % 2])
                          for f in m.__dataclass_fields__)) for i, m in enumerate(batch)]

    batches = [from_outsiders(b) for b in draw(st.lists(hostile.messages(MEMBERS), min_size=1,
                                                        max_size=6), 120)]
    snaps = [[({**a, "src": outsiders[0]}, p) for a, p in calls]
             for calls in draw(snapshot_calls(MEMBERS), 30)]
    async with trio.open_nursery() as nursery:
        cluster = Cluster(nursery, tmp_path)
        for i in MEMBERS:
            await cluster.start(i)
        leader = await cluster.leader()
        term = leader.node.term
        await propose_all(leader.node, [put(f"c{k}", 1, f"k{k}", k) for k in range(20)])
        before = dict(leader.sm.data)
        errors = await hostile_storm(cluster, batches, snaps)
        alive(cluster)
        assert errors >= len(snaps)  # every snapshot call from an outsider is refused
        assert sum(r.node.stats["refused"] for r in cluster.replicas.values()) >= \
            sum(len(b) for b in batches)
        leader = await cluster.leader()
        assert leader.node.term == term  # nobody was disturbed
        await leader.node.propose(put("after", 1, "after", 1))
        await cluster.converged(leader.node.applied)
        for r in cluster.replicas.values():
            assert r.sm.data == leader.sm.data
            assert all(r.sm.data[k] == v for k, v in before.items())
        nursery.cancel_scope.cancel()


@pytest.mark.allow_log("cachefs.metanode.raft.driver", match=r"refused a \w+")
async def test_forged_member_messages_crash_no_node(tmp_path: Path) -> None:
    batches = draw(st.lists(hostile.messages(MEMBERS), min_size=1, max_size=6), 250)
    snaps = draw(snapshot_calls(MEMBERS), 60)
    async with trio.open_nursery() as nursery:
        cluster = Cluster(nursery, tmp_path)
        for i in MEMBERS:
            await cluster.start(i)
        leader = await cluster.leader()
        await propose_all(leader.node, [put(f"c{k}", 1, f"k{k}", k) for k in range(20)])
        await hostile_storm(cluster, batches, snaps)
        await trio.sleep(0.5)  # let the loops step whatever is still queued
        alive(cluster)
        assert sum(r.node.stats["refused"] for r in cluster.replicas.values()) > 0
        async with RpcPool(secret=SECRET) as pool:  # every node still serves its RPC
            for addr in cluster.peers.values():
                await pool.call(addr, "raft_step", payload=wire.encode_batch([]), timeout=5)
        nursery.cancel_scope.cancel()


# ------------------------------------------------------ snapshot memory
@contextmanager
def peak_rss_growth() -> Iterator[list[int]]:
    """Yields a list that receives the peak RSS growth (bytes) of this
    process over the block: VmHWM, reset first through clear_refs."""
    def hwm() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")

    def rss() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    Path("/proc/self/clear_refs").write_text("5")
    base = rss()
    out: list[int] = []
    yield out
    out.append(hwm() - base)


needs_hwm_reset = pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                                     reason="needs a writable /proc/self/clear_refs")


def _used_disk(path: Path, term: int) -> None:
    """A replica's disk that has taken part in the cluster up to ``term`` (a
    new disk would only ask its peers' terms before it takes anything)."""
    store = RaftStorage.open(path)
    store.save([], HardState(term), sync=True)
    store.close()


async def _lone_follower(nursery: trio.Nursery, tmp_path: Path, max_snapshot: int) -> Cluster:
    """Node 1 of three, alone, on a disk that has taken part already (term
    2): it takes snapshot chunks from 'leader' 2."""
    _used_disk(tmp_path / "m1", 2)
    cluster = Cluster(nursery, tmp_path, driver_config=DriverConfig(
        tick_interval=0.02, max_snapshot=max_snapshot, fork_snapshots=False))
    await cluster.start(1)
    return cluster


async def _send(pool: RpcPool, addr: str, blob_chunks: list[bytes], xfer: int = 1) -> None:
    for k, chunk in enumerate(blob_chunks):
        await pool.call(addr, "raft_snapshot",
                        {"src": 2, "xfer": xfer, "chunk": k, "chunks": len(blob_chunks)},
                        payload=chunk, timeout=10)


@pytest.mark.allow_log("cachefs.metanode.raft.driver", match=r"refused a InstallSnapshot")
@needs_hwm_reset
async def test_a_big_transfer_is_spooled_to_disk_not_memory(tmp_path: Path) -> None:
    """128 MiB of chunks (incompressible, so they do not decode): the
    receiver holds them on disk, not in memory, and then refuses them."""
    chunk = os.urandom(4 * MiB)
    async with trio.open_nursery() as nursery:
        cluster = await _lone_follower(nursery, tmp_path, max_snapshot=256 * MiB)
        async with RpcPool(secret=member(2)) as pool:
            await pool.call(cluster.peers[1], "raft_step", payload=wire.encode_batch([]))
            with peak_rss_growth() as growth, pytest.raises(ProtocolError, match="undecodable"):
                await _send(pool, cluster.peers[1], [chunk] * 32)
        print(f"peak RSS growth while receiving 128 MiB in 32 chunks: {growth[0] / MiB:.1f} MiB")
        assert growth[0] < 48 * MiB, growth
        assert not list((tmp_path / "m1").glob("*.tmp"))  # the spool is gone
        nursery.cancel_scope.cancel()


@pytest.mark.allow_log("cachefs.metanode.raft.driver", match=r"refused a InstallSnapshot")
@needs_hwm_reset
async def test_a_decompression_bomb_is_refused_within_the_limit(tmp_path: Path) -> None:
    """Under a MiB that decompresses to 1 GiB behind a header that claims
    the limit: refused, with at most about the limit in memory."""
    limit = 64 * MiB
    header = msgpack.packb([5, 2, 1, 100, 5, list(MEMBERS), limit])  # the header lies
    cobj = zstandard.ZstdCompressor(level=3).compressobj()
    parts = [cobj.compress(len(header).to_bytes(4, "big") + header)]
    zeros = bytes(MiB)
    parts += [cobj.compress(zeros) for _ in range(1024)]
    parts.append(cobj.flush())
    bomb = b"".join(parts)
    assert len(bomb) < MiB
    async with trio.open_nursery() as nursery:
        cluster = await _lone_follower(nursery, tmp_path, max_snapshot=limit)
        async with RpcPool(secret=member(2)) as pool:
            await pool.call(cluster.peers[1], "raft_step", payload=wire.encode_batch([]))
            with peak_rss_growth() as growth, pytest.raises(ProtocolError, match="more"):
                await _send(pool, cluster.peers[1], [bomb])
            # A header that admits to the size is refused before any data.
            honest = msgpack.packb([5, 2, 1, 100, 5, list(MEMBERS), 1 << 30])
            blob = zstandard.ZstdCompressor().compress(len(honest).to_bytes(4, "big") + honest)
            with pytest.raises(InvalidArgument, match=f"over this replica's limit of {limit}"):
                await _send(pool, cluster.peers[1], [blob], xfer=2)
            with pytest.raises(InvalidArgument, match="limit"):  # spooled bytes count too
                await _send(pool, cluster.peers[1], [os.urandom(MiB)] * 65, xfer=3)
        print(f"peak RSS growth while refusing a 1 GiB bomb: {growth[0] / MiB:.1f} MiB "
              f"(limit {limit / MiB:.0f} MiB)")
        assert growth[0] < limit + 24 * MiB, growth
        assert cluster.replicas[1].node.stats["refused"] >= 3
        nursery.cancel_scope.cancel()


async def test_an_honest_snapshot_still_installs(tmp_path: Path) -> None:
    """The whole path, in two chunks; and the limit applies to the data."""
    kv = KV()
    kv.data = {"x": 1}
    m = InstallSnapshot(3, 2, 1, Snapshot(SnapshotMeta(40, 2, MEMBERS), kv.snapshot()))
    big = os.urandom(3 * MiB)
    (tmp_path / "big").write_bytes(transfer.encode(
        InstallSnapshot(3, 2, 1, Snapshot(m.snapshot.meta, big))))
    assert transfer.decode(tmp_path / "big", 4 * MiB).snapshot.data == big
    with pytest.raises(InvalidArgument, match="over this replica's limit"):
        transfer.decode(tmp_path / "big", 2 * MiB)
    async with trio.open_nursery() as nursery:
        cluster = await _lone_follower(nursery, tmp_path, max_snapshot=4 * MiB)
        async with RpcPool(secret=member(2)) as pool:
            blob = transfer.encode(m)
            await _send(pool, cluster.peers[1], [blob[:10], blob[10:]])
        node = cluster.replicas[1].node
        with trio.fail_after(5):
            while node.applied != 40:
                await trio.sleep(0.01)
        assert cluster.replicas[1].sm.data == {"x": 1} and node.term == 3
        nursery.cancel_scope.cancel()


@pytest.mark.allow_log("cachefs.metanode.raft.driver", match=r"refused a \w+: from 3 to 1 \(sent by ")
async def test_a_message_is_taken_only_from_the_member_it_names(tmp_path: Path) -> None:
    """A message says it is from 3: only a connection authenticated as
    metanode 3 gets it in; member 2, the cluster secret's own identity and a
    client cannot speak for 3 (the client not even call raft_step)."""
    from cachefs.credentials import Credential
    from cachefs.errors import PermissionDenied
    from cachefs.metanode.raft.messages import Heartbeat

    batch = wire.encode_batch([Heartbeat(1, 3, 1, 0, 0)])
    async with trio.open_nursery() as nursery:
        _used_disk(tmp_path / "m1", 0)
        cluster = Cluster(nursery, tmp_path)
        await cluster.start(1)
        node, addr = cluster.replicas[1].node, cluster.peers[1]
        for secret in (member(2), SECRET):
            async with RpcPool(secret=secret) as pool:
                refused = node.stats["refused"]
                await pool.call(addr, "raft_step", payload=batch, timeout=5)
                assert node.stats["refused"] == refused + 1
        async with RpcPool(secret=Credential.issue(SECRET, "client", "job", ["v"])) as pool:
            with pytest.raises(PermissionDenied, match="raft_step is not allowed for client"):
                await pool.call(addr, "raft_step", payload=batch, timeout=5)
        async with RpcPool(secret=member(3)) as pool:
            refused = node.stats["refused"]
            await pool.call(addr, "raft_step", payload=batch, timeout=5)
            with trio.fail_after(5):
                while node.term < 1:  # the heartbeat of term 1 was stepped
                    await trio.sleep(0.01)
            assert node.stats["refused"] == refused
        nursery.cancel_scope.cancel()
