"""The trio driver: runs a :class:`RaftCore` with real time, disk and RPC.

Theory of operation
-------------------
Inputs (peer messages from the ``raft_step`` RPC handler, client proposals
and read requests, ticks from a ticker task) are appended to plain lists and
wake the single loop task. The loop drains *all* pending inputs into the core
(no await while draining, so it is atomic), then handles Readys one at a time
as ``core.py`` prescribes: eager messages out, one WAL write + fsync,
messages out, apply, advance. Proposals that arrive together become one log
append and share one fsync (group commit). A leader does not wait for its
own write: its Readys go to one writer thread (``_WalWriter``, see
``RaftCore.accept``), where those that queue behind a write share its fsync,
and the loop goes on stepping acks, applying and answering, so the
followers' acks can commit an entry before the leader's own fsync ends.
Everything else waits for those writes first (``_flush``).

Each peer has a sender task that ships everything queued for it in one
``raft_step`` call (bulk payload, msgpack batch), one call at a time, so what
is queued meanwhile goes in the next call (one AppendEntries carries many
proposals). The call asks for the answers in its reply (``answer=True``):
the receiver's handler waits until its loop has handled the Ready those
messages made (the fsync, for an Append) and returns what that Ready
queued for the caller -- the AppendResp and HeartbeatResp travel back on
the call that caused them, instead of as a call of their own, and the
receiver's sender task is not woken for them. A failed or slow call just
drops those messages: Raft tolerates loss and retries by itself. A peer that
refuses the ``answer`` argument (an older version) gets plain calls.

Snapshots are taken off the loop: at a Ready boundary (no await between
reading the applied index and the fork, so the copy is exactly the state at
that index) the process forks (``snapshot_child.py``); the child serializes
its copy-on-write view of the state machine into a pipe and exits, while the
parent goes on stepping, persisting, applying and answering. A helper task collects the
bytes, writes the snapshot file, and hands it to the loop, which compacts
the log and rewrites the WAL between two Readys (the WAL is only ever
written by the loop). Where fork is unavailable or ``fork_snapshots`` is
off, the state machine is serialized inline as before.

Peer input is untrusted. ``raft_step`` drops messages that are not a peer's
to this node (and snapshots, which come chunked through ``raft_snapshot``,
spooled to disk and size-capped by ``transfer.py``); the loop drops what the
core refuses (``InvalidMessage``). Both are counted
(``cachefs_raft_refused_messages_total``) and logged at most once a second.

Proposals resolve with the state machine's apply result once their entry
(index *and* term) is applied. A :class:`~cachefs.errors.CacheFSError` raised
by ``apply`` is that command's (deterministic) answer and is raised to the
proposer; any other exception from the state machine is a bug and stops the
node. When the node stops being leader, waiting proposals fail with
``NotLeader``: the entry may or may not commit, and the client retries with
the same ``(client_id, seq)``, which the state machine answers from its
session table.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import trio
from prometheus_client import Counter, Gauge, Histogram

from cachefs.errors import CacheFSError, InvalidArgument, NotLeader, ProtocolError, Unavailable
from cachefs.rpc import CallContext, Reply, RpcPool, rpc_method

from . import messages as wire
from . import transfer
from .core import InvalidMessage, RaftConfig, RaftCore, Ready, Role
from .membership import Membership
from .messages import (
    AppendResp,
    EntryKind,
    HeartbeatResp,
    InstallSnapshot,
    Message,
    ProbeResp,
    Snapshot,
    SnapshotMeta,
    VoteResp,
)
from .snapshot_child import SnapshotChild, SnapshotChildFailed
from .storage import RaftStorage

log = logging.getLogger(__name__)

RAFT_TERM = Gauge("cachefs_raft_term", "Current Raft term", ["node"])
RAFT_LEADER = Gauge("cachefs_raft_is_leader", "1 while this replica leads", ["node"])
RAFT_ROLE = Gauge("cachefs_raft_role", "1 for this replica's current Raft role, 0 for the others", ["node", "role"])
RAFT_COMMIT = Gauge("cachefs_raft_commit_index", "Highest committed log index", ["node"])
RAFT_APPLIED = Gauge("cachefs_raft_applied_index", "Highest applied log index", ["node"])
RAFT_FSYNC = Histogram("cachefs_raft_wal_sync_seconds", "WAL write + fsync per Ready", ["node"],
                       buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1))
RAFT_BATCH = Histogram("cachefs_raft_proposals_per_append", "Proposals batched into one append",
                       ["node"], buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024))
RAFT_SYNC_BATCH = Histogram("cachefs_raft_entries_per_sync",
                            "Log entries made durable by one WAL fdatasync (group commit: the "
                            "proposals batched per fsync, on the leader and on the followers)",
                            ["node"], buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024))
# A proposal's way through this leader: appended (and sent) -> known committed
# (in a Ready's committed entries) -> applied and answered. The difference of
# the two is the state machine's share; the first is Raft's (fsyncs, acks).
_LATENCY_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.25, 1)
RAFT_COMMIT_LATENCY = Histogram("cachefs_raft_propose_commit_seconds",
                                "Leader: from a proposal's append to its entry being committed",
                                ["node"], buckets=_LATENCY_BUCKETS)
RAFT_APPLY_LATENCY = Histogram("cachefs_raft_propose_apply_seconds",
                               "Leader: from a proposal's append to its apply result",
                               ["node"], buckets=_LATENCY_BUCKETS)
RAFT_SNAPSHOTS = Counter("cachefs_raft_snapshots_total", "Snapshots taken or installed", ["node"])
RAFT_REBUILDING = Gauge("cachefs_raft_rebuilding",
                        "1 while this replica's disk is new or was lost and it has not caught up "
                        "(asking its peers' terms, or rebuilding from the leader)", ["node"])
RAFT_REFUSED = Counter("cachefs_raft_refused_messages_total",
                       "Peer messages dropped as invalid: forged, or from a buggy peer",
                       ["node", "type"])
RAFT_STORAGE_ERRORS = Counter("cachefs_raft_storage_errors_total",
                              "WAL or snapshot writes that failed (and were retried)", ["node"])


# What a raft_step reply carries back: answers to the caller's messages. Its
# own requests to the caller go by the sender task, or a reply would carry
# Appends whose acks then need a call of their own, and so on.
ANSWERS = (AppendResp, HeartbeatResp, VoteResp, ProbeResp)


class StateMachine(Protocol):
    def apply(self, index: int, command: bytes) -> Any: ...
    def snapshot(self) -> bytes: ...
    def restore(self, data: bytes) -> None: ...


class _InThread:
    """``fn(*args)`` started at once in a worker thread; ``await result()``.

    The loop goes on while the thread works (the Ready's apply overlaps its
    WAL fsync), and the hop is leaner than ``trio.to_thread.run_sync`` (no
    limiter, no contextvars copy, no cancel scope per call).
    """

    __slots__ = ("_done", "_outcome")

    def __init__(self, fn: Callable[..., None], *args: Any) -> None:
        self._done = trio.Event()
        self._outcome: Any = None
        token = trio.lowlevel.current_trio_token()
        trio.lowlevel.start_thread_soon(lambda: fn(*args),
                                        lambda result: token.run_sync_soon(self._finish, result))

    def _finish(self, result: Any) -> None:
        self._outcome = result
        self._done.set()

    async def result(self) -> None:
        """Wait for the thread (shielded: a cancelled node must not close the
        WAL under a write in flight); raise what ``fn`` raised."""
        with trio.CancelScope(shield=True):
            await self._done.wait()
        self._outcome.unwrap()


class _WalWriter:
    """A leader's WAL writes (``RaftCore.accept``), in order, in one worker thread.

    Readys queued while one is being written go in together: a write each,
    then one fdatasync for all of them (group commit across Readys). Each
    batch ends with ``done(readys, error, seconds)`` on the trio thread, in
    order. A write that fails (a full disk: ``RaftStorage.save`` leaves
    nothing of it behind) is retried in the thread, logged through
    ``failed``; anything else (a failed fdatasync, ``IOFailure``) is handed
    to ``done`` and stops the node.
    """

    def __init__(self, storage: RaftStorage,
                 done: Callable[[list[Ready], BaseException | None, float], None],
                 failed: Callable[[Callable[..., None], OSError, float], None]) -> None:
        self._storage = storage
        self._done = done
        self._failed = failed
        self._jobs: queue.SimpleQueue[Ready | None] = queue.SimpleQueue()
        self._token = trio.lowlevel.current_trio_token()
        self._stopped = trio.Event()
        trio.lowlevel.start_thread_soon(
            self._work, lambda _: self._token.run_sync_soon(self._stopped.set))

    def submit(self, rd: Ready) -> None:
        self._jobs.put(rd)

    async def stop(self) -> None:
        """Finish what was submitted, then end the thread (shielded: the
        WAL must not be closed under a write)."""
        self._jobs.put(None)
        with trio.CancelScope(shield=True):
            await self._stopped.wait()

    def _work(self) -> None:
        jobs = self._jobs
        while True:
            batch = [jobs.get()]
            while not jobs.empty():
                batch.append(jobs.get_nowait())
            readys = [rd for rd in batch if rd is not None]
            started = time.perf_counter()
            error: BaseException | None = None
            try:
                sync = any(rd.must_sync for rd in readys)
                for k, rd in enumerate(readys):
                    self._save(rd, sync and k == len(readys) - 1)
            except BaseException as exc:  # handed to the loop, which stops the node
                error = exc
            if readys:
                self._token.run_sync_soon(self._done, readys, error,
                                          time.perf_counter() - started)
            if batch[-1] is None or error is not None:
                return

    def _save(self, rd: Ready, sync: bool) -> None:
        delay = 0.05
        while True:
            try:
                self._storage.save(rd.entries, rd.hard_state, sync)
                return
            except OSError as exc:
                self._failed(self._storage.save, exc, delay)
                time.sleep(delay)
                delay = min(2 * delay, 2.0)


class _Answer:
    """A ``raft_step(answer=True)`` call's reply, filled by the loop."""

    __slots__ = ("peer", "done", "msgs")

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.done = trio.Event()
        self.msgs: list[Message] = []


