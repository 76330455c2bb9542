"""A deterministic in-process Raft cluster: simulated clock, network and disk.

Everything random comes from one ``random.Random(seed)``, so a schedule is
replayed exactly from its seed. The network loses, duplicates, delays and
reorders messages and can be partitioned (also one-way); nodes crash and
restart from their simulated disk, which loses whatever was not synced (and
may keep a torn prefix of it, or the last write with zeroed pages in it),
through the real WAL codec and start-up check (``storage.recover``). Disks
also rot (a flipped bit in a synced record with records after it: start-up
must refuse it, and the replica is rebuilt empty, as docs/raft.md says) and
get lost (the replica restarts empty); one disk at a time, as the procedure
demands. Leaders may answer reads under their lease (``lease.py``), by their
own drifting clocks. An operator changes the membership one server at a
time (``membership.py``): adds a replica that joins with an empty disk as a
learner, removes one, or replaces one; once the membership has changed, a
lost disk is handled the way it must be then, by replacing that replica
with a new one (rebuilding in place asks the first configuration's peers). Each node handles ``Ready`` the way ``driver.RaftNode``
does: eager messages, write, sync (a separate event, so crashes can land in
between), messages, apply, advance; or, for a leader with ``async_writes``
(``RaftCore.accept``), eager messages, write, apply, accept, and go on, the
sync landing later (``persisted``; a crash before it loses the write).

After every event :class:`Checker` verifies election safety, log matching,
leader completeness and state machine safety incrementally; client operations
(put/get/cas on a small key-value store with client sessions) are recorded
into a history that :func:`check_linearizable` checks at the end.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass
from typing import Any

import msgpack

from cachefs.errors import Busy, Corrupt, InvalidArgument, NotLeader
from cachefs.metanode.raft import membership, storage
from cachefs.metanode.raft import messages as wire
from cachefs.metanode.raft.core import InvalidMessage, RaftConfig, RaftCore, Ready, Role
from cachefs.metanode.raft.lease import LEASE_FRACTION, ReadLease
from cachefs.metanode.raft.messages import EntryKind, Message, Snapshot, SnapshotMeta

TICK = 10  # time units per tick


class KV:
    """The model state machine: a key-value store with client sessions, so a
    retried mutation (same client, same seq) is applied once and answered
    with its first result."""

    def __init__(self) -> None:
        self.data: dict[str, int] = {}
        self.sessions: dict[str, tuple[int, Any]] = {}

    def apply(self, index: int, command: bytes) -> Any:
        client, seq, op, key, a, b = msgpack.unpackb(command)
        last = self.sessions.get(client)
        if last is not None and seq <= last[0]:
            return last[1] if seq == last[0] else None
        if op == "put":
            self.data[key] = a
            result: Any = True
        elif op == "cas":
            result = self.data.get(key) == a
            if result:
                self.data[key] = b
        else:
            raise AssertionError(f"bad op {op}")
        self.sessions[client] = (seq, result)
        return result

    def snapshot(self) -> bytes:
        return msgpack.packb([self.data, {c: list(v) for c, v in self.sessions.items()}])

    def restore(self, data: bytes) -> None:
        d, s = msgpack.unpackb(data)
        self.data = d
        self.sessions = {c: (v[0], v[1]) for c, v in s.items()}


class SimDisk:
    """A replica's disk. ``frames`` are where each write began (a Ready is
    one write, one WAL record); ``damaged`` marks damage the simulation did
    on purpose, which start-up must refuse."""

    def __init__(self) -> None:
        self.wal = bytearray(storage.encode_base(0, 0) + storage.encode_ready([], storage.NEW_DISK))
        self.frames = [0]
        self.synced = len(self.wal)
        self.snapshot: bytes | None = None
        self.syncs = 0
        self.damaged = False
        self.garbled_tail = False  # the last write is garbage (a crash): not a whole record

    def append(self, data: bytes) -> None:
        if data:
            self.frames.append(len(self.wal))
            self.wal += data
            self.garbled_tail = False

    def crash(self, rng: random.Random) -> None:
        """Lose unsynced bytes; sometimes keep a torn prefix of them, or the
        whole last write with some of its pages never written (zeros)."""
        unsynced = len(self.wal) - self.synced
        if unsynced and self.frames[-1] >= self.synced and rng.random() < 0.25:
            start = rng.randrange(self.frames[-1], len(self.wal))
            end = rng.randint(start + 1, len(self.wal))
            self.wal[start:end] = bytes(end - start)
            self.synced = len(self.wal)
            self.garbled_tail = True
            return
        keep = self.synced + (rng.randint(0, unsynced) if unsynced and rng.random() < 0.5 else 0)
        self.garbled_tail = keep not in (*self.frames, len(self.wal))  # a torn last write
        del self.wal[keep:]
        self.frames = [f for f in self.frames if f < keep] or [0]
        self.synced = len(self.wal)

    def cut(self, length: int) -> None:
        """What start-up does with a bad last record."""
        del self.wal[length:]
        self.frames = [f for f in self.frames if f < length] or [0]
        self.synced = len(self.wal)
        self.garbled_tail = False

    def replace_wal(self, data: bytes) -> None:  # write tmp + fsync + rename
        self.wal = bytearray(data)
        self.frames = [0]
        self.synced = len(self.wal)
        self.garbled_tail = False

    def damage(self, rng: random.Random) -> bool:
        """Flip a bit in a synced record that has whole records after it
        (bit rot); False if there is none."""
        whole = self.frames[:-1] if self.garbled_tail else self.frames
        inner = whole[1:-1]
        if not inner:
            return False
        frame = rng.choice(inner)
        end = min(f for f in self.frames if f > frame)
        self.wal[rng.randrange(frame, end)] ^= 1 << rng.randrange(8)
        self.damaged = True
        return True


@dataclass
class Op:
    client: int
    kind: str  # put | cas | get
    key: str
    a: int | None
    b: int | None
    inv: int
    resp: int | None = None
    result: Any = None
    index: int = 0  # the log index that answered (mutations)


@dataclass
class Client:
    cid: int
    seq: int = 0
    op: Op | None = None
    hint: int = 0
    attempt_at: int = 0


@dataclass
class Params:
    nodes: int = 3
    loss: float = 0.0
    dup: float = 0.0
    max_delay: int = 12
    fault_every: int = 60  # mean time units between faults
    crash_weight: int = 2
    disk_weight: int = 0  # mid-WAL corruption, and wiped disks
    disk_delay: int = 4  # max time units an fsync takes
    async_writes: bool = False  # leaders write in the background (RaftCore.accept)
    drift: int = 0  # each node's tick period is TICK +- drift
    snapshot_every: int = 0  # 0: never
    fault_time: int = 600
    settle_time: int = 1500
    clients: int = 3
    max_ops: int = 24
    election_tick: int = 5
    lease: bool = False  # the leader answers reads under a lease (as MetaService does)
    lease_fraction: float = LEASE_FRACTION  # of an election timeout (tests make it unsafe)
    member_weight: int = 0  # membership changes among the faults
    max_members: int = 5  # voters and learners the operator adds up to


class SafetyViolation(AssertionError):
    pass


class Checker:
    """Raft's safety properties, checked incrementally after every event."""

    def __init__(self) -> None:
        self.leaders: dict[int, int] = {}  # term -> leader
        self.entries: dict[tuple[int, int], tuple[bytes, int, int]] = {}  # (index, term) -> (data, kind, prev term)
        self.applied: dict[int, tuple[int, bytes]] = {}  # index -> (term, data)
        self.commit_term: dict[int, tuple[int, int]] = {}  # index -> (leader term, entry term)
        self.max_commit = 0
        self.configs: dict[int, membership.Membership] = {}  # index -> committed CONFIG

    def on_membership(self, node: SimNode) -> None:
        """The configuration a replica uses is the newest in its log (or its
        snapshot's, if its log holds none)."""
        core = node.core
        newest = None
        for e in reversed(core.log.entries):
            if e.kind is EntryKind.CONFIG:
                newest = membership.decode(e.data)
                break
        if newest is None:
            snap = core.log.pending_snapshot or core.snapshot
            if snap is not None and snap.meta.voters:
                newest = snap.meta.membership
        if newest is not None and newest != core.membership:
            raise SafetyViolation(f"node {node.id} uses {core.membership}, its log says {newest}")

    def on_ready(self, node: SimNode, rd: Ready) -> None:
        core = node.core
        if rd.soft_state is not None and rd.soft_state.role is Role.LEADER:
            term = rd.soft_state.term
            other = self.leaders.setdefault(term, node.id)
            if other != node.id:
                raise SafetyViolation(f"election safety: {other} and {node.id} both lead term {term}")
            # Leader completeness: every entry committed in an earlier term is in
            # the new leader's log. (A leader of an older term can still win,
            # late, with votes that were delayed in the network.)
            for index, (c, t) in self.commit_term.items():
                if c < term and index > core.log.snap_index and core.log.term(index) != t:
                    raise SafetyViolation(f"leader completeness: leader {node.id} of term {term} "
                                          f"lacks entry {index} committed in term {c}")
        if core.log.committed > self.max_commit:
            # Newly committed, by a leader of a term <= ours (so this record
            # can only make the completeness check weaker, never wrong).
            for index in range(self.max_commit + 1, core.log.committed + 1):
                t = core.log.term(index)
                if t is None:
                    t = self.applied[index][0]
                self.commit_term[index] = (core.term, t)
            self.max_commit = core.log.committed
        for e in rd.entries:
            prev = core.log.term(e.index - 1)
            if prev is None:
                raise SafetyViolation(f"node {node.id}: entry {e.index} has no predecessor")
            key = (e.index, e.term)
            seen = self.entries.setdefault(key, (e.data, int(e.kind), prev))
            if seen != (e.data, int(e.kind), prev):
                raise SafetyViolation(f"log matching: entry {key} differs between logs")
        self.on_membership(node)

    def on_apply(self, node: SimNode, index: int, term: int, data: bytes) -> None:
        if index != node.applied + 1:
            raise SafetyViolation(f"node {node.id} applied {index} after {node.applied}")
        seen = self.applied.setdefault(index, (term, data))
        if seen != (term, data):
            raise SafetyViolation(f"state machine safety: index {index} applied as {seen[0]} and {term}")

    def on_config_applied(self, index: int, new: membership.Membership) -> None:
        """Committed configurations change one voter at a time."""
        self.configs[index] = new
        order = sorted(self.configs)
        k = order.index(index)
        for a, b in zip(order[max(k - 1, 0):k + 1], order[k:k + 2], strict=False):
            if a != b:
                try:
                    membership.check_change(self.configs[a], self.configs[b])
                except InvalidArgument as exc:
                    raise SafetyViolation(f"committed configurations {a} -> {b}: "
                                          f"{exc.message}") from None


