"""A replica rebuilt from an empty data directory must catch up, safely.

The operator's recovery from a damaged WAL or snapshot, or a lost disk, is to
restart the replica empty (docs/raft.md). The leader still believes the
replica holds everything it acknowledged (its ``match``), and its own log is
compacted, so the replica can only come back through a snapshot. These
scenarios check that it does, whether or not new writes arrive and even when
the first snapshot is lost on the way; and that until then its forgotten
votes and acknowledgements cannot elect a leader missing committed entries,
nor let a stale leader commit over them (it asks its peers' terms first, and
votes for nobody until caught up).
"""

from __future__ import annotations

import random

import pytest

from cachefs.metanode.raft.core import RaftCore
from cachefs.metanode.raft.messages import HardState, InstallSnapshot, Message, Snapshot

from .test_raft_core import CFG, Net


class LossyNet(Net):
    """A Net that can drop the next ``n`` InstallSnapshot messages to a node."""

    def __init__(self, n: int = 3) -> None:
        super().__init__(n)
        self.drop_snapshots: dict[int, int] = {}

    def settle(self, max_rounds: int = 50) -> None:
        for _ in range(max_rounds):
            msgs = self._drain()
            if not msgs:
                return
            self.sent += msgs
            for m in msgs:
                if self._lost(m):
                    continue
                if (m.src, m.dst) not in self.blocked and m.dst not in self.paused:
                    self.cores[m.dst].step(m)

    def _lost(self, m: Message) -> bool:
        if isinstance(m, InstallSnapshot) and self.drop_snapshots.get(m.dst, 0) > 0:
            self.drop_snapshots[m.dst] -= 1
            return True
        return False

    def wipe(self, i: int) -> None:
        """Restart node ``i`` with nothing on disk."""
        self.cores[i] = RaftCore(i, self.ids, rng=random.Random(100 + i), config=CFG,
                                 hard_state=HardState(discovering=True))


def _compacted_cluster(writes: int = 20, *, lag: bool = False) -> tuple[LossyNet, RaftCore]:
    net = LossyNet(3)
    leader = net.elect(1)
    for k in range(writes):
        leader.propose([f"c{k}".encode()])
        net.settle()
    if lag:  # node 3 down for a while: the leader's Appends to it are lost
        net.isolate(3)
        for k in range(writes):
            leader.propose([f"d{k}".encode()])
            net.settle()
    for c in net.cores.values():
        c.compact(Snapshot(c.snapshot_meta(c.applied), b"state"))
    assert leader.log.first_index() > 2
    return net, leader


def _caught_up(net: Net, i: int, leader: RaftCore) -> bool:
    c = net.cores[i]
    return c.committed == leader.committed and c.log.last_index() == leader.log.last_index()


@pytest.mark.parametrize("lag", [False, True])
@pytest.mark.parametrize("lost_snapshots", [0, 1, 2])
@pytest.mark.parametrize("writes_after", [0, 1, 5])
def test_wiped_follower_catches_up(lag: bool, lost_snapshots: int, writes_after: int) -> None:
    net, leader = _compacted_cluster(lag=lag)
    net.wipe(3)
    net.heal()
    net.drop_snapshots[3] = lost_snapshots
    for k in range(writes_after):
        leader.propose([f"e{k}".encode()])
        net.settle()
    # A lost snapshot is resent after two election timeouts of silence.
    for _ in range(CFG.election_tick * (2 * lost_snapshots + 2)):
        net.tick()
        if _caught_up(net, 3, leader) and net.drop_snapshots[3] == 0:
            break
    assert leader.is_leader
    assert net.drop_snapshots[3] == 0
    assert _caught_up(net, 3, leader), (net.cores[3].committed, leader.committed)
    assert net.cores[3].log.snap_index >= leader.log.snap_index
    # And it keeps replicating afterwards.
    leader.propose([b"after"])
    net.settle()
    net.tick()  # followers learn the new commit with the next heartbeat
    assert _caught_up(net, 3, leader)


def test_wiped_follower_is_not_flooded_with_snapshots() -> None:
    """While a snapshot is in flight the leader must not resend it per heartbeat."""
    net, leader = _compacted_cluster()
    net.wipe(3)
    net.paused.add(3)  # the replica is slow to install: nothing comes back
    net.tick(CFG.election_tick - 1, only=[1, 2])
    net.paused.discard(3)
    before = sum(isinstance(m, InstallSnapshot) and m.dst == 3 for m in net.sent)
    net.tick(CFG.election_tick)
    after = sum(isinstance(m, InstallSnapshot) and m.dst == 3 for m in net.sent)
    assert after - before <= 1
    assert _caught_up(net, 3, leader)


