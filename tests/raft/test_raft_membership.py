"""Scripted single-server membership changes on the sans-IO core (the
randomised mix with crashes, partitions and snapshots is in test_raft_sim)."""

from __future__ import annotations

import random

import pytest

from cachefs.errors import Busy, InvalidArgument, ProtocolError
from cachefs.metanode.raft import membership
from cachefs.metanode.raft import messages as wire
from cachefs.metanode.raft.core import RaftCore, Role
from cachefs.metanode.raft.membership import Membership
from cachefs.metanode.raft.messages import InstallSnapshot, Snapshot, SnapshotMeta

from .test_raft_core import CFG, Net


def join(net: Net, i: int) -> RaftCore:
    """A replica with an empty disk that joins (no configuration of its own)."""
    core = RaftCore(i, [], rng=random.Random(i), config=CFG)
    net.cores[i] = core
    net.ids.append(i)
    net.applied[i], net.reads[i], net.commits[i] = [], [], []
    return core


def elect_and_write(net: Net, n: int = 5) -> RaftCore:
    leader = net.elect(1)
    for k in range(n):
        leader.propose([f"c{k}".encode()])
    net.settle()
    return leader


def test_a_learner_catches_up_then_the_leader_promotes_it() -> None:
    net = Net(3)
    leader = elect_and_write(net)
    new = join(net, 4)
    net.isolate(4)  # not running yet
    leader.propose_membership(leader.membership.add_learner(4, "h4:7100"))
    net.settle()
    assert leader.learners == (4,) and leader.quorum == 2
    leader.propose([b"while 4 is away"])  # a learner counts in no quorum
    net.tick(30)
    assert leader.learners == (4,), "promoted without having caught up"
    assert net.cores[2].committed == leader.log.last_index()
    net.heal()
    net.tick(25)
    assert leader.voters == (1, 2, 3, 4) and leader.quorum == 3 and not leader.learners
    assert new.membership == leader.membership
    assert new.membership.addr_map()[4] == "h4:7100"
    assert [e.data for e in net.applied[4]] == [e.data for e in net.applied[1]]
    assert new.role is Role.FOLLOWER and new.lead == 1


def test_one_voter_at_a_time_and_one_change_at_a_time() -> None:
    net = Net(3)
    leader = elect_and_write(net)
    with pytest.raises(InvalidArgument, match="one at a time"):
        leader.propose_membership(Membership.of([1, 2, 3, 4, 5]))
    with pytest.raises(InvalidArgument, match="only voter"):
        Membership.of([1]).remove(1)
    net.isolate(1)
    leader.propose_membership(leader.membership.remove(3))
    net.settle()
    with pytest.raises(Busy):  # the first is not committed
        leader.propose_membership(leader.membership.add_learner(4, "h4:1"))


def test_a_new_leader_changes_nothing_before_its_first_commit() -> None:
    """Ongaro's 2015 fix: until the entry of its own term commits, a new
    leader may not append a configuration."""
    net = Net(3)
    old = elect_and_write(net)
    old._become_follower(old.term, 0)  # it stalled; the others' leases ran out
    for i in (1, 3):
        net.cores[i].election_elapsed = CFG.election_tick
    core = net.cores[2]
    core.campaign()
    while not core.is_leader:  # votes out and back, but no Append answered yet
        for m in net._drain():
            if not (m.src == 2 and m.dst != 2 and type(m).__name__ == "Append"):
                net.cores[m.dst].step(m)
    assert core.committed < core.log.last_index()
    with pytest.raises(Busy):
        core.propose_membership(core.membership.remove(3))
    net.settle()
    core.propose_membership(core.membership.remove(3))


def test_a_removed_leader_leads_until_the_change_commits_then_stands_aside() -> None:
    net = Net(3)
    leader = elect_and_write(net)
    index, _ = leader.propose_membership(leader.membership.remove(1))
    assert leader.voters == (2, 3) and leader.is_leader  # in effect at once
    net.settle()
    assert leader.committed >= index and not leader.is_leader
    assert net.cores[2].committed >= index and net.cores[3].committed >= index
    net.tick(40)
    assert 1 not in net.leaders() and len(net.leaders()) == 1
    new = net.cores[net.leaders()[0]]
    new.propose([b"after"])
    net.tick(2)  # the follower learns the commit with the next heartbeat
    assert net.applied[2][-1].data == net.applied[3][-1].data == b"after"


def test_a_configuration_is_used_when_appended_and_dropped_when_cut() -> None:
    net = Net(3)
    leader = elect_and_write(net)
    net.isolate(1)
    leader.propose_membership(leader.membership.remove(3))
    assert leader.voters == (1, 2)  # uncommitted, in effect
    net.tick(30)  # 2 and 3 elect a leader without it
    others = [i for i in net.leaders() if i != 1]
    assert others
    net.cores[others[0]].propose([b"newer"])
    net.settle()
    net.heal()
    net.tick(5)
    assert leader.voters == (1, 2, 3) and not leader.is_leader  # cut off: reverted
    assert net.applied[1][-1].data == b"newer"


def test_a_removed_server_that_missed_its_removal_cannot_disrupt() -> None:
    net = Net(3)
    leader = elect_and_write(net)
    net.blocked = {(1, 3)}  # 3 never hears of its removal
    leader.propose_membership(leader.membership.remove(3))
    net.settle()
    term = leader.term
    net.tick(60)  # 3 times out again and again
    assert net.cores[3].voters == (1, 2, 3)
    assert leader.is_leader and leader.term == term and net.cores[2].lead == 1


def test_a_snapshot_carries_the_configuration_to_a_new_replica() -> None:
    net = Net(3)
    leader = elect_and_write(net)
    join(net, 4)
    net.isolate(4)
    leader.propose_membership(leader.membership.add_learner(4, "h4:7100"))
    for k in range(10):
        leader.propose([f"more{k}".encode()])
        net.settle()
    snap = Snapshot(leader.snapshot_meta(leader.applied), b"state")
    assert snap.meta.learners == (4,) and snap.meta.membership == leader.membership
    leader.compact(snap)
    net.heal()
    net.tick(25)
    assert any(isinstance(m, InstallSnapshot) and m.dst == 4 for m in net.sent)
    assert net.cores[4].membership == leader.membership and 4 in leader.voters


def test_membership_encoding_is_checked() -> None:
    m = Membership.of([1, 2, 3], [4], {4: "h:1"})
    assert membership.decode(membership.encode(m)) == m
    for bad in (b"", b"\x93\x91\x00\x90\x90", b"\x93\x91\x01\x91\x01\x90"):
        with pytest.raises(ProtocolError):
            membership.decode(bad)
    snap = Snapshot(SnapshotMeta.at(9, 2, m), b"x")
    m2 = wire.decode(wire.encode(InstallSnapshot(3, 1, 2, snap)))
    assert isinstance(m2, InstallSnapshot) and m2.snapshot == snap


def test_a_new_cluster_grows_from_one_metanode_without_waiting_for_all() -> None:
    """One voter elects itself at once (a new disk of a 3-voter configuration
    waits for both peers); the others join as learners and are promoted."""
    net = Net(1)
    leader = net.cores[1]
    net.tick(25)
    assert leader.is_leader
    for i in (2, 3):
        join(net, i)
        net.settle()
        leader.propose_membership(leader.membership.add_learner(i, f"h{i}:1"))
        net.tick(25)
        assert i in leader.voters
    assert leader.voters == (1, 2, 3) and leader.quorum == 2
    net.isolate(3)  # a majority of the grown cluster goes on without one
    leader.propose([b"x"])
    net.tick(2)
    assert net.applied[2][-1].data == b"x"
