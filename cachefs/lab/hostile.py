"""A hostile peer for the chaos matrix: forged Raft traffic from outside the cluster.

It sends what a buggy or malicious process holding some credential of the
cluster could send a metanode: well-formed Raft messages (every kind, terms
and indices near the cluster's or at the wire's limits, any source and
destination, entry lists, commit indexes past anyone's log, snapshots of
any voters) in ``raft_step`` batches, and ``raft_snapshot`` chunks with
arbitrary numbering and bytes. It speaks over identities that are not the
members its messages name (the cluster secret's own server identity,
another server's, an admin's, a client's), so each node must refuse all of it, count
it, and go on: no node stops, nothing acknowledged is lost, nobody is
deposed. (A member gone rogue is beyond what Raft tolerates; the core's
own fuzzing of such messages is in tests/raft.) Random, not hypothesis:
this runs in ``bench.chaos``, outside the test suite.
"""

from __future__ import annotations

import collections
import random
import ssl
from dataclasses import dataclass, field

from cachefs.credentials import Credential
from cachefs.errors import CacheFSError, ProtocolError
from cachefs.metanode.raft import messages as wire
from cachefs.metanode.raft import transfer
from cachefs.metanode.raft.messages import (
    Append,
    AppendResp,
    Entry,
    EntryKind,
    Heartbeat,
    HeartbeatResp,
    InstallSnapshot,
    Message,
    Probe,
    ProbeResp,
    Snapshot,
    SnapshotMeta,
    Vote,
    VoteResp,
)
from cachefs.rpc import RpcPool

LIMITS = (2**31, 2**62, 2**63 - 1)  # msgpack's signed range: the wire's own refusal is tested elsewhere


class Forger:
    """Well-formed hostile messages near ``term`` and ``index`` (the cluster's)."""

    def __init__(self, rng: random.Random, members: tuple[int, ...], term: int, index: int) -> None:
        self.rng = rng
        self.members = members
        self.term = term
        self.index = index

    def _near(self, value: int) -> int:
        """Mostly within a few of ``value``, one in ten at a limit."""
        rng = self.rng
        return rng.choice(LIMITS) if rng.random() < 0.1 else max(0, value + rng.randint(-3, 5))

    def _id(self) -> int:
        return self.rng.choice((*self.members, *self.members, 0, max(self.members) + 1))

    def _entries(self, prev: int) -> tuple[Entry, ...]:
        return tuple(Entry(self._near(self.term), prev + 1 + k, self.rng.randbytes(self.rng.randint(0, 40)),
                           self.rng.choice((EntryKind.NORMAL, EntryKind.NOOP)))
                     for k in range(self.rng.randint(0, 4)))

    def snapshot(self) -> InstallSnapshot:
        voters = self.members if self.rng.random() < 0.5 else tuple({self._id() for _ in range(3)})
        meta = SnapshotMeta(self._near(self.index), self._near(self.term), voters)
        return InstallSnapshot(self._near(self.term), self._id(), self._id(),
                               Snapshot(meta, self.rng.randbytes(self.rng.randint(0, 256))))

    def message(self) -> Message:
        """One that the wire codec accepts (what a node really steps)."""
        while True:
            m = self._any()
            try:
                return wire.decode(wire.encode(m))
            except ProtocolError:
                continue

    def _any(self) -> Message:
        rng, t, i = self.rng, self._near(self.term), self._near(self.index)
        src, dst, flag = self._id(), self._id(), rng.random() < 0.5
        kind = rng.randrange(9)
        if kind == 0:
            return Vote(t, src, dst, i, self._near(self.term), flag)
        if kind == 1:
            return VoteResp(t, src, dst, flag, rng.random() < 0.5)
        if kind == 2:
            return Append(t, src, dst, i, self._near(self.term), self._entries(i), self._near(self.index))
        if kind == 3:
            return AppendResp(t, src, dst, i, flag, self._near(self.index), self._near(self.term))
        if kind == 4:
            return Heartbeat(t, src, dst, self._near(self.index), i)
        if kind == 5:
            return HeartbeatResp(t, src, dst, i, flag, self._near(self.index))
        if kind == 6:
            return Probe(t, src, dst, rng.getrandbits(62))
        if kind == 7:
            return ProbeResp(t, src, dst, rng.getrandbits(62))
        return self.snapshot()  # in a raft_step batch: refused, snapshots come chunked


REFUSALS = ("PermissionDenied", "InvalidArgument", "ProtocolError")  # the errors a refused call gets


@dataclass
class StormReport:
    messages: int = 0  # forged messages sent (in batches and in snapshot transfers)
    calls: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)  # by error class

    @property
    def unexpected(self) -> int:
        """Calls that failed other than by a refusal (a node not reached, or broken)."""
        return sum(n for name, n in self.errors.items() if name not in REFUSALS)


async def storm(addrs: list[str], identities: list[Credential], forger: Forger, *, rounds: int,
                tls: ssl.SSLContext | None = None) -> StormReport:
    """``rounds`` rounds: to every address, over every identity, one forged
    batch of up to 8 messages and one snapshot transfer (whole or loose
    chunks)."""
    report = StormReport()
    rng = forger.rng
    for cred in identities:
        async with RpcPool(secret=cred, tls=tls) as pool:
            for r in range(rounds):
                for addr in addrs:
                    batch = [forger.message() for _ in range(rng.randint(1, 8))]
                    calls: list[tuple[str, dict, bytes]] = [("raft_step", {}, wire.encode_batch(batch))]
                    snap = forger.snapshot()
                    if r % 2 == 0:
                        calls.append(("raft_snapshot", {"src": snap.src, "xfer": r, "chunk": 0, "chunks": 1},
                                      transfer.encode(snap)))
                    else:
                        calls.append(("raft_snapshot", {"src": snap.src, "xfer": r, "chunk": rng.randint(-1, 3),
                                                        "chunks": rng.randint(0, 3)}, rng.randbytes(64)))
                    report.messages += len(batch) + 1
                    for method, args, payload in calls:
                        report.calls += 1
                        try:
                            await pool.call(addr, method, args, payload=payload, timeout=5)
                        except CacheFSError as exc:
                            report.errors[type(exc).__name__] += 1
    return report