class SimNode:
    def __init__(self, sim: Sim, node_id: int, bootstrap: list[int]) -> None:
        self.sim = sim
        self.id = node_id
        self.bootstrap = bootstrap  # the first configuration, or [] for one that joins
        self.disk = SimDisk()
        self.alive = False
        self.inbox: list[Any] = []
        self.paused_until = 0
        self.tick_period = TICK
        self.busy: Ready | None = None
        self.writing: list[tuple[Ready, int]] = []  # accepted Readys and where their writes end
        self.disk_delay: int | None = None  # this disk's fsync time, if not the sim's random one
        self.pending: dict[int, tuple[int, Op]] = {}  # index -> (term, op)
        # read seq -> (get op, local clock when the read-index round began, lease epoch)
        self.reads: dict[int, tuple[Op, float, tuple[int, int]]] = {}
        self.released: list[tuple[int, Op, float, tuple[int, int]]] = []  # waiting for apply
        self.lease = ReadLease(sim.lease_duration)
        self.applied = 0
        self.core: RaftCore
        self.sm = KV()
        self.disk_lost = False  # wiped or damaged, and not caught up since
        self.start()

    def start(self) -> None:
        sim = self.sim
        snap = storage.decode_snapshot(self.disk.snapshot) if self.disk.snapshot else None
        # What RaftStorage.open does: refuse damage before the tail (a crash
        # never makes that), cut a bad last record.
        try:
            rep, res = storage.recover(bytes(self.disk.wal),
                                       snap.meta if snap else SnapshotMeta(), f"node {self.id}")
        except Corrupt as exc:
            if not self.disk.damaged:
                raise SafetyViolation(f"node {self.id} refused a WAL only a crash touched: "
                                      f"{exc}") from None
            # The documented way back: the operator moves the data aside and
            # restarts the replica empty; it rebuilds from its peers.
            sim.rebuilds += 1
            self.disk = SimDisk()
            self.start()
            return
        if self.disk.damaged:
            raise SafetyViolation(f"node {self.id} started from a damaged WAL: {res.problem}")
        if res.problem is not None:
            self.disk.cut(res.valid_len)
        self.core = RaftCore(self.id, self.bootstrap, rng=random.Random(sim.rng.random()),
                             config=sim.config, hard_state=rep.hard_state, snapshot=snap,
                             entries=rep.entries)
        self.sm = KV()
        self.applied = 0
        if snap is not None:
            self.sm.restore(snap.data)
            self.applied = snap.meta.index
        self.alive = True
        self.busy = None
        self.writing = []
        self.inbox = []
        self.paused_until = 0
        self.lease = ReadLease(sim.lease_duration)  # a new process remembers no lease
        self.process()

    def rebuilding(self) -> bool:
        """Its disk was lost, or is new, and it has not caught up since (a
        replica that never finished its first start may have lost a disk
        before, for all anyone can tell)."""
        if not self.alive:  # what it will start from
            if self.disk.damaged:
                return True
            snap = storage.decode_snapshot(self.disk.snapshot) if self.disk.snapshot else None
            rep, _ = storage.recover(bytes(self.disk.wal), snap.meta if snap else SnapshotMeta(),
                                     f"node {self.id}")
            return self.disk_lost or rep.hard_state.rebuilding or rep.hard_state.discovering
        core = self.core
        if not (core.discovering or core.rebuilding):
            self.disk_lost = False
        return self.disk_lost or core.rebuilding or core.discovering

    def crash(self) -> None:
        self.alive = False
        self.disk.crash(self.sim.rng)
        self.busy = None
        self.writing = []
        self.inbox = []
        self.pending.clear()
        self.reads.clear()
        self.released.clear()

    # -- inputs: queued while the node is busy (fsync) or paused (a stall)
    def _can_run(self) -> bool:
        return self.alive and self.busy is None and self.paused_until <= self.sim.now

    def deliver(self, m: Message) -> None:
        if self.alive:
            self.inbox.append(m)
            self.process()

    def tick(self) -> None:
        if self.alive and self.paused_until <= self.sim.now:  # a stalled clock misses ticks
            self.inbox.append(None)
            self.process()

    def submit(self, op: Op, command: bytes | None) -> None:
        if self.alive:
            self.inbox.append((op, command))
            self.process()

    def epoch(self) -> tuple[int, int]:
        return self.core.term, self.core.conf_index

    def local_now(self) -> float:
        """This node's clock: it runs at TICK per tick_period of real time."""
        return self.sim.now * TICK / self.tick_period

    def _submit(self, op: Op, command: bytes | None) -> None:
        """A client attempt; NotLeader comes back as a hint."""
        client = self.sim.clients[op.client]
        sim = self.sim
        try:
            if command is None:
                core = self.core
                if sim.params.lease and core.is_leader and self.lease.valid(self.epoch(),
                                                                            self.local_now()):
                    sim.lease_reads += 1  # what MetaService does: answer at once
                    sim.complete(op, self.sm.data.get(op.key))
                    return
                self.reads[core.read_index()] = (op, self.local_now(), self.epoch())
            else:
                first, term = self.core.propose([command])
                self.pending[first] = (term, op)
        except NotLeader as exc:
            client.hint = exc.details.get("leader_id", 0)

    def pause(self, duration: int) -> None:
        self.paused_until = self.sim.now + duration
        self.sim.schedule(duration, lambda _: self.process(), None)

    # -- the driver loop
    def process(self) -> None:
        sim = self.sim
        while self._can_run():
            while self.inbox:
                m = self.inbox.pop(0)
                if m is None:
                    self.core.tick()
                elif type(m) is tuple:
                    self._submit(*m)
                else:
                    try:
                        self.core.step(m)
                    except InvalidMessage as exc:
                        raise SafetyViolation(f"node {self.id} refused an honest message: "
                                              f"{exc}") from None
            if not self.core.has_ready():
                return
            if self.core.writing and not self._writes_async():
                return  # the synchronous way waits for the writes (``write_synced`` resumes)
            rd = self.core.ready()
            sim.checker.on_ready(self, rd)
            if rd.soft_state is not None and rd.soft_state.role is not Role.LEADER:
                self.reads.clear()  # lost leadership: those reads fail, clients retry
                if self.id not in self.core.voters and self.id in sim.checker.leaders.values():
                    sim.removed_leaders += 1
            for m in rd.eager_messages:
                sim.send(m)
            if rd.snapshot is not None:
                self.disk.snapshot = storage.encode_snapshot(rd.snapshot)
                self.disk.replace_wal(storage.encode_base(rd.snapshot.meta.index, rd.snapshot.meta.term))
            self.disk.append(storage.encode_ready(rd.entries, rd.hard_state))
            if self.core.writing or (rd.must_sync and self._writes_async()):
                self.write_async(rd)
                continue
            if rd.must_sync and sim.rng.random() < 0.7:
                self.busy = rd
                sim.schedule(self._fsync_time(), self.synced, rd)
                return
            self.finish(rd)

    def _fsync_time(self) -> int:
        return self.disk_delay or self.sim.rng.randint(1, self.sim.params.disk_delay)

    def _writes_async(self) -> bool:
        core = self.core
        return self.sim.params.async_writes and core.is_leader and core.log.pending_snapshot is None

    def write_async(self, rd: Ready) -> None:
        """What ``driver.RaftNode._write_async`` does: the write is under
        way (not synced: a crash may lose it), the node applies and goes on.
        A write without an fsync is done when the writes before it are."""
        self.writing.append((rd, len(self.disk.wal)))
        if self.core.committed > self.core.log.stable:
            self.sim.early_commits += 1
        self.apply(rd)
        self.core.accept(rd)
        if rd.must_sync:
            # Often the slowest disk of all (it serves the clients too): so
            # the followers' acks come first and commit what it lacks.
            delay = self._fsync_time() * self.sim.rng.choice((1, 4))
            self.sim.schedule(delay, self.write_synced, rd)
        # (else a write came before it: this one is done when that one is)

    def write_synced(self, rd: Ready) -> None:
        """An fsync ended: it covers every write before it in the file, and
        the writes after it that need no fsync are done too."""
        if not self.alive or all(r is not rd for r, _ in self.writing):
            return  # crashed meanwhile, or an earlier fsync covered it
        if self.paused_until > self.sim.now:
            self.sim.schedule(self.paused_until - self.sim.now, self.write_synced, rd)
            return
        if rd.must_sync:
            self.disk.syncs += 1
        covered = True
        while self.writing and (covered or not self.writing[0][0].must_sync):
            r, end = self.writing.pop(0)
            if covered:
                self.disk.synced = max(self.disk.synced, end)
            for m in r.messages:
                self.sim.send(m)
            self.core.persisted(r)
            covered = covered and r is not rd
        self.maybe_snapshot()
        self.process()

    def synced(self, rd: Ready) -> None:
        if self.busy is not rd or not self.alive:
            return  # crashed meanwhile
        if self.paused_until > self.sim.now:
            self.sim.schedule(self.paused_until - self.sim.now, self.synced, rd)
            return
        self.busy = None
        self.finish(rd)
        self.process()

    def finish(self, rd: Ready) -> None:
        sim = self.sim
        if rd.must_sync:
            self.disk.synced = len(self.disk.wal)
            self.disk.syncs += 1
        for m in rd.messages:
            sim.send(m)
        self.apply(rd)
        self.core.advance(rd)
        self.maybe_snapshot()

    def apply(self, rd: Ready) -> None:
        sim = self.sim
        if rd.snapshot is not None:
            self.sm.restore(rd.snapshot.data)
            self.applied = rd.snapshot.meta.index
            for idx in [i for i in self.pending if i <= self.applied]:
                self.pending.pop(idx)  # outcome unknown here: clients retry
        for e in rd.committed_entries:
            sim.checker.on_apply(self, e.index, e.term, e.data)
            if e.kind is EntryKind.CONFIG:
                sim.checker.on_config_applied(e.index, membership.decode(e.data))
            self.applied = e.index
            result = self.sm.apply(e.index, e.data) if e.kind is EntryKind.NORMAL else None
            waiting = self.pending.pop(e.index, None)
            if waiting is not None and waiting[0] == e.term:
                waiting[1].index = e.index
                sim.complete(waiting[1], result)
        for rs in rd.read_states:
            read = self.reads.pop(rs.seq, None)
            if read is not None:
                self.released.append((rs.index, *read))
        if self.released:
            still = []
            for index, op, started, epoch in self.released:
                if self.applied >= index:
                    sim.complete(op, self.sm.data.get(op.key))
                    if sim.params.lease and self.core.is_leader and self.epoch() == epoch:
                        self.lease.confirmed(epoch, started)
                else:
                    still.append((index, op, started, epoch))
            self.released = still

    def maybe_snapshot(self) -> None:
        """Only of entries on this disk, with no write under way (the driver's rule)."""
        every, core = self.sim.params.snapshot_every, self.core
        if (every and core.applied - core.log.snap_index >= every and not core.writing
                and core.log.stable >= core.applied):
            self.take_snapshot()

    def take_snapshot(self) -> None:
        index = self.core.applied
        snap = Snapshot(self.core.snapshot_meta(index), self.sm.snapshot())
        self.disk.snapshot = storage.encode_snapshot(snap)
        self.core.compact(snap)
        self.disk.replace_wal(
            storage.encode_base(index, snap.meta.term)
            + storage.encode_ready(self.core.stable_entries(), self.core.persisted_hard_state()))