def test_wiped_replica_cannot_elect_a_stale_candidate() -> None:
    """Node 3 misses entries that 1 and 2 committed; 2 is wiped and 1 stalls.

    Node 2's vote would make 3 leader without them (committed entries lost,
    and the old leader's acknowledgements would point past the new leader's
    log). Node 2 hears only 3's term: not enough to take part at all.
    """
    net, leader = _compacted_cluster()
    net.isolate(3)
    for k in range(5):
        leader.propose([f"x{k}".encode()])
        net.settle()
    committed = leader.committed
    assert net.cores[3].log.last_index() < committed
    net.wipe(2)
    net.paused.add(1)
    net.heal()
    net.tick(CFG.election_tick * 4, only=[2, 3])
    assert not net.cores[3].is_leader and not net.cores[2].is_leader
    net.paused.discard(1)
    for _ in range(CFG.election_tick * 6):
        net.tick()
        ls = net.leaders()
        if ls and _caught_up(net, 2, net.cores[ls[0]]) and _caught_up(net, 3, net.cores[ls[0]]):
            break
    (lead,) = net.leaders()
    assert lead != 3
    assert net.cores[lead].committed >= committed
    for i in (2, 3):
        assert _caught_up(net, i, net.cores[lead])


def test_bootstrap_with_empty_logs_still_elects() -> None:
    net = Net(3)
    net.tick(CFG.election_tick * 3)
    assert len(net.leaders()) == 1


def test_a_wiped_replica_and_an_empty_one_cannot_elect_each_other() -> None:
    """Node 3 never received anything; 1 and 2 committed entries, then 2's
    disk was lost and 1 is down. Both 2 and 3 have empty logs, so each looks
    up to date to the other (the old rule, "an empty log votes only for an
    empty log", let 2 elect 3 and lose every committed entry)."""
    net = LossyNet(3)
    net.isolate(3)
    leader = net.elect(1)
    for k in range(5):
        leader.propose([f"x{k}".encode()])
        net.settle()
    committed = leader.committed
    assert net.cores[3].log.last_index() == 0 and committed >= 6
    net.wipe(2)
    net.paused.add(1)
    net.heal()
    net.tick(CFG.election_tick * 6, only=[2, 3])
    assert not net.cores[2].is_leader and not net.cores[3].is_leader
    assert net.cores[2].discovering
    net.paused.discard(1)
    for _ in range(CFG.election_tick * 8):
        net.tick()
        ls = net.leaders()
        if ls and all(_caught_up(net, i, net.cores[ls[0]]) for i in (2, 3)):
            break
    (lead,) = net.leaders()
    assert lead == 1 and net.cores[1].committed >= committed
    assert not net.cores[2].rebuilding and _caught_up(net, 2, net.cores[1])


def test_a_wiped_replica_does_not_let_a_stale_leader_commit() -> None:
    """Node 1 leads term 1, is cut off and stalls (it never notices); 2 and 3
    elect 2 in term 2 and commit. Then 3's disk is lost and 3 can reach only
    1. Were 3 to follow 1 (term 1 is newer than the nothing it remembers),
    1 would commit its own entries at the indexes 2 committed in term 2."""
    net = LossyNet(3)
    old = net.elect(1)
    net.isolate(1)
    net.tick(CFG.election_tick * 4, only=[2, 3])
    new = net.cores[2] if net.cores[2].is_leader else net.cores[3]
    assert new.is_leader and new.term > old.term and old.is_leader
    new.propose([b"committed in the new term"])
    net.settle()
    net.tick(1, only=[2, 3])
    committed = new.committed
    third = 5 - new.id  # the follower of the new leader
    net.wipe(third)
    net.blocked = {(a, b) for a in net.ids for b in net.ids
                   if a != b and new.id in (a, b)}  # the new leader is cut off now
    for k in range(3):
        old.propose([f"stale {k}".encode()])
        net.tick(2, only=[old.id, third])  # heartbeats: 1 keeps a quorum if 3 answers
    assert old.committed < committed or old.log.term(committed) == new.log.term(committed)
    assert net.cores[third].discovering and net.cores[third].log.last_index() == 0
    net.heal()
    for _ in range(CFG.election_tick * 8):
        net.tick()
        if not net.cores[third].discovering and not net.cores[third].rebuilding:
            break
    (lead,) = net.leaders()
    for i in net.ids:
        assert net.cores[i].log.term(committed) == new.log.term(committed)
