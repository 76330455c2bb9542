"""No message, however forged, may crash a Raft replica.

Hypothesis builds well-formed hostile messages (``hostile.py``) and steps
them into the replicas of a small lock-step cluster (the sans-IO core: fast,
many examples) between honest ticks, proposals and compactions. After every
step each core must still hold its own invariants, and its Ready/advance
cycle must work. A message the core refuses raises ``InvalidMessage`` (the
driver logs and counts it) and changes nothing.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachefs.metanode.raft.core import InvalidMessage, RaftCore
from cachefs.metanode.raft.messages import HardState, Snapshot

from . import hostile
from .test_raft_core import CFG, Net

MEMBERS = (1, 2, 3)


class HostileNet(Net):
    """A Net whose replicas may refuse messages (forged ones poison a log,
    and an honest message can then be refused too): count, never raise."""

    def __init__(self) -> None:
        super().__init__(3)
        self.refused = 0

    def step(self, i: int, m: object) -> None:
        try:
            self.cores[i].step(m)  # type: ignore[arg-type]
        except InvalidMessage:
            self.refused += 1

    def settle(self, max_rounds: int = 50) -> None:
        for _ in range(max_rounds):
            msgs = self._drain()
            if not msgs:
                return
            self.sent += msgs
            for m in msgs:
                # A forged snapshot or CONFIG entry may name members that
                # do not exist: what is sent to them goes nowhere.
                if ((m.src, m.dst) not in self.blocked and m.dst not in self.paused
                        and m.dst in self.cores):
                    self.step(m.dst, m)


def check_core(core: RaftCore) -> None:
    log = core.log
    assert log.snap_index <= log.applied <= log.committed <= log.last_index(), (
        log.snap_index, log.applied, log.committed, log.last_index())
    assert log.stable <= log.last_index()
    for k, e in enumerate(log.entries):
        assert e.index == log.snap_index + 1 + k
    terms = [e.term for e in log.entries]
    assert terms == sorted(terms) and all(t >= log.snap_term for t in terms)
    assert core.term >= log.last_term()
    if core.is_leader:
        for pr in core.prs.values():
            assert pr.match <= log.last_index() and 1 <= pr.next <= log.last_index() + 1


actions = st.one_of(
    st.tuples(st.just("msg"), st.sampled_from(MEMBERS), st.data()),
    st.tuples(st.just("tick"), st.sampled_from(MEMBERS), st.none()),
    st.tuples(st.just("propose"), st.none(), st.none()),
    st.tuples(st.just("compact"), st.sampled_from(MEMBERS), st.none()),
    st.tuples(st.just("wipe"), st.sampled_from(MEMBERS), st.none()),
)


@settings(max_examples=1000, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(script=st.lists(actions, min_size=1, max_size=30))
def test_hostile_messages_never_crash_a_core(script: list) -> None:
    net = HostileNet()
    net.elect(1)
    for k in range(3):
        net.cores[1].propose([hostile.command(9, k + 1)])
        net.settle()
    for action, target, data in script:
        if action == "msg":
            net.step(target, data.draw(hostile.messages(MEMBERS, dst=target)))
        elif action == "tick":
            net.cores[target].tick()
        elif action == "propose":
            for c in net.cores.values():
                if c.is_leader:
                    c.propose([hostile.command(8, len(net.sent))])
        elif action == "compact":
            c = net.cores[target]
            if c.applied > c.log.snap_index:
                c.compact(Snapshot(c.snapshot_meta(c.applied), b"state"))
        else:  # a new disk: discovering, then maybe rebuilding
            net.cores[target] = RaftCore(target, list(MEMBERS), rng=random.Random(target),
                                         config=CFG, hard_state=HardState(discovering=True))
        net.settle()
        for c in net.cores.values():
            check_core(c)
