"""Metadata read leases: which sessions may answer from memory, and what a mutation waits for.

Theory of operation
-------------------
A *lease* is the leader's promise to a client session about one inode of its
volume: "before any change to this inode's attributes, extended attributes,
content or (for a directory) entries is applied, you will be told, and the
change waits for your acknowledgement or for your lease to lapse". While it
holds a lease the client answers lookup, getattr, getxattr and open from its
own memory and gives the kernel long timeouts (``client/leases.py``). This is
NFSv4's read delegation and CephFS's shared capability, per inode.

This class is the leader's bookkeeping, sans-IO: time enters as ``now``
(``time.monotonic`` of the leader), nothing here awaits or sends; the service
(``metanode/service.py``) drives it and carries the messages. It is soft
state, like :class:`~.opentable.OpenTable`: nothing is replicated, and a new
leader starts empty (see *Failover*).

Per ``(session, inode)`` the state is NONE, HELD or REVOKING, moved only by
the events of :data:`TRANSITIONS`:

- GRANT: a read by the session (``LeaseLookup``, ``LeaseGetAttr``,
  ``LeaseOpen``, ``LoadDir``) answers with the inode's state and a grant,
  unless a mutation of the inode is in flight (then the read is answered
  without one). A REVOKING lease is not granted again before it is acked.
- REVOKE: a mutation is about to change the inode (:meth:`begin`). Every
  lease on it other than the mutator's own ones it declared dropped becomes
  REVOKING with a fresh revocation id, which the holder's next poll returns.
  The mutator's own leases it declares *kept* stay HELD (see :meth:`begin`).
- ACK (by id: a late or repeated ack of an older revocation changes nothing),
  DROP (the client let the lease go, its kernel caches invalidated first)
  and END (the session ended) return it to NONE.

Time: a session's leases are renewed together by its polls (``renew``); a
HELD lease lapses ``term`` seconds after the later of the session's last
renewal and its last grant. The client counts from when it *sent* the
request that granted or renewed (before the leader received it), so its
copy always lapses first (clock rates assumed equal, as with Raft's leader
lease; the client keeps a margin). A REVOKING lease keeps the deadline it
had when revoked: a mutation waits for the ack or that deadline, whichever
comes first (a frozen or dead holder delays it by at most ``term``). A lapsed
lease is not forgotten: it stays REVOKING until the holder acks it, so the
holder's next poll reply names it and the holder cannot take the poll for a
renewal of it.

Unacknowledged revocations and opens: a client opens a leased file without
telling the leader (``client/session.py``); it reports the open when it
gives the lease up (in the ack, the drop, or the mutation that dropped it).
A lease that lapsed unacknowledged may hide such an open, so :meth:`blocked`
hands those ``(session, ino)`` back as *possibly open*: the service counts
them as opens, erring on the side of keeping data.

Name resolution: a mutation's inodes are predicted from the state before it
is proposed (``MetaState.touched``), but mutations ahead of it in the log
may change what a name resolves to by the time it applies. Such a change is
itself a mutation that touches the inode it moves or links, so the apply
hook (:meth:`applied`) marks every inode an apply touched while an older
prediction is in flight, with the inodes that apply named (``named``: the
directories whose entries it changed are among them). A marked inode is not
granted while a mutation predicted before that apply is in flight and
resolves names in one of those directories (its ``scope``: the parents of
its ``(parent, name)`` entries; None, anywhere in the volume, for one that
walks paths, an import). Why that is enough: say mutation M, predicted at
clock c, resolves its entry ``(d, n)`` at its apply to an inode i it did not
predict. The last apply X before M's that changed what ``(d, n)`` names
came after c (else M predicted i) and named d, since a command changes
entries only in directories it names (``commands.inode_refs``); and it
touched i (it made ``(d, n)`` name i). So i was marked at X's apply, with d
among the named, and M, in flight since before it, names d: no grant on i
between X's apply and M's end. Leases on i granted before X began were
revoked by X, and none was granted while X was in flight (``pending``).
Hence at the apply of any mutation no lease other than its mutator's kept
ones exists on what it actually changes. A mutation that names i itself
(``ino``) predicted it: i is ``pending`` until it ends. A create in one
directory therefore gets its lease while creates and commits elsewhere in
the volume are in flight (an unscoped rule refused it whenever any older
mutation of the volume was).

Failover: a new leader (any change of term) knows no lease. Leases the old
leader granted lapse at most ``term`` after it stopped confirming its
leadership, which is before this leader was elected, so a mutation waits
until ``grace_until`` (``term`` after this table was reset) -- unless every
session of the volume that may take leases (``MountVolume.leases``; the
native API's take none) has polled this leader saying it holds no lease of
an older term (it dropped them, invalidating its kernel caches first), which
ends the wait for that volume early, waiting mutations included (``renew``
says when a session turns clean). The service answers a poll of an older
term at once, so that takes two round trips after a session finds the new
leader, not a parked poll. A poll says so with ``held_term``: the
newest leader term the session knew when it built the poll. That is a claim
that stays true while the poll is in flight: the session never takes a
lease of an older term than one it knows. "I hold no lease now" would not
be: the old leader parks a poll for up to a quarter term, the session takes
leases meanwhile, and the client retries the same poll on the new leader.
Grants need no grace: read leases never conflict with each other.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

DEFAULT_TERM = 8.0  # seconds a lease lasts without a renewal


class State(enum.Enum):
    NONE = "none"
    HELD = "held"
    REVOKING = "revoking"


class Event(enum.Enum):
    GRANT = "grant"
    REVOKE = "revoke"
    ACK = "ack"
    DROP = "drop"
    END = "end"


# (state, event) -> next state. Missing pairs change nothing: acks, drops and
# revocations arrive over the network and may be late or repeated. GRANT of a
# REVOKING lease is refused by ``grant`` (the holder acks first).
TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.NONE, Event.GRANT): State.HELD,
    (State.HELD, Event.GRANT): State.HELD,
    (State.HELD, Event.REVOKE): State.REVOKING,
    (State.REVOKING, Event.REVOKE): State.REVOKING,
    (State.REVOKING, Event.ACK): State.NONE,
    (State.HELD, Event.DROP): State.NONE,
    (State.REVOKING, Event.DROP): State.NONE,
    (State.HELD, Event.END): State.NONE,
    (State.REVOKING, Event.END): State.NONE,
}


@dataclass(slots=True)
class Revocation:
    id: int
    deadline: float  # when the holder's lease lapses if it does not ack


@dataclass(slots=True)
class Holder:
    """One session's leases."""

    volume: str
    renewed: float
    last_grant: float = 0.0
    held: set[int] = field(default_factory=set)
    revoking: dict[int, Revocation] = field(default_factory=dict)
    clean: bool = False  # holds no lease of an older leader (see Failover)

    def state(self, ino: int) -> State:
        if ino in self.held:
            return State.HELD
        if ino in self.revoking:
            return State.REVOKING
        return State.NONE


