"""A sans-IO Raft core in the shape of etcd-io/raft's RawNode.

Theory of operation
-------------------
The core is a pure object. The driver feeds it three kinds of input:

* ``tick()`` -- the only notion of time (the driver calls it every
  ``tick_interval``; the simulation calls it whenever it likes);
* ``step(msg)`` -- a message from a peer;
* ``propose([cmd, ...])`` / ``read_index()`` -- requests from clients.

After any input the driver asks ``has_ready()``; if so it takes ``ready()``
and must, in this order:

1. send ``ready.eager_messages`` (allowed before the disk write: these are a
   leader's replication messages in a term whose vote is already on disk);
2. persist ``ready.snapshot``, then ``ready.entries`` and ``ready.hard_state``
   (one fsync when ``ready.must_sync``: that is the group commit);
3. send ``ready.messages`` (votes and acknowledgements promise what is now on
   disk, so they must wait for it);
4. restore the state machine from ``ready.snapshot`` if any, then apply
   ``ready.committed_entries`` in order; serve ``ready.read_states`` once the
   applied index reaches theirs;
5. call ``advance(ready)``.

A leader may instead write asynchronously (etcd's async storage writes): do
1 and 4, start the write, call ``accept(ready)`` and go on (the next Ready
may come at once: its entries follow), then, once the write is on disk,
send ``ready.messages`` and call ``persisted(ready)``, Readys in the order
they were taken. Its followers' acknowledgements may then commit an entry
before its own write of it ends: the leader counts its own log only up to
``persisted``, so a quorum of other disks holds what it commits, as Raft
requires, and its fsync leaves the commit path whenever two followers are
quicker. A Ready with a snapshot, and every Ready of a non-leader, goes the
synchronous way (``advance``), once no write is under way (``writing``).

Roles::

              timeout            pre-vote quorum          vote quorum
    FOLLOWER ---------> PRE_CANDIDATE ---------> CANDIDATE ---------> LEADER
       ^                    |  (term unchanged)      | term+1            |
       +--------------------+------------------------+-------------------+
            higher term, a leader's message, lost pre-vote/vote, or
            (leader) no quorum heard from within an election timeout

Safety rules kept here (Raft paper section in brackets): one vote per term
[5.2]; a vote only for an up-to-date log [5.4.1]; commit by counting only an
entry of the current term [5.4.2]; the leader counts its own log only once it
is on disk (``advance`` or ``persisted``). Liveness extras: pre-vote and check-quorum, so a
node cut off from the majority cannot depose a healthy leader when it returns
(followers in contact with a leader ignore votes for a newer term, the
"lease", and so does a replica in its first election timeout after a restart,
since it may have made that promise just before it crashed), and a leader
that lost the majority steps down. ``lease.py`` builds the leader's read
lease on that promise.

Membership (``membership.py``): the newest CONFIG entry in the log, or the
snapshot's configuration, or the one the replica was built with, is in
effect. Only voters count in quorums (votes, commits, read-index, check
quorum) and only a voter campaigns (or one whose removal is not committed
yet: ``_promotable``); learners get the log and are promoted by the leader
once caught up. A leader that removed itself leads on, not counting itself,
until the change commits, then steps down. Messages are
taken from any peer, member or not (the driver authenticates who is a
peer): a replica whose log holds an uncommitted configuration that lacks
the current leader must still hear from that leader to have it cut off,
and one that joins knows no configuration yet. A removed replica that never
learnt of its removal campaigns in vain: the others hear from their leader
and ignore it (the lease above), which is the thesis's answer to disruptive
servers.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from cachefs.errors import Busy, InvalidArgument, NotLeader, ProtocolError

from . import membership
from .log import RaftLog
from .membership import Membership
from .messages import (
    NONE,
    Append,
    AppendResp,
    Entry,
    EntryKind,
    HardState,
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


class InvalidMessage(ProtocolError):
    """A message no correct peer sends (forged, or from a buggy peer).

    ``step`` raises it *before* changing any state, so a driver drops the
    message, logs and counts it, and goes on.
    """


# Terms and indices never get anywhere near this; a message that claims more
# is refused, so our own arithmetic (term + 1, index + n) stays in the wire's
# unsigned 64-bit range.
MAX_TERM = MAX_INDEX = 1 << 62


def _check(ok: bool, m: Message, why: str) -> None:
    if not ok:
        raise InvalidMessage(f"raft: {type(m).__name__} from {m.src}: {why}")


def validate(m: Message) -> None:
    """What holds for every message a correct peer sends, whatever our state.

    Raises:
        InvalidMessage: with the rule it breaks.
    """
    _check(m.term <= MAX_TERM, m, f"term {m.term} is out of range")
    match m:
        case Vote():
            _check(m.last_index <= MAX_INDEX, m, "last_index is out of range")
            _check(m.last_term <= m.term, m, f"log term {m.last_term} is past the term {m.term}")
            _check((m.last_index == 0) == (m.last_term == 0), m,
                   f"log end ({m.last_index}, {m.last_term}) is not a log's end")
        case Append():
            _check(m.prev_index + len(m.entries) <= MAX_INDEX and m.commit <= MAX_INDEX, m,
                   "an index is out of range")
            _check((m.prev_index == 0) == (m.prev_term == 0), m,
                   f"prev ({m.prev_index}, {m.prev_term}) is not a log position")
            last = m.prev_term
            for e in m.entries:
                _check(1 <= e.term <= m.term and e.term >= last, m,
                       f"entry {e.index} of term {e.term} after term {last} (leader term {m.term})")
                last = e.term
                if e.kind is EntryKind.CONFIG:
                    try:
                        membership.decode(e.data)
                    except ProtocolError as exc:
                        _check(False, m, f"entry {e.index}: {exc.message}")
        case AppendResp():
            _check(m.index <= MAX_INDEX and m.hint_term <= m.term, m, "index or hint out of range")
            _check(not m.reject or m.hint_index <= m.index, m,
                   f"hint {m.hint_index} past the rejected index {m.index}")
        case InstallSnapshot():
            meta = m.snapshot.meta
            _check(1 <= meta.term <= m.term and 1 <= meta.index <= MAX_INDEX, m,
                   f"snapshot ({meta.index}, {meta.term}) in term {m.term}")
            _check(bool(meta.voters), m, "a snapshot without voters")


class Role(Enum):
    FOLLOWER = "follower"
    PRE_CANDIDATE = "pre-candidate"
    CANDIDATE = "candidate"
    LEADER = "leader"


@dataclass(frozen=True, slots=True)
class RaftConfig:
    election_tick: int = 10  # ticks without a leader before a (pre-)election
    heartbeat_tick: int = 1  # ticks between a leader's heartbeats
    max_append_bytes: int = 1 << 20  # entry bytes per Append message
    max_inflight: int = 256  # unacknowledged Appends per follower
    check_quorum: bool = True
    pre_vote: bool = True

    def __post_init__(self) -> None:
        if self.heartbeat_tick < 1 or self.election_tick <= self.heartbeat_tick:
            raise InvalidArgument("raft: need 1 <= heartbeat_tick < election_tick")
        if self.max_inflight < 1 or self.max_append_bytes < 1:
            raise InvalidArgument("raft: max_inflight and max_append_bytes must be positive")


@dataclass(frozen=True, slots=True)
class SoftState:
    leader: int
    role: Role
    term: int


@dataclass(frozen=True, slots=True)
class ReadState:
    """Read request ``seq`` may be served once ``applied >= index``."""

    seq: int
    index: int


@dataclass(frozen=True, slots=True)
class Ready:
    hard_state: HardState | None = None
    must_sync: bool = False
    entries: tuple[Entry, ...] = ()
    snapshot: Snapshot | None = None
    committed_entries: tuple[Entry, ...] = ()
    messages: tuple[Message, ...] = ()
    eager_messages: tuple[Message, ...] = ()
    read_states: tuple[ReadState, ...] = ()
    soft_state: SoftState | None = None


class _PState(Enum):
    PROBE = 0  # one Append at a time until we find where the logs match
    REPLICATE = 1  # stream Appends, up to max_inflight unacknowledged
    SNAPSHOT = 2  # an InstallSnapshot is on its way; send nothing else


class Progress:
    """The leader's view of one follower (etcd's tracker.Progress)."""

    __slots__ = (
        "match",
        "next",
        "state",
        "probe_sent",
        "recent_active",
        "inflight",
        "pending_snapshot",
        "snapshot_elapsed",
        "sent_commit",
    )

    def __init__(self, next_index: int) -> None:
        self.match = 0
        self.next = next_index
        self.state = _PState.PROBE
        self.probe_sent = False
        self.recent_active = True
        self.inflight: deque[int] = deque()
        self.pending_snapshot = 0
        self.snapshot_elapsed = 0
        self.sent_commit = -1  # the commit index the last Append since the last tick carried

    def paused(self, max_inflight: int) -> bool:
        if self.state is _PState.PROBE:
            return self.probe_sent
        if self.state is _PState.REPLICATE:
            return len(self.inflight) >= max_inflight
        return True

    def become_probe(self) -> None:
        if self.state is _PState.SNAPSHOT:
            self.next = max(self.match + 1, self.pending_snapshot + 1)
        else:
            self.next = self.match + 1
        self.state = _PState.PROBE
        self.probe_sent = False
        self.inflight.clear()

    def become_replicate(self) -> None:
        self.state = _PState.REPLICATE
        self.next = self.match + 1
        self.inflight.clear()

    def become_snapshot(self, index: int) -> None:
        self.state = _PState.SNAPSHOT
        self.pending_snapshot = index
        self.snapshot_elapsed = 0
        self.inflight.clear()

    def maybe_update(self, index: int) -> bool:
        self.probe_sent = False
        if index > self.match:
            self.match = index
            self.next = max(self.next, index + 1)
            return True
        return False

    def maybe_decr_to(self, rejected: int, match_hint: int) -> bool:
        """A follower rejected the Append after ``rejected``; False if stale."""
        if self.state is _PState.REPLICATE:
            if rejected <= self.match:
                return False
            self.next = self.match + 1
            return True
        if self.next - 1 != rejected:
            return False
        self.next = max(min(rejected, match_hint + 1), self.match + 1)
        self.probe_sent = False
        return True


@dataclass(slots=True)
class _Read:
    seq: int
    index: int | None  # None until the leader has committed in its term


@dataclass(slots=True)
class _Out:
    messages: list[Message] = field(default_factory=list)
    eager: list[Message] = field(default_factory=list)
    read_states: list[ReadState] = field(default_factory=list)


class RaftCore:
    """One Raft replica, without IO. See the module docstring for the loop."""

    def __init__(
        self,
        node_id: int,
        voters: list[int] | tuple[int, ...],
        *,
        rng: random.Random,
        addrs: dict[int, str] | None = None,
        config: RaftConfig | None = None,
        hard_state: HardState | None = None,
        snapshot: Snapshot | None = None,
        entries: list[Entry] | None = None,
    ) -> None:
        """``voters`` is the configuration to start from while the disk holds
        none (a new cluster's, with ``addrs`` for its members), or empty for
        a replica that joins a running cluster (it learns the configuration
        from the leader, as a learner).
        ``hard_state.discovering`` marks a new disk (``storage.NEW_DISK``):
        then a voter cannot tell a new cluster from a lost disk, and asks
        its peers first (``_finish_discovery``).

        Raises:
            InvalidArgument: ``voters`` are not distinct, or lack ``node_id``.
        """
        if node_id == NONE or (voters and node_id not in voters) or len(set(voters)) != len(voters):
            raise InvalidArgument(
                f"raft: node id {node_id} must be one of distinct voters {voters}"
            )
        self.id = node_id
        self.config = config or RaftConfig()
        self.rng = rng
        hs = hard_state or HardState()
        meta = snapshot.meta if snapshot else SnapshotMeta()
        self.snapshot = snapshot  # the newest persisted snapshot, sent to laggards
        self.log = RaftLog(meta.index, meta.term, entries, hs.commit)
        # The configuration at the log's start, and the CONFIG entries after
        # it as (index, term, membership), oldest first: the last is in effect.
        self._base = meta.membership if meta.voters else Membership.of(voters, (), addrs)
        self._confs = [(e.index, e.term, membership.decode(e.data))
                       for e in self.log.entries if e.kind is EntryKind.CONFIG]
        self.role = Role.FOLLOWER
        self._set_membership(self._confs[-1][2] if self._confs else self._base)
        self.term = hs.term
        self.vote = hs.vote
        self.lead = NONE
        self._persisted = dataclasses.replace(hs, commit=self.log.committed)  # on disk
        self._handed = self._persisted  # in a Ready already, maybe still being written
        self._writing: deque[Ready] = deque()  # accepted, not persisted yet, oldest first
        self.rebuilding = hs.rebuilding
        # A new disk is a new cluster's, or a replica's whose disk was lost:
        # ask the peers before anything else (``_finish_discovery``). Not one
        # that joins: it was never a voter, so it promised nothing.
        self.discovering = hs.discovering and len(self.voters) > 1 and node_id in self.voters
        # Answers needed: enough peers to meet every quorum this replica may
        # have been part of without itself (n - q + 1 of the n - 1 others).
        self._probe_need = min(len(self.voters) - self.quorum + 1, len(self.voters) - 1)
        self._probe_terms: dict[int, int] = {}
        self._probe_nonce = rng.getrandbits(62)
        self._out = _Out()
        self._votes: dict[int, bool] = {}
        self.prs: dict[int, Progress] = {}
        self._reads: deque[_Read] = deque()
        self._read_seq = 0
        self._read_acked: dict[int, int] = {}
        self._soft = SoftState(NONE, Role.FOLLOWER, self.term)
        self._in_ready: Ready | None = None
        self.election_elapsed = 0
        self.heartbeat_elapsed = 0
        self._randomized_timeout = 0
        self._become_follower(self.term, NONE)
        # A replica restarted with a term on disk may have promised a leader,
        # just before it crashed, to vote for nobody else for an election
        # timeout (the leader may be serving reads on that promise): it keeps
        # the promise for its first election timeout, as if it had just heard
        # from that leader. ``_reset`` ends it.
        self._restart_lease = hs.term > 0
        if self.discovering:
            self._send_probes()

    # ------------------------------------------------------------------ API
    @property
    def is_leader(self) -> bool:
        return self.role is Role.LEADER

    @property
    def committed(self) -> int:
        return self.log.committed

    @property
    def applied(self) -> int:
        return self.log.applied

    def tick(self) -> None:
        if self.role is Role.LEADER:
            self._tick_leader()
            return
        if self.discovering:
            self._send_probes()  # again: a peer may have been down
            return
        self.election_elapsed += 1
        if self.election_elapsed >= self._randomized_timeout and not self.rebuilding:
            self.election_elapsed = 0
            if self._promotable():
                self._campaign(pre=self.config.pre_vote)
            else:
                # No leader heard for a timeout: our promise is over, so a
                # candidate that counts us as a voter can have our vote.
                self.lead = NONE

    def campaign(self) -> None:
        """Start an election now (tests, or an operator's transfer); not
        while discovering or rebuilding (see ``_finish_discovery``), nor as
        a non-voter."""
        if (self.role is not Role.LEADER and not self.discovering and not self.rebuilding
                and self._promotable()):
            self._campaign(pre=self.config.pre_vote)

    def propose(self, commands: list[bytes]) -> tuple[int, int]:
        """Append commands (one batch: one Append to each follower).

        Returns ``(first_index, term)``; command ``k`` is at ``first_index + k``
        and was committed iff the entry applied at that index has that term.

        Raises:
            NotLeader: with ``leader_id`` (0 when unknown).
        """
        if self.role is not Role.LEADER:
            raise NotLeader("not the raft leader", leader_id=self.lead)
        first = self.log.last_index() + 1
        self.log.append([Entry(self.term, first + k, c) for k, c in enumerate(commands)])
        self._bcast_append()
        return first, self.term

    def read_index(self) -> int:
        """Ask for a linearizable read; returns its ``seq``. A ReadState with
        that seq comes out in a later Ready, once a quorum has confirmed
        that we are still the leader.

        Raises:
            NotLeader: with ``leader_id``.
        """
        if self.role is not Role.LEADER:
            raise NotLeader("not the raft leader", leader_id=self.lead)
        self._read_seq += 1
        seq = self._read_seq
        index = self.log.committed if self._committed_in_term() else None
        self._reads.append(_Read(seq, index))
        if self.voters == (self.id,):
            self._release_reads()
        else:
            self._bcast_heartbeat()
        return seq

    @property
    def conf_index(self) -> int:
        """Where the configuration in effect was appended (the snapshot's
        index if the log holds no CONFIG entry): it changes with it."""
        return self._confs[-1][0] if self._confs else self.log.snap_index

    def propose_membership(self, new: Membership) -> tuple[int, int]:
        """Append configuration ``new`` (``membership.py``'s rules); it is
        in effect at once, and done once the entry at the returned
        ``(index, term)`` is applied.

        Raises:
            NotLeader: with ``leader_id``.
            Busy: a change is still uncommitted, or this leader has not yet
                committed an entry of its term: retry shortly.
            InvalidArgument: more than one voter changes, or none is left.
        """
        if self.role is not Role.LEADER:
            raise NotLeader("not the raft leader", leader_id=self.lead)
        if self.conf_index > self.log.committed or not self._committed_in_term():
            raise Busy("raft: a membership change or a new leader's first commit is in "
                       "progress; retry")
        membership.check_change(self.membership, new)
        return self._append_config(new)

    def caught_up(self, node_id: int) -> bool:
        """(Leader) ``node_id`` holds everything committed, in this term."""
        pr = self.prs.get(node_id)
        return (self.role is Role.LEADER and pr is not None and pr.state is _PState.REPLICATE
                and pr.match >= self.log.committed and self._committed_in_term())

    def step(self, m: Message) -> None:
        """Take one message from a peer.

        Raises:
            InvalidMessage: a message no correct peer sends; nothing changed.
        """
        if m.dst != self.id or m.src == self.id or m.src == NONE:
            return
        validate(m)
        if isinstance(m, Probe):
            self._send(ProbeResp(self.term, self.id, m.src, m.nonce))  # whatever our state
            return
        if isinstance(m, ProbeResp):
            if self.discovering and m.nonce == self._probe_nonce:
                self._probe_terms[m.src] = m.term
                if len(self._probe_terms) >= self._probe_need:
                    self._finish_discovery()
            return
        if self.discovering:
            return  # nothing else until we know whether we forgot something
        if m.term > self.term:
            if isinstance(m, Vote):
                in_lease = (
                    self.config.check_quorum
                    and (self.lead != NONE or self._restart_lease)
                    and self.election_elapsed < self.config.election_tick
                )
                if in_lease:
                    return  # we hear from a live leader: ignore the disruptor
            if (isinstance(m, Vote) and m.pre) or (isinstance(m, VoteResp) and m.pre and m.granted):
                pass  # pre-votes never change anyone's term
            elif isinstance(m, Append | Heartbeat | InstallSnapshot):
                self._become_follower(m.term, m.src)
            else:
                self._become_follower(m.term, NONE)
        elif m.term < self.term:
            if isinstance(m, Append | Heartbeat):
                # A deposed leader: tell it our term so it steps down (without
                # this, pre-vote + check-quorum could leave it stuck).
                self._send(AppendResp(self.term, self.id, m.src, 0))
            elif isinstance(m, Vote) and m.pre:
                self._send(VoteResp(self.term, self.id, m.src, False, pre=True))
            return

        if isinstance(m, Vote):
            self._handle_vote(m)
        elif self.role is Role.LEADER:
            self._step_leader(m)
        elif self.role is Role.FOLLOWER:
            self._step_follower(m)
        else:
            self._step_candidate(m)

    def has_ready(self) -> bool:
        out = self._out
        return bool(
            out.messages
            or out.eager
            or out.read_states
            or self._hard_state() != self._handed
            or self.log.in_progress < self.log.last_index()
            or self.log.pending_snapshot is not None
            or self.log.committed > self.log.applied
            or self._soft_state() != self._soft
        )

    def ready(self) -> Ready:
        if self._in_ready is not None:
            raise AssertionError("ready() called twice without advance()")
        hs = self._hard_state()
        entries = tuple(self.log.unstable_entries())
        hard = hs if hs != self._handed else None
        must_sync = (
            bool(entries)
            or (
                hard is not None
                and dataclasses.replace(hs, commit=0)
                != dataclasses.replace(self._handed, commit=0)
            )
            or self.log.pending_snapshot is not None
        )
        soft = self._soft_state()
        out = self._out
        rd = Ready(
            hard_state=hard,
            must_sync=must_sync,
            entries=entries,
            snapshot=self.log.pending_snapshot,
            committed_entries=tuple(self.log.committed_to_apply()),
            messages=tuple(out.messages),
            eager_messages=tuple(out.eager),
            read_states=tuple(out.read_states),
            soft_state=soft if soft != self._soft else None,
        )
        self._out = _Out()
        if rd.soft_state is not None:
            self._soft = rd.soft_state
        self._in_ready = rd
        return rd

    def advance(self, rd: Ready) -> None:
        """The driver has done everything ``rd`` asked for, its write included.

        Raises:
            AssertionError: ``rd`` is not the current Ready, or a write is
                still under way (``persisted`` those first).
        """
        if self._writing:
            raise AssertionError("advance() while writes are under way: persisted() them first")
        self._accepted(rd)
        if rd.snapshot is not None:
            self.snapshot = rd.snapshot
            self.log.snapshot_persisted(rd.snapshot.meta.index)
        self._durable(rd)

    def accept(self, rd: Ready) -> None:
        """(A leader) the driver has sent ``rd.eager_messages``, applied
        ``rd``'s committed entries and started its write; ``persisted(rd)``
        follows once the write is on disk. See the module docstring.

        Raises:
            AssertionError: ``rd`` is not the current Ready, or holds a
                snapshot (that one is installed synchronously).
        """
        if rd.snapshot is not None:
            raise AssertionError("a Ready with a snapshot is advanced synchronously")
        self._accepted(rd)
        self._writing.append(rd)

    def persisted(self, rd: Ready) -> None:
        """An accepted Ready's write is on disk (and its ``messages`` sent).

        Raises:
            AssertionError: ``rd`` is not the oldest accepted Ready.
        """
        if not self._writing or self._writing[0] is not rd:
            raise AssertionError("persisted() out of order, or for a Ready not accepted")
        self._writing.popleft()
        self._durable(rd)

    @property
    def writing(self) -> int:
        """Accepted Readys whose write is still under way."""
        return len(self._writing)

    def _accepted(self, rd: Ready) -> None:
        if rd is not self._in_ready:
            raise AssertionError("advance() with a Ready that is not the current one")
        self._in_ready = None
        if rd.hard_state is not None:
            self._handed = rd.hard_state
        if rd.entries:
            self.log.in_progress_to(rd.entries[-1].index)
        if rd.committed_entries:
            self.log.applied_to(rd.committed_entries[-1].index)

    def _durable(self, rd: Ready) -> None:
        """``rd``'s write is on disk: only now does the leader count its own
        log in a quorum (and send what rests on the term and vote)."""
        if rd.hard_state is not None:
            self._persisted = rd.hard_state
        if rd.entries:
            last = rd.entries[-1]
            self.log.stable_to(last.index, last.term)
            if self.role is Role.LEADER and self._maybe_commit():
                self._bcast_append(send_empty=False)

    def snapshot_meta(self, index: int) -> SnapshotMeta:
        """Metadata for a state machine snapshot taken at applied ``index``."""
        term = self.log.term(index)
        if term is None or index > self.log.applied:
            raise InvalidArgument(f"raft: cannot snapshot at {index} (applied {self.log.applied})")
        at = self._membership_at(index)
        if not at.voters:
            # A replica that joined a cluster whose log began before
            # configurations were logged: it cannot say who voted there.
            raise InvalidArgument(f"raft: the configuration at {index} is unknown here")
        return SnapshotMeta.at(index, term, at)

    def compact(self, snapshot: Snapshot) -> None:
        """The driver persisted ``snapshot``; drop the log up to it."""
        if self.snapshot is None or snapshot.meta.index > self.snapshot.meta.index:
            self.snapshot = snapshot
        self.log.compact(snapshot.meta.index)
        snap_index = self.log.snap_index
        self._base = self._membership_at(snap_index)
        self._confs = [c for c in self._confs if c[0] > snap_index]

    def persisted_hard_state(self) -> HardState:
        return self._persisted

    def stable_entries(self) -> list[Entry]:
        return self.log.entries[: self.log.stable - self.log.snap_index]

    # ------------------------------------------------------------ internals
    def _membership_at(self, index: int) -> Membership:
        at = self._base
        for i, _, m in self._confs:
            if i > index:
                break
            at = m
        return at

    def _promotable(self) -> bool:
        """Whether we may stand for election: as a voter, or as one being
        removed while that change is not known to be committed. (A leader
        that removed itself and lost its quorum before the change committed
        must be able to stand again: the other voters may lack the change,
        count us in, and refuse each other for our longer log. Winning, it
        counts only the new voters, commits the change and stands aside.)
        Learners and replicas removed for good never stand."""
        if self.id in self.voters:
            return True
        if not self._confs or self.conf_index <= self.log.committed:
            return False
        before = self._confs[-2][2] if len(self._confs) > 1 else self._base
        return self.id in before.voters

    def _set_membership(self, m: Membership) -> None:
        """Put ``m`` in effect; a leader starts or stops replicating to the
        members that came or went."""
        self.membership = m
        self.voters = m.voters
        self.learners = m.learners
        self.quorum = m.quorum
        if self.role is Role.LEADER:
            nxt = self.log.last_index() + 1
            for i in m.members:
                if i != self.id and i not in self.prs:
                    self.prs[i] = Progress(nxt)
            for i in [i for i in self.prs if i not in m.members]:
                del self.prs[i]
                self._read_acked.pop(i, None)

    def _log_changed(self, entries: tuple[Entry, ...]) -> None:
        """After a follower's append: forget CONFIG entries it cut off, take
        on those it added (the newest one is in effect once appended)."""
        confs, log = self._confs, self.log
        changed = False
        while confs and log.term(confs[-1][0]) != confs[-1][1]:
            confs.pop()
            changed = True
        for e in entries:
            if (e.kind is EntryKind.CONFIG and (not confs or e.index > confs[-1][0])
                    and log.term(e.index) == e.term):
                confs.append((e.index, e.term, membership.decode(e.data)))
                changed = True
        if changed:
            self._set_membership(confs[-1][2] if confs else self._base)

    def _append_config(self, m: Membership) -> tuple[int, int]:
        index = self.log.last_index() + 1
        self.log.append([Entry(self.term, index, membership.encode(m), EntryKind.CONFIG)])
        self._confs.append((index, self.term, m))
        self._set_membership(m)
        self._bcast_append()
        return index, self.term

    def _maybe_promote(self) -> None:
        """(Leader) promote a learner that has caught up, one at a time."""
        if self.conf_index > self.log.committed or not self._committed_in_term():
            return
        for i in self.learners:
            pr = self.prs.get(i)
            if pr is not None and pr.recent_active and self.caught_up(i):
                self._append_config(self.membership.promote(i))
                return

    def _hard_state(self) -> HardState:
        return HardState(self.term, self.vote, self.log.committed, self.rebuilding,
                         self.discovering)

    def _soft_state(self) -> SoftState:
        return SoftState(self.lead, self.role, self.term)

    def _send(self, m: Message) -> None:
        # A leader's replication traffic may leave before the disk write once
        # the term and vote it rests on are on disk; everything else waits.
        if (
            self.role is Role.LEADER
            and isinstance(m, Append | Heartbeat | InstallSnapshot)
            and self._persisted.term == self.term
            and self._persisted.vote == self.vote
        ):
            self._out.eager.append(m)
        else:
            self._out.messages.append(m)

    def _reset(self, term: int) -> None:
        if term != self.term:
            self.term = term
            self.vote = NONE
        self.lead = NONE
        self._restart_lease = False
        self.election_elapsed = 0
        self.heartbeat_elapsed = 0
        et = self.config.election_tick
        self._randomized_timeout = et + self.rng.randrange(et)
        self._votes = {}
        self.prs = {}
        self._reads.clear()
        self._read_acked = {}

    def _become_follower(self, term: int, lead: int) -> None:
        self._reset(term)
        self.lead = lead
        self.role = Role.FOLLOWER

    def _campaign(self, pre: bool) -> None:
        if pre:
            self._reset(self.term)
            self.role = Role.PRE_CANDIDATE
            vote_term = self.term + 1
        else:
            self._reset(self.term + 1)
            self.role = Role.CANDIDATE
            self.vote = self.id
            vote_term = self.term
        self._votes[self.id] = True
        if self._tally() >= self.quorum:
            if pre:
                self._campaign(pre=False)
            else:
                self._become_leader()
            return
        last_index, last_term = self.log.last_index(), self.log.last_term()
        for v in self.voters:
            if v != self.id:
                self._send(Vote(vote_term, self.id, v, last_index, last_term, pre))

    def _tally(self) -> int:
        return sum(1 for v, g in self._votes.items() if g and v in self.voters)

    def _become_leader(self) -> None:
        self._reset(self.term)
        self.role = Role.LEADER
        self.lead = self.id
        nxt = self.log.last_index() + 1
        self.prs = {v: Progress(nxt) for v in self.membership.members if v != self.id}
        # A no-op of our own term: committing it commits every earlier entry
        # (we may not count replicas of older-term entries, Raft 5.4.2) and
        # it unblocks read-index. If the log holds no configuration, it is
        # a CONFIG entry instead: a new cluster's first leader writes its
        # configuration at index 1, so a replica that joins later and copies
        # the log from there knows the configuration at every index.
        if self._confs:
            self.log.append([Entry(self.term, nxt, b"", EntryKind.NOOP)])
            self._bcast_append()
        else:
            self._append_config(self.membership)

    def _handle_vote(self, m: Vote) -> None:
        can_vote = not self.rebuilding and (
            self.vote == m.src
            or (self.vote == NONE and self.lead == NONE)
            or (m.pre and m.term > self.term)
        )
        if can_vote and self.log.is_up_to_date(m.last_index, m.last_term):
            self._send(VoteResp(m.term, self.id, m.src, True, m.pre))
            if not m.pre:
                self.election_elapsed = 0
                self.vote = m.src
        else:
            self._send(VoteResp(self.term, self.id, m.src, False, m.pre))

    # -- an empty disk
    def _send_probes(self) -> None:
        for v in self.voters:
            if v != self.id and v not in self._probe_terms:
                self._send(Probe(self.term, self.id, v, self._probe_nonce))

    def _finish_discovery(self) -> None:
        """Enough peers told us their terms (see ``__init__``).

        All at term 0: the cluster is new and so are we; go ahead. Otherwise
        our disk was lost (wiped, or moved aside after damage): we may have
        voted or acknowledged entries in any term up to the highest one
        heard, since every quorum we were in overlaps the peers that
        answered. So we take that term, and vote for nobody and stand for
        nothing (``rebuilding``, kept on disk) until a leader of our term has
        caught us up: then our log holds everything committed before, and our
        vote cannot help elect a leader that lacks it.
        """
        self.discovering = False
        top = max(self._probe_terms.values(), default=0)
        self._probe_terms = {}
        if top > 0:
            self.rebuilding = True
            self._become_follower(top, NONE)

    def _maybe_rebuilt(self, m: Append) -> None:
        """A rebuilding follower is caught up once it holds, as committed,
        everything its leader had committed (``m.commit``), including an
        entry of the leader's term: before that entry, the leader commits
        nothing, so nothing committed earlier is missing from our log."""
        log = self.log
        if log.committed >= m.commit and log.term(log.committed) == self.term:
            self.rebuilding = False

    # -- follower / candidate
    def _step_follower(self, m: Message) -> None:
        if isinstance(m, Append | Heartbeat | InstallSnapshot):
            _check(self.lead in (NONE, m.src), m, f"a second leader in term {self.term} "
                   f"(we follow {self.lead})")
        if isinstance(m, Append):
            self.election_elapsed = 0
            self.lead = m.src
            self._handle_append(m)
        elif isinstance(m, Heartbeat):
            self.election_elapsed = 0
            self.lead = m.src
            last = self.log.last_index()
            self.log.commit_to(min(m.commit, last))
            # The leader only sends us a commit it knows we hold; if our log
            # ends below it we lost acknowledged entries (a wiped data dir).
            lost = m.commit > last
            self._send(HeartbeatResp(self.term, self.id, m.src, m.ctx, lost, last if lost else 0))
        elif isinstance(m, InstallSnapshot):
            self.election_elapsed = 0
            self.lead = m.src
            self._handle_snapshot(m)

    def _step_candidate(self, m: Message) -> None:
        if isinstance(m, Append | Heartbeat | InstallSnapshot):
            self._become_follower(m.term, m.src)  # a leader of our term won
            self._step_follower(m)
        elif isinstance(m, VoteResp):
            if m.pre != (self.role is Role.PRE_CANDIDATE):
                return
            self._votes.setdefault(m.src, m.granted)
            granted = self._tally()
            if granted >= self.quorum:
                if self.role is Role.PRE_CANDIDATE:
                    self._campaign(pre=False)
                else:
                    self._become_leader()
            elif sum(1 for v, g in self._votes.items() if not g and v in self.voters) >= self.quorum:
                self._become_follower(self.term, NONE)

    def _handle_append(self, m: Append) -> None:
        log = self.log
        if m.prev_index < log.committed:
            self._send(AppendResp(self.term, self.id, m.src, log.committed))
            return
        last_new = log.maybe_append(m.prev_index, m.prev_term, m.commit, m.entries)
        if last_new is not None:
            self._log_changed(m.entries)
            if self.rebuilding:
                self._maybe_rebuilt(m)
            self._send(AppendResp(self.term, self.id, m.src, last_new))
            return
        hint_index, hint_term = log.find_conflict_by_term(
            min(m.prev_index, log.last_index()), m.prev_term
        )
        self._send(AppendResp(self.term, self.id, m.src, m.prev_index, True, hint_index, hint_term))

    def _handle_snapshot(self, m: InstallSnapshot) -> None:
        meta = m.snapshot.meta
        log = self.log
        if meta.index <= log.committed:
            self._send(AppendResp(self.term, self.id, m.src, log.committed))
            return
        if log.match_term(meta.index, meta.term):
            # We hold that entry: fast-forward. Our tail beyond it may be from
            # an older term, so only the commit point is known to match.
            log.commit_to(meta.index)
            self._send(AppendResp(self.term, self.id, m.src, log.committed))
            return
        log.restore(m.snapshot)
        self._base = meta.membership
        self._confs = []
        self._set_membership(self._base)
        self._send(AppendResp(self.term, self.id, m.src, log.last_index()))

    # -- leader
    def _tick_leader(self) -> None:
        self.heartbeat_elapsed += 1
        self.election_elapsed += 1
        if self.election_elapsed >= self.config.election_tick:
            self.election_elapsed = 0
            active = (self.id in self.voters) + sum(
                1 for v in self.voters if v != self.id and self.prs[v].recent_active)
            quorum = self.quorum  # of the voters just counted
            self._maybe_promote()  # before the activity resets
            if self.config.check_quorum:
                for pr in self.prs.values():
                    pr.recent_active = False
                if active < quorum:
                    self._become_follower(self.term, NONE)
                    return
            for to, pr in self.prs.items():
                if pr.state is _PState.SNAPSHOT:
                    pr.snapshot_elapsed += 1
                    if pr.snapshot_elapsed >= 2:  # lost, or slow: probe again
                        pr.become_probe()
                        self._send_append(to)
        if self.heartbeat_elapsed >= self.config.heartbeat_tick:
            self.heartbeat_elapsed = 0
            self._bcast_heartbeat(skip_busy=True)

    def _step_leader(self, m: Message) -> None:
        pr = self.prs.get(m.src)
        if pr is None:
            return
        _check(not isinstance(m, Append | Heartbeat | InstallSnapshot), m,
               f"a second leader in our term {self.term}")
        if isinstance(m, AppendResp):
            _check(m.index <= self.log.last_index(), m,
                   f"answers index {m.index}, past our last {self.log.last_index()}")
            pr.recent_active = True
            if m.reject:
                next_probe = m.hint_index
                if m.hint_term > 0:
                    next_probe, _ = self.log.find_conflict_by_term(m.hint_index, m.hint_term)
                if pr.maybe_decr_to(m.index, next_probe):
                    if pr.state is _PState.REPLICATE:
                        pr.become_probe()
                    self._send_append(m.src)
                return
            was_paused = pr.paused(self.config.max_inflight)
            if not pr.maybe_update(m.index):
                return
            if pr.state is _PState.PROBE:
                pr.become_replicate()
            elif pr.state is _PState.SNAPSHOT and pr.match >= pr.pending_snapshot:
                pr.become_probe()
                pr.become_replicate()
            elif pr.state is _PState.REPLICATE:
                while pr.inflight and pr.inflight[0] <= m.index:
                    pr.inflight.popleft()
            if self._maybe_commit():
                # Followers learn the new commit index with the next Append or
                # heartbeat: no extra round of empty Appends per commit.
                self._bcast_append(send_empty=False)
                if m.src not in self.prs:
                    return  # we committed our own removal and stood aside
            elif was_paused:
                self._send_append(m.src)
            while self._send_append(m.src, send_empty=False):
                pass
        elif isinstance(m, HeartbeatResp):
            _check(m.ctx <= self._read_seq, m, f"echoes read {m.ctx}, we sent {self._read_seq}")
            pr.recent_active = True
            if m.reject and m.hint_index < pr.match:
                # The follower was rebuilt from an empty directory: what it had
                # acknowledged is gone. Probe from its real end (down to a
                # snapshot once below our log). A snapshot already on its way
                # stays in flight: the lost-snapshot timeout covers it.
                pr.match = m.hint_index
                if pr.state is not _PState.SNAPSHOT:
                    pr.become_probe()
            pr.probe_sent = False
            if pr.state is _PState.REPLICATE and len(pr.inflight) >= self.config.max_inflight:
                pr.inflight.popleft()  # an Append may be lost: make room to probe on
            if pr.match < self.log.last_index():
                self._send_append(m.src)
            if m.ctx > self._read_acked.get(m.src, 0):
                self._read_acked[m.src] = m.ctx
                self._release_reads()

    def _send_append(self, to: int, send_empty: bool = True) -> bool:
        pr = self.prs[to]
        if pr.paused(self.config.max_inflight):
            return False
        log = self.log
        prev = pr.next - 1
        prev_term = log.term(prev)
        if prev_term is None:
            return self._send_snapshot(to, pr)
        last = log.last_index()
        entries = (
            log.slice(pr.next, last + 1, self.config.max_append_bytes) if pr.next <= last else []
        )
        if not entries and not send_empty:
            return False
        self._send(Append(self.term, self.id, to, prev, prev_term, tuple(entries), log.committed))
        pr.sent_commit = log.committed
        if pr.state is _PState.REPLICATE and entries:
            pr.next = entries[-1].index + 1
            pr.inflight.append(entries[-1].index)
        elif pr.state is _PState.PROBE:
            pr.probe_sent = True
        return True

    def _send_snapshot(self, to: int, pr: Progress) -> bool:
        # A snapshot installed from the old leader may not be on disk yet if we
        # won an election since; its data is committed state all the same.
        snap = self.log.pending_snapshot or self.snapshot
        if snap is None or snap.meta.index < self.log.snap_index:
            raise AssertionError("log compacted without a persisted snapshot")
        pr.become_snapshot(snap.meta.index)
        self._send(InstallSnapshot(self.term, self.id, to, snap))
        return True

    def _bcast_append(self, send_empty: bool = True) -> None:
        for to in self.prs:
            self._send_append(to, send_empty)

    def _bcast_heartbeat(self, skip_busy: bool = False) -> None:
        """With ``skip_busy`` (the heartbeat tick), not to a follower that
        takes our Appends (REPLICATE) and was sent one since the last tick
        with the commit index as it is now: that told it all a heartbeat
        would, and its answer tells us it is there. A probed follower gets
        its heartbeats: one whose disk was wiped is found by their answer.
        Read-index rounds go to every follower: their answers confirm the
        read."""
        commit = self.log.committed
        ctx = self._read_seq
        for to, pr in self.prs.items():
            busy = pr.state is _PState.REPLICATE and pr.sent_commit == commit
            pr.sent_commit = -1
            if skip_busy and busy:
                continue
            self._send(Heartbeat(self.term, self.id, to, min(pr.match, commit), ctx))

    def _committed_in_term(self) -> bool:
        return self.log.term(self.log.committed) == self.term

    def _maybe_commit(self) -> bool:
        prs = self.prs
        matches = sorted((self.log.stable if v == self.id else prs[v].match for v in self.voters),
                         reverse=True)
        index = matches[self.quorum - 1]
        had = self._committed_in_term()
        if not self.log.maybe_commit(index, self.term):
            return False
        if not had:
            # First commit of our term: reads that waited for it get their index.
            for r in self._reads:
                if r.index is None:
                    r.index = self.log.committed
            self._release_reads()
        if self.id not in self.voters and self.log.committed >= self.conf_index:
            # Our own removal committed: tell the others, then stand aside.
            self._bcast_append()
            self._become_follower(self.term, NONE)
        return True

    def _release_reads(self) -> None:
        acked = self._read_acked
        while self._reads:
            r = self._reads[0]
            if r.index is None:
                return
            votes = (self.id in self.voters) + sum(
                1 for i, v in acked.items() if v >= r.seq and i in self.voters)
            if votes < self.quorum:
                return
            self._reads.popleft()
            self._out.read_states.append(ReadState(r.seq, r.index))