# An event: (at, seq, fn, arg). A plain tuple, so the heap compares in C; seq is
# unique, so fn and arg are never compared.
_Event = tuple[int, int, Any, Any]


class Sim:
    def __init__(self, seed: int, params: Params) -> None:
        self.seed = seed
        self.params = params
        self.rng = random.Random(seed)
        self.config = RaftConfig(election_tick=params.election_tick, heartbeat_tick=1,
                                 max_append_bytes=64, max_inflight=4)
        self.ids = list(range(1, params.nodes + 1))
        self.now = 0
        self.events = 0
        self._queue: list[_Event] = []
        self._seq = 0
        self.blocked: set[tuple[int, int]] = set()
        self.loss = params.loss
        self.dup = params.dup
        self.checker = Checker()
        self.lease_duration = params.lease_fraction * params.election_tick * TICK
        self.lease_reads = 0
        self.damaged = 0  # WALs damaged before their tail
        self.early_commits = 0  # leaders' commits past their own synced log (async writes)
        self.rebuilds = 0  # replicas started from an empty disk after a wipe or a refusal
        self.history: list[Op] = []
        self.clients = [Client(c) for c in range(params.clients)]
        self.value = 0
        self.sent: dict[str, int] = {}  # message type -> count
        self.nodes = {i: SimNode(self, i, self.ids) for i in self.ids}
        for n in self.nodes.values():  # clocks drift: each node ticks at its own rate
            n.tick_period = TICK + self.rng.randint(-params.drift, params.drift)
        for i in self.ids:  # every node ticks every TICK, with its own phase
            self.schedule(self.rng.randint(1, TICK), self._tick, i)
        # The operator's membership steps, done in order on the leader:
        # ("add", id) or ("remove", id); replicas whose disk was lost after
        # the membership changed are ``gone`` (never restarted).
        self.todo: list[tuple[str, int]] = []
        self.gone: set[int] = set()
        self.changed_membership = False
        self.member_changes = 0  # configurations proposed
        self.removed_leaders = 0  # leaders that committed their own removal

    def add_node(self) -> SimNode:
        """A new replica with an empty disk that joins (``voters=()``)."""
        nid = max(self.nodes) + 1
        node = SimNode(self, nid, [])
        node.tick_period = TICK + self.rng.randint(-self.params.drift, self.params.drift)
        self.nodes[nid] = node
        self.schedule(self.rng.randint(1, TICK), self._tick, nid)
        return node

    def operator_step(self) -> None:
        """Try the operator's next membership step on a leader."""
        if not self.todo or any(n.rebuilding() for n in self.nodes.values()
                                if n.id not in self.gone):
            return  # a replica rebuilding in place needs its first configuration
        leaders = sorted(self._leaders(), key=lambda lt: lt[1])
        if not leaders:
            return
        leader = self.nodes[leaders[-1][0]]
        op, nid = self.todo[0]
        if (nid in self.members()) == (op == "add"):
            self.todo.pop(0)  # done: committed
            return
        now = leader.core.membership
        try:
            if op == "add":
                new = now.add_learner(nid, f"sim:{nid}")
            else:
                new = now.remove(nid)
        except InvalidArgument:
            return  # proposed already, not committed yet
        try:
            leader.core.propose_membership(new)
        except (Busy, NotLeader):
            return  # retried at the next step
        self.member_changes += 1
        self.changed_membership = True
        leader.process()

    def _operator(self, _: Any) -> None:
        self.operator_step()
        self.schedule(self.rng.randint(TICK, 4 * TICK), self._operator, None)

    def members(self) -> tuple[int, ...]:
        """The newest committed configuration's members."""
        if not self.checker.configs:
            return tuple(self.ids)
        return self.checker.configs[max(self.checker.configs)].members

    def voters(self) -> tuple[int, ...]:
        if not self.checker.configs:
            return tuple(self.ids)
        return self.checker.configs[max(self.checker.configs)].voters

    # -- event queue
    def schedule(self, delay: int, fn: Any, arg: Any) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (self.now + delay, self._seq, fn, arg))

    def run_until(self, t: int, stop: Any = None) -> bool:
        while self._queue and self._queue[0][0] <= t:
            self.now, _, fn, arg = heapq.heappop(self._queue)
            self.events += 1
            fn(arg)
            if stop is not None and stop():
                return True
        self.now = t
        return False

    def _tick(self, node_id: int) -> None:
        node = self.nodes[node_id]
        node.tick()
        self.schedule(node.tick_period, self._tick, node_id)

    # -- network
    def send(self, m: Message) -> None:
        name = type(m).__name__
        self.sent[name] = self.sent.get(name, 0) + 1
        if (m.src, m.dst) in self.blocked or self.rng.random() < self.loss:
            return
        if self.rng.random() < 0.2:  # exercise the codec on a share of the traffic
            decoded = wire.decode(wire.encode(m))
            assert decoded == m, (decoded, m)
        self.schedule(self.rng.randint(1, self.params.max_delay), self._deliver, m)
        if self.rng.random() < self.dup:
            self.schedule(self.rng.randint(1, self.params.max_delay * 2), self._deliver, m)

    def _deliver(self, m: Message) -> None:
        if (m.src, m.dst) not in self.blocked and m.dst in self.nodes:
            self.nodes[m.dst].deliver(m)

    # -- clients
    def _client_step(self, cid: int) -> None:
        client = self.clients[cid]
        rng = self.rng
        if client.op is None:
            if len(self.history) >= self.params.max_ops:
                return
            # Lease schedules read more: a lease lasts half an election timeout.
            kind = rng.choice(("put", "cas", "get", "get", "get") if self.params.lease
                              else ("put", "put", "cas", "get", "get"))
            if len(self.history) + 1 == self.params.max_ops and self.now >= self.params.fault_time:
                kind = "put"  # the final probe
            key = rng.choice(("x", "y"))
            self.value += 1
            a: int | None = None
            b: int | None = None
            if kind == "put":
                a = self.value
            elif kind == "cas":
                a, b = rng.choice((None, self.value - 1, self.value - 2)), self.value
            client.seq += 1
            client.op = Op(cid, kind, key, a, b, inv=self._stamp())
            self.history.append(client.op)
        op = client.op
        alive = [n for n in self.nodes.values() if n.alive]
        if alive:
            node = self.nodes.get(client.hint)
            if node is None or not node.alive or rng.random() < 0.2:
                node = rng.choice(alive)
            cmd = None if op.kind == "get" else msgpack.packb(
                [f"c{cid}", client.seq, op.kind, op.key, op.a, op.b])
            node.submit(op, cmd)
        # Retry the same op (same seq) later unless it completed by then.
        self.schedule(rng.randint(TICK, 6 * TICK), self._client_retry, (cid, op))

    def _client_retry(self, arg: tuple[int, Op]) -> None:
        cid, op = arg
        if self.clients[cid].op is op:
            self._client_step(cid)

    def _client_next(self, cid: int) -> None:
        if self.clients[cid].op is None:
            self._client_step(cid)

    def _stamp(self) -> int:
        self._seq += 1
        return self._seq

    def complete(self, op: Op, result: Any) -> None:
        if op.resp is not None:
            return  # an older attempt of the same op answered already
        op.resp = self._stamp()
        op.result = result
        client = self.clients[op.client]
        if client.op is op:
            client.op = None
            self.schedule(self.rng.randint(1, 3 * TICK), self._client_next, op.client)

    # -- faults
    def _fault(self, _: Any) -> None:
        rng = self.rng
        p = self.params
        choice = rng.choices(
            ("crash", "crash_leader", "restart", "partition", "isolate_leader", "oneway", "heal",
             "loss", "pause", "corrupt", "wipe", "member"),
            weights=(p.crash_weight, p.crash_weight, 3, 2, 2, 2, 3, 1, 2, p.disk_weight,
                     p.disk_weight, p.member_weight))[0]
        ids = list(self.nodes)
        dead = [n for n in self.nodes.values() if not n.alive and n.id not in self.gone]
        alive = [n for n in self.nodes.values() if n.alive]
        leaders = [n for n in alive if n.core.is_leader]
        if choice == "crash_leader" and leaders:
            rng.choice(leaders).crash()
        elif choice == "crash" and alive:
            rng.choice(alive).crash()
        elif choice == "restart" and dead:
            rng.choice(dead).start()
        elif choice in ("partition", "isolate_leader"):
            if choice == "isolate_leader" and leaders:
                side = {rng.choice(leaders).id}
            else:
                side = set(rng.sample(ids, rng.randint(1, len(ids) // 2)))
            self.blocked = {(a, b) for a in ids for b in ids
                            if a != b and ((a in side) != (b in side))}
        elif choice == "oneway":
            a, b = rng.sample(ids, 2)
            self.blocked.add((a, b))
        elif choice == "heal":
            self.blocked = set()
        elif choice == "pause" and alive:  # a stalled process (GC, swap): the leader, mostly
            node = rng.choice(leaders) if leaders and rng.random() < 0.7 else rng.choice(alive)
            node.pause(rng.randint(1, 20) * TICK)
        elif choice == "loss":
            self.loss = rng.choice((0.0, 0.05, 0.3))
        elif choice == "member" and not any(
                n.rebuilding() for n in self.nodes.values() if n.id not in self.gone):
            self._membership_fault()
        elif choice in ("corrupt", "wipe") and self.changed_membership:
            # Rebuilding in place asks the first configuration's peers, so
            # once the membership changed a lost disk means a new replica.
            if not alive or not self._membership_settled():
                return self.schedule(rng.randint(1, 2 * p.fault_every), self._fault, None)
            node = rng.choice(alive)
            node.crash()
            self.gone.add(node.id)
            self.todo += [("add", self.add_node().id), ("remove", node.id)]
        elif choice in ("corrupt", "wipe") and alive and not self.todo and not any(
                n.rebuilding() for n in self.nodes.values()):
            # One replica's disk at a time (docs/raft.md): until a rebuilt
            # replica has caught up, its disk is as good as lost.
            node = rng.choice(alive)
            node.crash()
            if choice == "wipe":  # a lost disk: the operator restarts it empty
                node.disk = SimDisk()
                node.disk_lost = True
                self.rebuilds += 1
            elif node.disk.damage(rng):  # bit rot before the WAL's tail
                node.disk_lost = True
                self.damaged += 1
        self.schedule(rng.randint(1, 2 * p.fault_every), self._fault, None)

    def _membership_settled(self) -> bool:
        """No change pending: a leader's configuration is committed, and has
        no replica that was lost. (A lost replica while a change is open can
        stall the cluster for good, as in the thesis: {1,2,3} -> {1,3} with
        1 lost leaves 3 alone with a quorum of two.)"""
        if self.todo or self.gone & set(self.members()) or len(self.voters()) < 3:
            return False
        return any(self.nodes[i].core.conf_index <= self.nodes[i].core.committed
                   for i, _ in self._leaders())

    def _membership_fault(self) -> None:
        """The operator adds, removes or replaces a replica (queued in
        ``todo``, done one step at a time on the leader)."""
        rng = self.rng
        if self.todo:
            return
        members = [i for i in self.members() if i not in self.gone]
        kind = rng.choice(("add", "remove", "replace"))
        if kind == "add" and len(members) < self.params.max_members:
            self.todo.append(("add", self.add_node().id))
        elif kind == "remove" and len(self.voters()) > 2:
            self.todo.append(("remove", rng.choice(members)))
        elif kind == "replace":
            old = rng.choice(members)
            self.todo += [("add", self.add_node().id), ("remove", old)]

    # -- the whole schedule
    def run(self) -> None:
        p = self.params
        for c in range(p.clients):
            self.schedule(self.rng.randint(1, 20 * TICK), self._client_step, c)
        self.schedule(self.rng.randint(1, 2 * p.fault_every), self._fault, None)
        if p.member_weight:
            self.schedule(self.rng.randint(TICK, 4 * TICK), self._operator, None)
        self.run_until(p.fault_time)
        # Heal everything and require progress: liveness after the storm.
        self._queue = [e for e in self._queue if e[2] != self._fault]
        heapq.heapify(self._queue)
        self.blocked = set()
        self.loss = 0.0
        self.dup = 0.0
        for n in self.nodes.values():
            if not n.alive and n.id not in self.gone:
                n.start()

        def done() -> bool:
            return all(op.resp is not None for op in self.history) and not self.todo

        deadline = self.now + p.settle_time
        self.run_until(deadline, stop=done)
        if not done():
            raise SafetyViolation(f"liveness: client ops still open after settling "
                                  f"(leaders {self._leaders()})")
        # A final write must reach every replica.
        self.params = p = Params(**{**p.__dict__, "max_ops": len(self.history) + 1})
        for c in self.clients:
            if c.op is None:
                self._client_step(c.cid)
                break
        probe = self.history[-1]
        if not self.run_until(self.now + p.settle_time, stop=lambda: probe.resp is not None):
            raise SafetyViolation(f"liveness: final write not answered (leaders {self._leaders()})")

        def replicated() -> bool:
            # Every member has the probe, and every learner has been promoted.
            leaders = self._leaders()
            return bool(leaders) and not self.nodes[leaders[0][0]].core.learners and all(
                self.nodes[i].applied >= probe.index for i in self.members())

        if not self.run_until(self.now + p.settle_time, stop=replicated):
            raise SafetyViolation(f"liveness: entry {probe.index} not applied everywhere, or a "
                                  f"learner not promoted: members {self.members()}, "
                                  f"{[(n.id, n.applied) for n in self.nodes.values()]}")
        by_index: dict[int, set[str]] = {}
        for n in self.nodes.values():
            by_index.setdefault(n.applied, set()).add(repr(sorted(n.sm.data.items())))
        if any(len(states) != 1 for states in by_index.values()):
            raise SafetyViolation(f"replicas differ at the same applied index: {by_index}")

    def _leaders(self) -> list[tuple[int, int]]:
        return [(n.id, n.core.term) for n in self.nodes.values() if n.alive and n.core.is_leader]


# ------------------------------------------------------- linearizability
def _step_model(state: int | None, op: Op) -> tuple[bool, int | None]:
    """Apply ``op`` to one key's value; (result matches, new value)."""
    if op.kind == "put":
        return op.resp is None or op.result is True, op.a
    if op.kind == "get":
        return op.result == state, state
    ok = state == op.a
    if op.resp is not None and op.result != ok:
        return False, state
    return True, (op.b if ok else state)


def check_linearizable(history: list[Op]) -> None:
    """Wing & Gong search with memoisation (Lowe's WGL), per key.

    Completed ops must all be linearized inside their [inv, resp] interval;
    an op that never answered (``resp is None``) may take effect at any point
    after its invocation, or never. Reads that never answered are dropped.
    """
    keys = {op.key for op in history}
    for key in keys:
        ops = [op for op in history if op.key == key and not (op.kind == "get" and op.resp is None)]
        if not _wgl(ops):
            lines = "\n".join(f"  c{o.client} {o.kind}({o.a},{o.b}) [{o.inv},{o.resp}] -> {o.result}"
                              for o in sorted(ops, key=lambda o: o.inv))
            raise SafetyViolation(f"history of key {key!r} is not linearizable:\n{lines}")


def _wgl(ops: list[Op]) -> bool:
    n = len(ops)
    inf = float("inf")
    resp = [o.resp if o.resp is not None else inf for o in ops]
    need = 0
    for i, o in enumerate(ops):
        if o.resp is not None:
            need |= 1 << i
    seen: set[tuple[int, int | None]] = set()
    stack: list[tuple[int, int | None]] = [(0, None)]
    while stack:
        done, state = stack.pop()
        if done & need == need:
            return True
        if (done, state) in seen:
            continue
        seen.add((done, state))
        horizon = min(resp[i] for i in range(n) if not done >> i & 1)
        for i in range(n):
            if done >> i & 1 or ops[i].inv > horizon:
                continue
            ok, new = _step_model(state, ops[i])
            if ok:
                stack.append((done | 1 << i, new))
    return False
