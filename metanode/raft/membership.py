"""Cluster membership: who votes, who catches up, and how it may change.

Theory of operation (Ongaro's thesis, chapter 4: single-server changes)
-----------------------------------------------------------------------
A configuration is a log entry (``EntryKind.CONFIG``, its data encoded
here). A replica uses the newest configuration *in its log*, committed or
not, from the moment it is appended; a conflicting append that cuts it off
reverts to the one before (``core.py`` keeps the list). A snapshot carries
the configuration at its index (``SnapshotMeta``), so compaction loses none.

Voters change by at most one server per entry: then every majority of the
old voters overlaps every majority of the new ones, and no two leaders can
be elected in one term from the two sides of a change. A leader proposes a
change only once it has committed an entry of its own term and no change is
uncommitted (the fix for the bug Ongaro reported on raft-dev in 2015: without
it a leader of a newer term could append a change that conflicts with an
uncommitted one of an older leader and both commit).

A new server first joins as a *learner*: it gets the log but neither votes
in quorums nor stands for election, so adding it cannot stall commits while
it copies a large log. The leader promotes it to voter once it has caught up
(``core.py``: its match reached the leader's commit index in the current
term). ``addrs`` gives each member's "host:port" for the driver; the core
only looks at ids.

Learners may change freely (they count in no quorum); the node ids here
stay small positive ints (0 is "none").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]

from cachefs.errors import InvalidArgument, ProtocolError


@dataclass(frozen=True, slots=True)
class Membership:
    """One configuration; ``voters`` and ``learners`` sorted and disjoint."""

    voters: tuple[int, ...]
    learners: tuple[int, ...] = ()
    addrs: tuple[tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        ids = (*self.voters, *self.learners)
        if any(type(i) is not int or i <= 0 for i in ids) or len(set(ids)) != len(ids):
            raise InvalidArgument(f"raft membership: ids must be distinct positive ints, got "
                                  f"voters {self.voters} and learners {self.learners}")
        if list(self.voters) != sorted(self.voters) or list(self.learners) != sorted(self.learners):
            raise InvalidArgument("raft membership: voters and learners must be sorted")

    @classmethod
    def of(cls, voters: Any, learners: Any = (), addrs: dict[int, str] | None = None) -> Membership:
        return cls(tuple(sorted(voters)), tuple(sorted(learners)),
                   tuple(sorted((addrs or {}).items())))

    @property
    def members(self) -> tuple[int, ...]:
        return (*self.voters, *self.learners)

    @property
    def quorum(self) -> int:
        return len(self.voters) // 2 + 1

    def addr_map(self) -> dict[int, str]:
        return dict(self.addrs)

    def _with(self, voters: Any, learners: Any, addrs: dict[int, str]) -> Membership:
        return Membership.of(voters, learners, addrs)

    def add_learner(self, node_id: int, addr: str) -> Membership:
        """Raises: InvalidArgument: ``node_id`` is already a member."""
        if node_id in self.members:
            raise InvalidArgument(f"metanode {node_id} is already a member")
        return self._with(self.voters, (*self.learners, node_id),
                          {**self.addr_map(), node_id: addr})

    def promote(self, node_id: int) -> Membership:
        """Raises: InvalidArgument: ``node_id`` is not a learner."""
        if node_id not in self.learners:
            raise InvalidArgument(f"metanode {node_id} is not a learner")
        return self._with((*self.voters, node_id),
                          (i for i in self.learners if i != node_id), self.addr_map())

    def remove(self, node_id: int) -> Membership:
        """Raises: InvalidArgument: not a member, or the last voter."""
        if node_id not in self.members:
            raise InvalidArgument(f"metanode {node_id} is not a member")
        if self.voters == (node_id,):
            raise InvalidArgument(f"metanode {node_id} is the only voter; it cannot be removed")
        addrs = {i: a for i, a in self.addrs if i != node_id}
        return self._with((i for i in self.voters if i != node_id),
                          (i for i in self.learners if i != node_id), addrs)


def check_change(old: Membership, new: Membership) -> None:
    """The single-server rule.

    Raises:
        InvalidArgument: no voters left, or voters differ by more than one.
    """
    if not new.voters:
        raise InvalidArgument("raft membership: a configuration needs a voter")
    changed = set(old.voters) ^ set(new.voters)
    if len(changed) > 1:
        raise InvalidArgument(f"raft membership: voters {old.voters} -> {new.voters} change "
                              f"{len(changed)} servers at once; one at a time")


def encode(m: Membership) -> bytes:
    return msgpack.packb([list(m.voters), list(m.learners), [list(a) for a in m.addrs]],
                         use_bin_type=True)


def from_lists(voters: Any, learners: Any, addrs: Any) -> Membership:
    """Raises: ProtocolError: not lists of ids and [id, "host:port"] pairs."""
    if type(voters) is not list or type(learners) is not list or type(addrs) is not list:
        raise ProtocolError("raft membership: voters, learners and addrs must be lists")
    for v in (*voters, *learners):
        if type(v) is not int or not 0 < v < 1 << 62:
            raise ProtocolError(f"raft membership: bad node id {v!r}")
    pairs: dict[int, str] = {}
    for a in addrs:
        if (type(a) is not list or len(a) != 2 or type(a[0]) is not int
                or type(a[1]) is not str or len(a[1]) > 300):
            raise ProtocolError("raft membership: an address must be [id, 'host:port']")
        pairs[a[0]] = a[1]
    try:
        return Membership.of(voters, learners, pairs)
    except InvalidArgument as exc:
        raise ProtocolError(exc.message) from None


def decode(data: bytes) -> Membership:
    """Raises: ProtocolError: not a configuration this module wrote."""
    try:
        raw = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"raft membership: undecodable ({exc})") from None
    if type(raw) is not list or len(raw) != 3:
        raise ProtocolError("raft membership: must be [voters, learners, addrs]")
    return from_lists(*raw)