class _Waiter:
    """A one-shot result slot a caller awaits (trio has no futures)."""

    __slots__ = ("_event", "_value", "_error")

    def __init__(self) -> None:
        self._event = trio.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def set(self, value: Any) -> None:
        if not self._event.is_set():
            self._value = value
            self._event.set()

    def fail(self, error: BaseException) -> None:
        if not self._event.is_set():
            self._error = error
            self._event.set()

    async def wait(self) -> Any:
        await self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value


@dataclass(frozen=True, slots=True)
class DriverConfig:
    tick_interval: float = 0.05  # seconds per Raft tick
    snapshot_entries: int = 10_000  # applied entries between snapshots
    rpc_timeout: float = 2.0  # per raft_step call
    max_outbox: int = 10_000  # messages queued per peer before dropping the oldest
    max_inbox: int = 10_000  # peer messages waiting for the loop before dropping the oldest
    snapshot_chunk: int = 4 << 20  # InstallSnapshot travels zstd-compressed in chunks
    # Refuse an InstallSnapshot over this many bytes (spooled or decompressed):
    # receiving one holds at most one copy of its data in memory.
    max_snapshot: int = 4 << 30
    fork_snapshots: bool = True  # serialize snapshots in a forked child (see the module doc)


class RaftNode:
    """One replica: ``await RaftNode.create(...)``, then ``propose`` and
    ``read_index``. Register it on the RPC server (``server.add_service(node)``
    or ``create(..., server=server)``) so peers can reach ``raft_step``."""

    def __init__(self, node_id: int, peers: dict[int, str], core: RaftCore,
                 storage: RaftStorage, state_machine: StateMachine, pool: RpcPool,
                 dconfig: DriverConfig) -> None:
        self.id = node_id
        self.peers = dict(peers)
        self.core = core
        self.storage = storage
        self.sm = state_machine
        self.pool = pool
        self.dconfig = dconfig
        self.applied = core.log.snap_index
        self._wake = trio.Event()
        self._inbox: list[Message] = []
        self._ticks = 0
        self._proposals: list[tuple[bytes, _Waiter, Any]] = []
        self._read_requests: list[_Waiter] = []
        # index -> (term, waiter, the proposer's decoded command or None, when appended)
        self._proposed: dict[int, tuple[int, _Waiter, Any, float]] = {}
        self._reads: dict[int, list[_Waiter]] = {}  # read seq -> waiters
        self._released: list[tuple[int, list[_Waiter]]] = []  # (index, waiters)
        self._outbox: dict[int, list[Message]] = {p: [] for p in peers if p != node_id}
        self._send_wake: dict[int, trio.Event] = {p: trio.Event() for p in self._outbox}
        # peer -> its raft_step calls waiting to carry our answers back (see the module doc)
        self._answering: dict[int, int] = {}
        self._stepped: list[_Answer] = []  # those calls, for the loop's next drain
        self._plain_peers: set[int] = set()  # peers that refused ``answer`` (older versions)
        self._scope: trio.CancelScope | None = None
        self._writer: _WalWriter | None = None  # the leader's WAL writes (``_write_async``)
        self._written: list[tuple[list[Ready], BaseException | None, float]] = []
        self._written_wake = trio.Event()
        self._xfer_out = 0
        self._receiver = transfer.SnapshotReceiver(storage.data_dir, dconfig.max_snapshot)
        self._refused_quiet = 0  # refusals not logged yet (one log line a second)
        self._refused_log_at = 0.0
        self._closed = False
        self._nursery: trio.Nursery | None = None
        self.snapshotting = False  # a snapshot is being taken
        self.snapshot_child: int | None = None  # pid of the child serializing it, if forked
        self._snap_ready: Snapshot | None = None  # taken and saved, to compact the log with
        self._snap_lock = trio.Lock()  # snapshot files: ours vs. one installed from the leader
        label = str(node_id)
        self._m_term = RAFT_TERM.labels(label)
        self._m_leader = RAFT_LEADER.labels(label)
        self._m_roles = {role: RAFT_ROLE.labels(label, role.value) for role in Role}
        self._m_commit = RAFT_COMMIT.labels(label)
        self._m_applied = RAFT_APPLIED.labels(label)
        self._m_fsync = RAFT_FSYNC.labels(label)
        self._m_batch = RAFT_BATCH.labels(label)
        self._m_sync_batch = RAFT_SYNC_BATCH.labels(label)
        self._m_commit_latency = RAFT_COMMIT_LATENCY.labels(label)
        self._m_apply_latency = RAFT_APPLY_LATENCY.labels(label)
        self._m_snapshots = RAFT_SNAPSHOTS.labels(label)
        self._m_storage_errors = RAFT_STORAGE_ERRORS.labels(label)
        self._m_rebuilding = RAFT_REBUILDING.labels(label)
        self._label = label
        self._disk_state = (False, False)  # (discovering, rebuilding) as last reported
        self._conf_index = -1  # the configuration last seen (``_on_membership``)
        self.stats = {"readys": 0, "appends": 0, "entries": 0, "applied": 0, "snapshots": 0,
                      "send_errors": 0, "storage_errors": 0, "refused": 0,
                      "inbox_dropped": 0, "calls": 0, "answered": 0}

    @classmethod
    async def create(cls, node_id: int, peers: dict[int, str], data_dir: str | os.PathLike[str],
                     state_machine: StateMachine, pool: RpcPool, *, nursery: trio.Nursery,
                     server: Any = None, config: RaftConfig | None = None,
                     driver_config: DriverConfig | None = None,
                     rng: random.Random | None = None, join: bool = False) -> RaftNode:
        """Open the WAL in ``data_dir``, restore the state machine from the
        newest snapshot, and start the node's tasks in ``nursery``.

        ``peers`` maps every replica id (this one included) to "host:port":
        a new cluster's first configuration, unless ``join``: then it only
        says where the running cluster's replicas are, and this one waits as
        a learner until the leader adds it (``membership.py``). Once the log
        or a snapshot holds a configuration, that one counts, and its
        addresses are added to ``peers``. Committed entries after the
        snapshot are re-applied before the first proposal is served.

        Raises:
            InvalidArgument: ``node_id`` missing from ``peers``.
            Corrupt: the snapshot or the WAL cannot be used.
        """
        if node_id not in peers:
            raise InvalidArgument(f"raft: node {node_id} is not in peers {sorted(peers)}")
        storage = await trio.to_thread.run_sync(RaftStorage.open, data_dir)
        if storage.snapshot is not None:
            state_machine.restore(storage.snapshot.data)
        core = RaftCore(node_id, [] if join else list(peers), rng=rng or random.Random(),
                        addrs=None if join else peers,
                        config=config or RaftConfig(), hard_state=storage.hard_state,
                        snapshot=storage.snapshot, entries=storage.entries)
        node = cls(node_id, peers, core, storage, state_machine, pool,
                   driver_config or DriverConfig())
        log.info("raft node %d: term %d, log %d..%d, commit %d, snapshot %d", node_id,
                 core.term, core.log.first_index(), core.log.last_index(), core.committed,
                 core.log.snap_index)
        if server is not None:
            server.add_service(node)
        await nursery.start(node._run)
        return node

    # ------------------------------------------------------------ public API
    @property
    def is_leader(self) -> bool:
        return self.core.is_leader

    @property
    def leader_id(self) -> int:
        return self.core.lead

    @property
    def leader_addr(self) -> str | None:
        return self.peers.get(self.core.lead)

    @property
    def term(self) -> int:
        return self.core.term

    @property
    def commit_index(self) -> int:
        return self.core.committed

    @property
    def role(self) -> str:
        return self.core.role.value

    @property
    def last_index(self) -> int:
        return self.core.log.last_index()

    @property
    def lease_epoch(self) -> tuple[int, int]:
        """What a read lease is valid for (``lease.py``): term and configuration."""
        return self.core.term, self.core.conf_index

    def _not_leader(self) -> CacheFSError:
        addr = self.leader_addr
        return NotLeader(f"metanode {self.id} is not the leader"
                         + (f"; try {addr}" if addr else ""), leader=addr)

    async def propose(self, command: bytes, *, decoded: Any = None) -> Any:
        """Replicate ``command``; returns the state machine's apply result.

        ``decoded`` is what ``command`` decodes to, if the caller has it: this
        replica then applies it instead of decoding the bytes it just encoded
        (only when the entry applied at that index is this very proposal).

        Raises:
            NotLeader: not the leader, or lost leadership before the command
                was applied (it may still commit: retry with the same
                client session and seq).
            CacheFSError: whatever ``apply`` raised for this command.
        """
        if self._closed:
            raise Unavailable("raft node is closed")
        if not self.core.is_leader:
            raise self._not_leader()
        waiter = _Waiter()
        self._proposals.append((command, waiter, decoded))
        self._wake.set()
        return await waiter.wait()

    @property
    def membership(self) -> Membership:
        return self.core.membership

    async def change_membership(self, new: Membership) -> None:
        """Append configuration ``new`` and return once it is applied here.

        Raises:
            NotLeader: as for ``propose``.
            Busy: another change, or this leader's first commit, is pending.
            InvalidArgument: more than one voter changes (``membership.py``).
        """
        if self._closed:
            raise Unavailable("raft node is closed")
        if not self.core.is_leader:
            raise self._not_leader()
        # No await between here and the registration: the loop cannot apply
        # the entry before its waiter is in place.
        index, term = self.core.propose_membership(new)
        waiter = _Waiter()
        self._proposed[index] = (term, waiter, None, time.perf_counter())
        self._on_membership()
        self._wake.set()
        await waiter.wait()

    def progress(self) -> dict[int, dict[str, Any]]:
        """(Leader) each other member's replication: match index and lag."""
        core = self.core
        if not core.is_leader:
            return {}
        last = core.log.last_index()
        return {i: {"match": pr.match, "lag": last - pr.match, "state": pr.state.name.lower()}
                for i, pr in core.prs.items()}

    async def read_index(self) -> None:
        """Return once this node may serve a linearizable read from its state
        machine: a quorum confirmed our leadership after the call began, and
        everything committed before it is applied here.

        Raises:
            NotLeader: with the leader's address when known.
        """
        if self._closed:
            raise Unavailable("raft node is closed")
        if not self.core.is_leader:
            raise self._not_leader()
        waiter = _Waiter()
        self._read_requests.append(waiter)
        self._wake.set()
        await waiter.wait()

    def campaign(self) -> None:
        """Start an election now instead of waiting for a timeout."""
        self.core.campaign()
        self._wake.set()

    @rpc_method
    def raft_step(self, *, answer: bool = False, payload: bytes | bytearray | memoryview | None = None,
                  ctx: CallContext | None = None) -> Awaitable[Reply | None] | None:
        """Peers' messages: a msgpack batch in the bulk payload (a plain
        method: the RPC layer runs it inline, it only queues). With
        ``answer``, the reply's payload carries what this node sends back
        once it has handled them (see the module doc).

        Raises:
            InvalidArgument: no payload.
            ProtocolError: the batch does not decode (counted as refused).
        """
        if payload is None:
            raise InvalidArgument("raft_step needs a payload")
        try:
            msgs = wire.decode_batch(bytes(payload))
        except ProtocolError as exc:
            self._refuse("batch", exc.message)
            raise
        if self._closed:
            return None
        ok = []
        for m in msgs:
            if not self._may_speak_for(ctx, m.src) or m.dst != self.id:
                who = f" (sent by {ctx.identity})" if ctx is not None else ""
                self._refuse(type(m).__name__, f"from {m.src} to {m.dst}{who}: not a peer's message "
                             f"to node {self.id}")
            else:
                ok.append(m)
        self._queue(ok)
        srcs = {m.src for m in ok}
        if not answer or len(srcs) != 1:
            return None
        # Registered here, not in the coroutine (the RPC layer starts that
        # later): the loop takes it in the same drain as the messages.
        pending = _Answer(srcs.pop())
        self._stepped.append(pending)
        self._answering[pending.peer] = self._answering.get(pending.peer, 0) + 1
        return self._reply(pending)

    def _queue(self, msgs: list[Message]) -> None:
        """Peer messages (already checked for who sent them) for the loop."""
        inbox = self._inbox
        for m in msgs:
            if isinstance(m, InstallSnapshot):
                self._refuse("InstallSnapshot", "a snapshot must come by raft_snapshot")
            else:
                inbox.append(m)
        if len(inbox) > self.dconfig.max_inbox:  # the loop is stalled (disk): Raft resends
            self.stats["inbox_dropped"] += len(inbox) - self.dconfig.max_inbox
            del inbox[: len(inbox) - self.dconfig.max_inbox]
        self._wake.set()

    async def _reply(self, answer: _Answer) -> Reply | None:
        await answer.done.wait()
        if not answer.msgs:
            return None
        self.stats["answered"] += len(answer.msgs)
        return Reply(None, wire.encode_batch(answer.msgs))

    def _answered(self, answer: _Answer) -> None:
        """(The loop) the Ready made from ``answer``'s messages is handled:
        hand it the answers we queued for its peer meanwhile (our requests to
        the peer went to the sender as usual). Should the reply never go
        (the call was cancelled), these are lost, as Raft allows."""
        peer = answer.peer
        self._answering[peer] -= 1
        box = self._outbox.get(peer)
        if box:
            answer.msgs = [m for m in box if isinstance(m, ANSWERS)]
            self._outbox[peer] = [m for m in box if not isinstance(m, ANSWERS)]
        answer.done.set()

    def _take_answers(self, peer: int, payload: bytes | bytearray | memoryview) -> None:
        """The reply to our ``raft_step`` call: ``peer``'s answers to us."""
        try:
            msgs = wire.decode_batch(bytes(payload))
        except ProtocolError as exc:
            self._refuse("batch", f"in a reply from {peer}: {exc.message}")
            return
        ok = []
        for m in msgs:
            if m.src != peer or m.dst != self.id or not isinstance(m, ANSWERS):
                self._refuse(type(m).__name__, f"from {m.src} to {m.dst} in a reply from {peer}: "
                             f"not {peer}'s answer to node {self.id}")
            else:
                ok.append(m)
        self._queue(ok)

    @rpc_method
    async def raft_snapshot(self, src: int, xfer: int, chunk: int, chunks: int, *,
                            payload: bytes | bytearray | memoryview | None = None,
                            ctx: CallContext | None = None) -> None:
        """One chunk of an InstallSnapshot from leader ``src`` (``transfer.py``);
        the last one completes the message and steps it.

        Raises:
            InvalidArgument: out of order, over ``max_snapshot``, or not from
                a peer; ProtocolError: it does not decode. Both drop the
                transfer (the leader starts again later).
        """
        if payload is None:
            raise InvalidArgument("raft_snapshot needs a payload")
        if not self._may_speak_for(ctx, src):
            self._refuse("InstallSnapshot", f"chunk from {src}: not a peer")
            raise InvalidArgument(f"raft_snapshot: {src} is not a peer of node {self.id}")
        try:
            m = await self._receiver.chunk(src, xfer, chunk, chunks, payload)
        except (InvalidArgument, ProtocolError) as exc:
            self._refuse("InstallSnapshot", exc.message)
            raise
        if m is None or self._closed:
            return
        if m.dst != self.id:
            self._refuse("InstallSnapshot", f"for node {m.dst}")
            raise InvalidArgument(f"raft_snapshot: the snapshot is for node {m.dst}")
        self._inbox.append(m)
        self._wake.set()

    def _may_speak_for(self, ctx: CallContext | None, src: int) -> bool:
        """Whether a message that says it is from ``src`` is taken at all:
        ``src`` must be another member, and the connection it came on must
        be authenticated as that member (``server:metanode-<src>``, see
        cachefs.credentials), so no client, other server or member can
        speak for a member. Without a ``ctx`` (a direct call) or on an
        insecure cluster there is no identity to check.
        """
        if src not in self.peers or src == self.id:
            return False
        return ctx is None or ctx.identity.insecure or ctx.identity.metanode_id == src

    def _refuse(self, what: str, reason: str) -> None:
        """Count a refused peer message, and log it (at most once a second:
        a hostile peer must not be able to flood the log)."""
        self.stats["refused"] += 1
        RAFT_REFUSED.labels(self._label, what).inc()
        now = time.monotonic()
        if now < self._refused_log_at:
            self._refused_quiet += 1
            return
        more = f" (and {self._refused_quiet} more since the last report)" \
            if self._refused_quiet else ""
        log.warning("raft node %d: refused a %s: %s%s", self.id, what, reason, more)
        self._refused_quiet = 0
        self._refused_log_at = now + 1.0

    def close(self) -> None:
        """Stop the node's tasks; waiting callers get ``Unavailable``."""
        if self._scope is not None:
            self._scope.cancel()

    # ------------------------------------------------------------- the loop
    async def _run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with trio.CancelScope() as self._scope:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    self._writer = _WalWriter(self.storage, self._on_written,
                                              self._storage_failed)
                    nursery.start_soon(self._ticker)
                    for peer in self._outbox:
                        nursery.start_soon(self._sender, peer)
                    self._on_membership()  # the one on disk may name more peers
                    self._wake.set()  # apply what the WAL says is committed
                    if self.core.discovering or self.core.rebuilding:
                        self._report_disk_state()
                    task_status.started()
                    await self._loop()
        finally:
            self._closed = True
            self._fail_all(Unavailable(f"raft node {self.id} stopped"))
            self._receiver.close()
            if self._writer is not None:
                await self._writer.stop()
            self.storage.close()

    async def _ticker(self) -> None:
        while True:
            await trio.sleep(self.dconfig.tick_interval)
            self._ticks += 1
            self._wake.set()

    async def _loop(self) -> None:
        core = self.core
        while True:
            await self._wake.wait()
            # Inputs drained before each Ready: the acks and proposals that
            # came during one fsync go into the next Ready with whatever
            # advance() left (one Ready, one fsync, not two).
            while True:
                self._wake = trio.Event()  # an input after this sets the new one
                if self._snap_ready is not None:
                    await self._flush()  # the WAL is rewritten: no write may be under way
                    await self._compact()
                stepped, self._stepped = self._stepped, []  # with the inbox: no await between
                self._take_written()
                self._drain()
                ready = core.has_ready()
                if ready:
                    if core.writing and not self._writes_async():
                        await self._flush()  # the synchronous way waits for the writes before
                    await self._handle_ready(core.ready())
                for pending in stepped:  # their answers are queued: the replies may go
                    self._answered(pending)
                if not ready:
                    break

    def _drain(self) -> None:
        """Every pending input into the core; no await, so atomic."""
        core = self.core
        ticks, self._ticks = self._ticks, 0
        for _ in range(ticks):
            core.tick()
        inbox, self._inbox = self._inbox, []
        for m in inbox:
            try:
                core.step(m)
            except InvalidMessage as exc:  # changed nothing: drop it
                self._refuse(type(m).__name__, exc.message)
        if self._proposals:
            props, self._proposals = self._proposals, []
            try:
                first, term = core.propose([p[0] for p in props])
            except NotLeader:
                for _, w, _ in props:
                    w.fail(self._not_leader())
            else:
                self.stats["appends"] += 1
                self.stats["entries"] += len(props)
                self._m_batch.observe(len(props))
                proposed = self._proposed
                now = time.perf_counter()
                for k, (_, w, decoded) in enumerate(props, first):
                    proposed[k] = (term, w, decoded, now)
        if self._read_requests:
            reads, self._read_requests = self._read_requests, []
            try:
                self._reads[core.read_index()] = reads
            except NotLeader:
                for w in reads:
                    w.fail(self._not_leader())

    def _writes_async(self) -> bool:
        """Whether the next Ready is written in the background (``RaftCore.accept``):
        a leader's, without a snapshot to install."""
        return self.core.is_leader and self.core.log.pending_snapshot is None

    def _on_written(self, readys: list[Ready], error: BaseException | None,
                    seconds: float) -> None:
        """(The writer, on the trio thread) a batch of accepted Readys is on disk."""
        self._written.append((readys, error, seconds))
        self._written_wake.set()
        self._wake.set()

    def _take_written(self) -> None:
        """Tell the core what the writer made durable; send what waited for it.

        Raises:
            whatever the write raised besides a full disk (``IOFailure``):
            the node stops, as it would inline.
        """
        written, self._written = self._written, []
        for readys, error, seconds in written:
            if error is not None:
                raise error
            self._m_fsync.observe(seconds)
            self._m_sync_batch.observe(sum(len(rd.entries) for rd in readys))
            for rd in readys:
                self._send(rd.messages)
                self.core.persisted(rd)

    async def _flush(self) -> None:
        """Wait until no write is under way (the synchronous way, compaction)."""
        while self.core.writing:
            await self._written_wake.wait()
            self._written_wake = trio.Event()
            self._take_written()

    async def _write_async(self, rd: Ready) -> None:
        """A leader's Ready: its write goes to the writer thread and the loop
        goes on; followers' acks may commit its entries before the write ends
        (the core counts the leader's own log only once ``persisted``)."""
        assert self._writer is not None
        self._writer.submit(rd)
        self._apply_ready(rd)
        if rd.soft_state is not None:
            self._on_soft_state(rd)
        self.core.accept(rd)
        self._after_ready()
        if self._snapshot_due():
            await self._flush()  # no apply meanwhile: the state is still at self.applied
            self._maybe_snapshot()

    async def _handle_ready(self, rd: Ready) -> None:
        self.stats["readys"] += 1
        self._send(rd.eager_messages)
        if self.core.writing or (rd.must_sync and self._writes_async()):
            await self._write_async(rd)
            return
        if rd.snapshot is not None:
            snap = rd.snapshot
            async with self._snap_lock:
                await self._durably(self.storage.save_snapshot, snap)
            await self._durably(self.storage.rewrite, snap.meta,
                                rd.hard_state or self.core.persisted_hard_state(), [])
        if rd.must_sync:
            # Committed entries are durable on a quorum already (a leader
            # counts its own log only once on disk; a follower's commit
            # index is the leader's), so they are applied and answered while
            # this Ready's new entries are written: a busy leader's replies
            # wait for one fsync, not for the next batch's too. What must
            # wait for the disk (votes, acknowledgements: ``rd.messages``)
            # still does. A snapshot to install comes first (the branch above).
            #
            # A follower (or candidate) has nothing else to do meanwhile: its
            # next input is the answer to what this fsync promises (the
            # leader keeps one call in flight to it), so it writes inline,
            # without the thread hop (two wakeups on the commit path). A
            # leader's loop must go on answering clients: a thread.
            started = time.perf_counter()
            if not self.core.is_leader:  # (a leader gets here only with a snapshot to install)
                try:
                    self.storage.save(rd.entries, rd.hard_state, True)
                except OSError as exc:  # a full disk: nothing of it was written
                    self._storage_failed(self.storage.save, exc)
                    await self._durably(self.storage.save, rd.entries, rd.hard_state, True)
                if rd.snapshot is None:
                    self._apply_ready(rd)
            else:
                job = _InThread(self.storage.save, rd.entries, rd.hard_state, True)
                if rd.snapshot is None:
                    self._apply_ready(rd)
                try:
                    await job.result()
                except OSError as exc:  # a full disk: nothing of it was written
                    self._storage_failed(self.storage.save, exc)
                    await self._durably(self.storage.save, rd.entries, rd.hard_state, True)
            self._m_fsync.observe(time.perf_counter() - started)
            self._m_sync_batch.observe(len(rd.entries))
        elif rd.hard_state is not None:
            # Only the commit index moved: a few bytes into the page cache,
            # no fsync, not worth a thread hop (it is relearned after a crash).
            try:
                self.storage.save(rd.entries, rd.hard_state, False)
            except OSError:
                await self._durably(self.storage.save, rd.entries, rd.hard_state, False)
        self._send(rd.messages)
        if rd.snapshot is not None:
            self.sm.restore(rd.snapshot.data)
            self.applied = rd.snapshot.meta.index
            self._m_snapshots.inc()
            log.info("raft node %d: installed snapshot at %d from the leader", self.id, self.applied)
            for index in [i for i in self._proposed if i <= self.applied]:
                self._proposed.pop(index)[1].fail(self._not_leader())
        if rd.snapshot is not None or not rd.must_sync:
            self._apply_ready(rd)
        if rd.soft_state is not None:  # after applying: what committed still answers
            self._on_soft_state(rd)
        self.core.advance(rd)
        self._after_ready()
        self._maybe_snapshot()

    def _after_ready(self) -> None:
        if self.core.conf_index != self._conf_index:
            self._on_membership()
        if (self.core.discovering, self.core.rebuilding) != self._disk_state:
            self._report_disk_state()
        self._m_commit.set(self.core.committed)
        self._m_applied.set(self.applied)

    def _snapshot_due(self) -> bool:
        return (not self.snapshotting
                and self.core.applied - self.core.log.snap_index >= self.dconfig.snapshot_entries)

    def _maybe_snapshot(self) -> None:
        # A snapshot covers only entries on our own disk (the log is
        # compacted up to it): a leader may apply what its followers hold
        # before its own write ends, and a rewritten tail waits for its write.
        if self._snapshot_due() and self.core.log.stable >= self.applied:
            self._start_snapshot()

    def _apply_ready(self, rd: Ready) -> None:
        """Apply ``rd``'s committed entries; serve the reads they release."""
        if rd.committed_entries:
            committed_at = time.perf_counter()  # (just after the Ready that says so)
            for e in rd.committed_entries:
                self._apply(e.index, e.term, e.kind, e.data, committed_at)
        for rs in rd.read_states:
            waiters = self._reads.pop(rs.seq, None)
            if waiters:
                self._released.append((rs.index, waiters))
        if self._released:
            still = []
            for index, waiters in self._released:
                if self.applied >= index:
                    for w in waiters:
                        w.set(None)
                else:
                    still.append((index, waiters))
            self._released = still

    async def _durably(self, fn: Callable[..., None], *args: Any) -> None:
        """Run a storage call in a worker thread until it succeeds.

        A failed write (a full disk, a size limit) leaves nothing behind
        (``RaftStorage.save`` cuts it back off), so it is retried: this
        replica stalls, logged and counted, and its peers go on without it;
        it does not die. A failed fsync is not retried (``IOFailure``).
        """
        delay = 0.05
        while True:
            try:
                await _InThread(fn, *args).result()
                return
            except OSError as exc:
                self._storage_failed(fn, exc, delay)
                await trio.sleep(delay)
                delay = min(2 * delay, 2.0)

    def _storage_failed(self, fn: Callable[..., None], exc: OSError, delay: float = 0.0) -> None:
        self.stats["storage_errors"] += 1
        self._m_storage_errors.inc()
        log.error("raft node %d: %s failed (%s); retrying in %.2fs", self.id,
                  getattr(fn, "__name__", fn), exc, delay)

    def _apply(self, index: int, term: int, kind: EntryKind, data: bytes,
               committed_at: float) -> None:
        error: CacheFSError | None = None
        result: Any = None
        waiting = self._proposed.pop(index, None)
        if kind is EntryKind.NORMAL:
            command: Any = data
            if waiting is not None and waiting[0] == term and waiting[2] is not None:
                command = waiting[2]  # our own proposal: skip decoding it again
            try:
                result = self.sm.apply(index, command)
            except CacheFSError as exc:  # the command's own answer, same on every replica
                error = exc
        self.applied = index
        self.stats["applied"] += 1
        if waiting is None:
            return
        wterm, waiter, _, appended_at = waiting
        self._m_commit_latency.observe(committed_at - appended_at)
        self._m_apply_latency.observe(time.perf_counter() - appended_at)
        if wterm != term:
            waiter.fail(self._not_leader())  # our entry was overwritten
        elif error is not None:
            waiter.fail(error)
        else:
            waiter.set(result)

    def _on_soft_state(self, rd: Ready) -> None:
        ss = rd.soft_state
        assert ss is not None
        self._m_term.set(ss.term)
        self._m_leader.set(1 if ss.role is Role.LEADER else 0)
        for role, gauge in self._m_roles.items():
            gauge.set(1 if role is ss.role else 0)
        log.info("raft node %d: %s in term %d (leader %s)", self.id, ss.role.value, ss.term,
                 ss.leader or "unknown")
        if ss.role is not Role.LEADER:
            err = self._not_leader()
            for waiters in self._reads.values():
                for w in waiters:
                    w.fail(err)
            self._reads.clear()
            for _, w, _, _ in self._proposed.values():
                w.fail(err)
            self._proposed.clear()

    def _on_membership(self) -> None:
        """A new configuration is in effect: learn its members' addresses
        and start senders to new ones (``peers`` only grows: a removed
        replica may still need an answer, and is harmless to answer)."""
        core = self.core
        self._conf_index = core.conf_index
        m = core.membership
        for i, addr in m.addrs:
            if i != self.id and self.peers.get(i) != addr:
                self.peers[i] = addr
            if i != self.id and i not in self._outbox:
                self._outbox[i] = []
                self._send_wake[i] = trio.Event()
                if self._nursery is not None:
                    self._nursery.start_soon(self._sender, i)
        role = ("voter" if self.id in m.voters else "learner" if self.id in m.learners
                else "not a member")
        log.info("raft node %d: configuration at %d: voters %s, learners %s; this node: %s",
                 self.id, core.conf_index, list(m.voters), list(m.learners), role)

    def _report_disk_state(self) -> None:
        core = self.core
        was_rebuilding = self._disk_state[1]
        self._disk_state = (core.discovering, core.rebuilding)
        self._m_rebuilding.set(1 if core.discovering or core.rebuilding else 0)
        if core.discovering:
            log.info("raft node %d: a new disk; asking the peers' terms before taking part",
                     self.id)
        elif core.rebuilding:
            log.warning("raft node %d: a new disk in a running cluster (term %d): rebuilding "
                        "from the leader; it takes no part in elections until caught up",
                        self.id, core.term)
        elif was_rebuilding:
            log.info("raft node %d: rebuilt, caught up with the leader", self.id)
        else:
            log.info("raft node %d: every peer is new too: a new cluster", self.id)

    def _start_snapshot(self) -> None:
        """Capture the state machine at the applied index and save it in the
        background. No await here: the fork (or the inline serialization)
        sees exactly the state after ``self.applied``."""
        try:
            meta = self.core.snapshot_meta(self.applied)
        except InvalidArgument as exc:  # a joiner, below its first known configuration
            log.debug("raft node %d: no snapshot yet: %s", self.id, exc.message)
            return
        assert self._nursery is not None
        self.snapshotting = True
        if self.dconfig.fork_snapshots and hasattr(os, "fork"):
            child = SnapshotChild.fork(self.sm.snapshot)
            self.snapshot_child = child.pid
            self._nursery.start_soon(self._collect_snapshot, meta, child)
        else:
            self._nursery.start_soon(self._save_snapshot, Snapshot(meta, self.sm.snapshot()))

    async def _collect_snapshot(self, meta: SnapshotMeta, child: SnapshotChild) -> None:
        try:
            try:
                data = await child.result()
            finally:
                self.snapshot_child = None
        except SnapshotChildFailed as exc:
            self.snapshotting = False
            log.error("raft node %d: %s; will retry", self.id, exc)
            return
        except BaseException:
            self.snapshotting = False
            raise
        await self._save_snapshot(Snapshot(meta, data))

    async def _save_snapshot(self, snap: Snapshot) -> None:
        """Write ``snap``'s file, then let the loop compact the log."""
        try:
            async with self._snap_lock:
                have = self.storage.snapshot
                if have is not None and have.meta.index >= snap.meta.index:
                    return  # the leader installed a newer one meanwhile
                try:
                    await trio.to_thread.run_sync(self.storage.save_snapshot, snap)
                except OSError as exc:  # a full disk: try again at the next trigger
                    self.stats["storage_errors"] += 1
                    self._m_storage_errors.inc()
                    log.error("raft node %d: saving the snapshot at %d failed: %s", self.id,
                              snap.meta.index, exc)
                    return
            self._snap_ready = snap
            self._wake.set()
        finally:
            if self._snap_ready is None:
                self.snapshotting = False

    async def _compact(self) -> None:
        """Between two Readys: drop the log up to the saved snapshot."""
        snap, self._snap_ready = self._snap_ready, None
        assert snap is not None
        core = self.core
        try:
            if snap.meta.index <= core.log.snap_index:
                return
            core.compact(snap)
            await self._durably(self.storage.rewrite, snap.meta, core.persisted_hard_state(),
                                core.stable_entries())
            self.stats["snapshots"] += 1
            self._m_snapshots.inc()
            log.info("raft node %d: snapshot at %d (%d bytes), log compacted", self.id,
                     snap.meta.index, len(snap.data))
        finally:
            self.snapshotting = False

    def _fail_all(self, err: CacheFSError) -> None:
        for _, w, _ in self._proposals:
            w.fail(err)
        for w in self._read_requests:
            w.fail(err)
        for _, w, _, _ in self._proposed.values():
            w.fail(err)
        for waiters in self._reads.values():
            for w in waiters:
                w.fail(err)
        for _, waiters in self._released:
            for w in waiters:
                w.fail(err)
        for pending in self._stepped:  # raft_step calls waiting: answer with nothing
            pending.done.set()
        self._stepped = []
        self._proposals, self._read_requests = [], []
        self._proposed.clear()
        self._reads.clear()
        self._released = []

    # ------------------------------------------------------------- network
    def _send(self, msgs: tuple[Message, ...]) -> None:
        for m in msgs:
            box = self._outbox.get(m.dst)
            if box is None:
                continue
            box.append(m)
            if len(box) > self.dconfig.max_outbox:
                del box[: len(box) - self.dconfig.max_outbox]
            if not (self._answering.get(m.dst) and isinstance(m, ANSWERS)):
                self._send_wake[m.dst].set()  # else a waiting raft_step reply carries it

    async def _sender(self, peer: int) -> None:
        while True:
            await self._send_wake[peer].wait()
            self._send_wake[peer] = trio.Event()
            addr = self.peers[peer]
            msgs, self._outbox[peer] = self._outbox[peer], []
            # A snapshot travels alone (the newest only), in chunks: it can be large.
            snaps = [m for m in msgs if isinstance(m, InstallSnapshot)]
            rest = [m for m in msgs if not isinstance(m, InstallSnapshot)]
            if rest:
                answer = peer not in self._plain_peers
                self.stats["calls"] += 1
                try:
                    reply = await self.pool.call(addr, "raft_step", {"answer": True} if answer else None,
                                                 payload=wire.encode_batch(rest),
                                                 timeout=self.dconfig.rpc_timeout)
                except CacheFSError as exc:
                    self.stats["send_errors"] += 1
                    if answer and isinstance(exc, InvalidArgument) and "'answer'" in exc.message:
                        self._plain_peers.add(peer)  # these are dropped; Raft resends
                        log.info("raft node %d: %s takes no answers in replies (%s); plain calls "
                                 "from now on", self.id, addr, exc.message)
                    else:
                        log.debug("raft node %d: %d messages to %s dropped: %s", self.id,
                                  len(rest), addr, exc)
                else:
                    if reply.payload:
                        self._take_answers(peer, reply.payload)
            if snaps:
                await self._send_snapshot(addr, snaps[-1])

    async def _send_snapshot(self, addr: str, m: InstallSnapshot) -> None:
        blob = await trio.to_thread.run_sync(transfer.encode, m)
        size = self.dconfig.snapshot_chunk
        chunks = max(1, -(-len(blob) // size))
        self._xfer_out += 1
        log.info("raft node %d: sending snapshot at %d to %s (%d bytes, %d chunks)", self.id,
                 m.snapshot.meta.index, addr, len(blob), chunks)
        for k in range(chunks):
            try:
                await self.pool.call(addr, "raft_snapshot",
                                     {"src": self.id, "xfer": self._xfer_out, "chunk": k,
                                      "chunks": chunks},
                                     payload=blob[k * size:(k + 1) * size],
                                     timeout=self.dconfig.rpc_timeout)
            except CacheFSError as exc:  # the core resends after a while
                self.stats["send_errors"] += 1
                log.warning("raft node %d: snapshot to %s failed at chunk %d/%d: %s",
                            self.id, addr, k, chunks, exc)
                return