@dataclass(slots=True)
class Mutation:
    """A mutation between :meth:`LeaseTable.begin` and :meth:`LeaseTable.end`."""

    id: int
    volume: str
    inos: frozenset[int]
    seq: int  # the apply clock when its inodes were predicted
    scope: frozenset[int] | None  # directories it resolves names in (None: any)
    waits: dict[tuple[str, int], int] = field(default_factory=dict)  # -> revocation id
    possibly_open: list[tuple[str, int]] = field(default_factory=list)


class LeaseTable:
    """Leases of every session, on the leader; see the module docstring."""

    def __init__(self, term: float = DEFAULT_TERM) -> None:
        if term <= 0:
            raise ValueError("the lease term must be positive")
        self.term = term
        self.holders: dict[str, Holder] = {}
        # (volume, ino) -> sessions holding it HELD or REVOKING
        self.by_inode: dict[tuple[str, int], set[str]] = {}
        self.pending: dict[tuple[str, int], int] = {}  # mutations in flight per inode
        self.mutations: dict[int, Mutation] = {}
        # volume -> its mutations in flight, in begin order: seq never falls,
        # so the first is the oldest prediction (O(1), not a scan per apply).
        self._by_volume: dict[str, dict[int, Mutation]] = {}
        # volume -> ino -> (apply clock, inodes named by the applies that marked it)
        self.marks: dict[str, dict[int, tuple[int, frozenset[int]]]] = {}
        # volume -> (apply clock, ino) as marked, oldest first: what ``end`` unmarks.
        self._mark_order: dict[str, deque[tuple[int, int]]] = {}
        self.clock = 0  # counts applies (see Name resolution)
        self.grace_until = 0.0
        self.leader_term = 0
        self._ids = itertools.count(1)
        # Since start, across leaderships (metrics): leases granted (NONE ->
        # HELD), revocations begun (HELD -> REVOKING), and grants refused
        # because the inode was changing or its name could still move.
        self.granted = 0
        self.revoked = 0
        self.refused_changing = 0
        self.refused_moving = 0

    # -- the state machine ---------------------------------------------------------

    def _step(self, session: str, holder: Holder, ino: int, event: Event, rev: int = 0) -> State:
        """Move ``(session, ino)`` by ``event`` (see TRANSITIONS); the new state."""
        now_state = holder.state(ino)
        if event is Event.ACK and now_state is State.REVOKING and holder.revoking[ino].id != rev:
            return now_state  # the ack of an older revocation
        new = TRANSITIONS.get((now_state, event), now_state)
        if new is now_state:
            return new
        key = (holder.volume, ino)
        holder.held.discard(ino)
        holder.revoking.pop(ino, None)
        if new is State.HELD:
            holder.held.add(ino)
            self.granted += 1
        elif new is State.REVOKING:
            holder.revoking[ino] = Revocation(rev, self.lapse(holder))
            self.revoked += 1
        if new is State.NONE:
            sessions = self.by_inode.get(key)
            if sessions is not None:
                sessions.discard(session)
                if not sessions:
                    del self.by_inode[key]
        elif now_state is State.NONE:
            self.by_inode.setdefault(key, set()).add(session)
        return new

    def lapse(self, holder: Holder) -> float:
        """When the holder's HELD leases lapse without another renewal or grant."""
        return max(holder.renewed, holder.last_grant) + self.term

    def state(self, session: str, ino: int) -> State:
        holder = self.holders.get(session)
        return State.NONE if holder is None else holder.state(ino)

    # -- leadership ----------------------------------------------------------------

    def reset(self, now: float, leader_term: int) -> None:
        """A new leader (a new Raft term): nothing is known; see Failover."""
        self.holders.clear()
        self.by_inode.clear()
        self.pending.clear()
        self.mutations.clear()
        self._by_volume.clear()
        self.marks.clear()
        self._mark_order.clear()
        self.grace_until = now + self.term
        self.leader_term = leader_term

    def mounted(self, session: str, volume: str, now: float) -> None:
        """A session opened through this leader holds nothing of an older one."""
        self._holder(session, volume, now).clean = True

    def _holder(self, session: str, volume: str, now: float) -> Holder:
        holder = self.holders.get(session)
        if holder is None:
            holder = self.holders[session] = Holder(volume, renewed=now)
        return holder

    def end_session(self, session: str) -> None:
        holder = self.holders.pop(session, None)
        if holder is None:
            return
        for ino in [*holder.held, *holder.revoking]:
            self._step(session, holder, ino, Event.END)

    # -- grants and polls ------------------------------------------------------------

    def grantable(self, volume: str, ino: int) -> bool:
        """No mutation of ``ino`` is in flight, nor can one predicted before
        an apply that touched it still resolve a name to it (see Name
        resolution)."""
        if (volume, ino) in self.pending:
            self.refused_changing += 1
            return False
        marks = self.marks.get(volume)
        mark = marks.get(ino) if marks is not None else None
        if mark is None:
            return True
        seq, named = mark
        for m in self._by_volume.get(volume, {}).values():  # oldest prediction first
            if m.seq > seq:
                break
            if m.scope is None or not m.scope.isdisjoint(named):
                self.refused_moving += 1
                return False
        return True

    def _oldest_prediction(self, volume: str) -> int:
        inflight = self._by_volume.get(volume)
        return next(iter(inflight.values())).seq if inflight else self.clock + 1

    def grant(self, session: str, volume: str, inos: Iterable[int], now: float) -> tuple[int, ...]:
        """Grant ``session`` what it may have of ``inos``; the granted ones.
        The caller read the inodes' state at ``now`` as leader (confirmed)."""
        holder = self._holder(session, volume, now)
        if holder.volume != volume:
            return ()
        granted = []
        for ino in inos:
            if ino in holder.revoking or not self.grantable(volume, ino):
                continue
            self._step(session, holder, ino, Event.GRANT)
            granted.append(ino)
        if granted:
            holder.last_grant = max(holder.last_grant, now)
        return tuple(granted)

    def acknowledge(self, session: str, acks: Iterable[int], drops: Iterable[int]) -> bool:
        """Revocations the session acknowledged (by id) and leases it let go
        (by inode); True if a revocation was acknowledged (a mutation may go on)."""
        holder = self.holders.get(session)
        if holder is None:
            return False
        done = False
        by_id = {r.id: ino for ino, r in holder.revoking.items()}
        for rev in acks:
            ino = by_id.get(rev)
            if ino is not None:
                self._step(session, holder, ino, Event.ACK, rev)
                done = True
        for ino in drops:
            done |= holder.state(ino) is State.REVOKING
            self._step(session, holder, ino, Event.DROP)
        return done

    def renew(self, session: str, volume: str, now: float, held_term: int) -> bool:
        """A poll the leader confirmed it may answer, received at ``now``:
        every HELD lease of the session lasts ``term`` from then. ``held_term``:
        the poll's, see Failover. True if the session is clean only from
        now on (a mutation waiting out the grace may go on sooner)."""
        holder = self._holder(session, volume, now)
        holder.renewed = max(holder.renewed, now)
        if held_term == self.leader_term and not holder.clean:
            holder.clean = True
            return True
        return False

    def revocations(self, session: str) -> list[tuple[int, int]]:
        """``(revocation id, ino)`` of every lease of the session being
        revoked (lapsed ones included): what its poll returns."""
        holder = self.holders.get(session)
        if holder is None:
            return []
        return [(r.id, ino) for ino, r in holder.revoking.items()]

    # -- mutations -----------------------------------------------------------------

    def begin(
        self,
        volume: str,
        inos: Iterable[int],
        now: float,
        mutator: str | None = None,
        kept: Iterable[int] = (),
        scope: Iterable[int] | None = None,
    ) -> tuple[Mutation, set[str]]:
        """A mutation of ``inos`` is about to be proposed: revoke every lease
        on them but the mutator's ``kept`` ones (it knows what it changes and
        forgets what that makes stale; its kernel updates its own caches, and
        the lease stays as it is so that later changes by others still reach
        it). A kept lease being revoked for another mutation is not waited
        for either: that one still waits for the ack, and the holder's ack may
        wait for this one (its kernel holds the directory's lock while the
        change is in flight). ``scope``: the directories in which it resolves
        names when it applies (None: anywhere; see Name resolution). Returns
        the mutation and the sessions that now have a revocation to hear about."""
        m = Mutation(next(self._ids), volume, frozenset(inos), self.clock,
                     None if scope is None else frozenset(scope))
        self.mutations[m.id] = m
        self._by_volume.setdefault(volume, {})[m.id] = m
        own = set(kept)
        notify: set[str] = set()
        for ino in m.inos:
            key = (volume, ino)
            self.pending[key] = self.pending.get(key, 0) + 1
            for session in list(self.by_inode.get(key, ())):
                holder = self.holders[session]
                if session == mutator and ino in own:
                    continue
                if holder.state(ino) is State.HELD:
                    self._step(session, holder, ino, Event.REVOKE, next(self._ids))
                    notify.add(session)
                m.waits[(session, ino)] = holder.revoking[ino].id
        return m, notify

    def blocked(self, m: Mutation, now: float, sessions: Iterable[str]) -> float | None:
        """None once ``m`` may be applied, else the longest it has to wait
        before asking again. Revocations whose deadline passed stop blocking
        and go to ``m.possibly_open``. ``sessions``: the volume's sessions
        (in the replicated state), for the grace after a failover."""
        deadline = None
        for (session, ino), rev in list(m.waits.items()):
            holder = self.holders.get(session)
            pending = holder.revoking.get(ino) if holder is not None else None
            if pending is None or pending.id != rev:
                del m.waits[(session, ino)]  # acknowledged, dropped or the session ended
            elif pending.deadline <= now:
                del m.waits[(session, ino)]
                m.possibly_open.append((session, ino))
            else:
                deadline = pending.deadline if deadline is None else min(deadline, pending.deadline)
        if now < self.grace_until and not self._all_clean(m.volume, sessions):
            deadline = self.grace_until if deadline is None else min(deadline, self.grace_until)
        return None if deadline is None else deadline - now

    def _all_clean(self, volume: str, sessions: Iterable[str]) -> bool:
        for session in sessions:
            holder = self.holders.get(session)
            if holder is None or not holder.clean:
                return False
        return True

    def watching(self, volume: str) -> bool:
        """Whether applies in ``volume`` must report what they touch (:meth:`applied`)."""
        return volume in self._by_volume

    def applied(self, volume: str, inos: Iterable[int], named: Iterable[int] | None = None) -> None:
        """A command was applied that touched ``inos``, naming the inodes
        ``named`` (default: ``inos``); see Name resolution."""
        seq = self.clock
        self.clock += 1
        if self._oldest_prediction(volume) <= seq:
            inos = tuple(inos)
            dirs = frozenset(inos if named is None else named)
            marks = self.marks.setdefault(volume, {})
            order = self._mark_order.setdefault(volume, deque())
            for ino in inos:
                old = marks.get(ino)
                # a later mark keeps what earlier ones named (their predictions may be in flight)
                marks[ino] = (seq, dirs if old is None or old[1] <= dirs else old[1] | dirs)
                order.append((seq, ino))

    def end(self, m: Mutation) -> None:
        """The mutation was applied, or failed, or was abandoned."""
        if self.mutations.pop(m.id, None) is None:
            return
        inflight = self._by_volume[m.volume]
        del inflight[m.id]
        if not inflight:
            del self._by_volume[m.volume]
        for ino in m.inos:
            key = (m.volume, ino)
            left = self.pending[key] - 1
            if left:
                self.pending[key] = left
            else:
                del self.pending[key]
        marks = self.marks.get(m.volume)
        if marks is not None:
            oldest = self._oldest_prediction(m.volume)
            order = self._mark_order[m.volume]
            while order and order[0][0] < oldest:
                seq, ino = order.popleft()
                mark = marks.get(ino)
                if mark is not None and mark[0] == seq:  # not marked again since
                    del marks[ino]
            if not marks:
                del self.marks[m.volume]
                del self._mark_order[m.volume]
