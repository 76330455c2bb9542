"""The metanode RPC service: the commands and queries on top of a RaftNode.

The interface is the classes: every client command (:mod:`cachefs.commands`, those
with a ``NAME``) and every query (:mod:`cachefs.queries`) is served as the RPC
method of its ``NAME`` by one generic handler (:func:`_serves_interface`).

Mutations: the handler decodes the request into its command (which
validates it: a bad argument is refused here, before it reaches the log),
stamps it with the leader's clock, and :meth:`MetaService.mutate` proposes
it; the apply result comes back, or its
:class:`~cachefs.metanode.namespace.Failure` is raised as the typed error.
The few commands that need the leader's own work around the proposal (a
stamp from its soft state, a token to hash or check, soft state to update
after) name it in ``_COMMAND_HOOKS``, one table next to the handler.

Reads: the handler decodes the query and answers with its state-machine read
(its ``run``); the leader's soft state and the cluster map are answered by
``_QUERY_HOOKS`` instead. Reads are linearizable: they
wait for ``read_index`` and then read the local state. With ``read_lease`` on (the default), a leader that had its
leadership confirmed by a quorum at most half an election timeout ago serves
reads without another round (the issue's "leader lease bounded by the
election timeout"): followers that confirmed it ignore votes for an election
timeout after hearing from it (check-quorum in ``raft/core.py``), so no other
leader can exist yet (``raft/lease.py``; a follower restarted inside the
lease keeps that promise too). As with etcd's lease reads this trusts clock
rates; turn the lease off (``--no-read-lease``) to pay one heartbeat round
per read instead.
A follower answers everything with ``NotLeader(leader=addr)``.

Soft state lives here, on the leader only: the last heartbeat of every
client session and of every datanode/cache node. A background task proposes
``CloseSession`` for sessions silent longer than ``session_timeout`` (their
unlinked-but-open files are then freed) and marks silent nodes down. A node
that becomes leader starts every clock afresh, so nobody expires merely
because of a failover. Which files each session has open is soft state too:
see :class:`~.opentable.OpenTable`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from cachefs import commands as C
from cachefs import messages as M
from cachefs import queries as Q
from cachefs.credentials import ADMINS, ANYONE, Identity
from cachefs.errors import (
    CacheFSError,
    InvalidArgument,
    NotFound,
    NotLeader,
    PermissionDenied,
    Unavailable,
)
from cachefs.ids import BlockKey
from cachefs.rpc import Reply, rpc_method

from . import backup, invariants
from .leases import DEFAULT_TERM, LeaseTable, Mutation
from .namespace import Failure, MetaState, hash_token
from .opentable import OpenTable
from .raft.lease import ReadLease, lease_duration
from .raft.snapshot_child import SnapshotChild, SnapshotChildFailed
from .repos import LeaderRepos
from .trees import purge_batch

if TYPE_CHECKING:
    from .raft.driver import RaftNode

log = logging.getLogger(__name__)

T = TypeVar("T")

SESSION_TIMEOUT = 60.0
NODE_TIMEOUT = 15.0


def _serves_interface(cls: type[MetaService]) -> type[MetaService]:
    """Give ``cls`` one RPC method per client command and per query, named by
    the class's ``NAME``, whose one argument ``a`` is the class's wire list
    (``Command.to_request`` / ``Query.to_wire``), open to the class's
    ``ROLES`` (the RPC layer refuses anyone else before decoding). Query
    handlers are plain functions, so the RPC reader answers them inline (see
    ``_answer``)."""

    def mutation(command: type[C.Command[Any]]) -> Callable[..., Awaitable[Any]]:
        scope = _Scope.of(command)

        async def handle(
            self: MetaService,
            a: list,
            identity: Identity,
            token: str | None = None,
            lease: list | None = None,
            grant: bool = False,
        ) -> Any:
            cmd = command.from_request(_stamped(a, identity), time.time_ns())
            self._admit(identity, cmd, scope)
            return await self.mutate(cmd, token, lease, grant)

        return handle

    def query(query: type[Q.Query[Any]]) -> Callable[..., Any]:
        scope = _Scope.of(query)
        hook = cls._QUERY_HOOKS.get(query)
        if hook is not None or scope.confines:
            run = hook or _state_read

            def answer(self: MetaService, a: list, identity: Identity) -> Any:
                q = query.from_wire(a)
                if identity.volumes is None:
                    return run(self, q)
                self._admit(identity, q, scope)
                reply = run(self, q)
                return _confined(q, reply, identity.volumes) if scope.confines else reply

            return answer

        def read(self: MetaService, a: list, identity: Identity) -> Any:  # the hot path: no lookups on the way
            q = query.from_wire(a)
            if identity.volumes is not None:
                self._admit(identity, q, scope)
            return self._answer(q.run)  # type: ignore[attr-defined]

        return read

    for name, command in C.REQUESTS.items():
        setattr(cls, f"_rpc_{name}", rpc_method(mutation(command), name=name, roles=command.ROLES))
    for name, q in Q.QUERIES.items():
        if not hasattr(q, "run") and q not in cls._QUERY_HOOKS:
            raise TypeError(f"query {q.__name__} has neither a state read (run) nor a hook")
        setattr(cls, f"_rpc_{name}", rpc_method(query(q), name=name, roles=q.ROLES))
    return cls


@dataclasses.dataclass(frozen=True, slots=True)
class _Scope:
    """What a command or query names that a client credential must hold:
    volumes (``volume``, a rename's ``new_volume``), a ``session``; and
    whether its answer speaks of every volume (``Query.confine``)."""

    volumes: tuple[str, ...]
    session: bool
    confines: bool

    @classmethod
    def of(cls, message: type) -> _Scope:
        fields = {f.name for f in dataclasses.fields(message)}
        return cls(
            tuple(f for f in ("volume", "new_volume") if f in fields),
            "session" in fields,
            getattr(message, "confine", Q.Query.confine) is not Q.Query.confine,
        )


def _state_read(self: MetaService, q: Q.Query[Any]) -> Any:
    return self._answer(q.run)  # type: ignore[attr-defined]  # checked when served


def _stamped(a: list, identity: Identity) -> list:
    """Put the sender's identity before the ``client_id`` it sent, so its
    dedup entries and sessions are its own (see :mod:`cachefs.commands`)."""
    if a and isinstance(a[0], str) and not identity.insecure:
        if len(a[0]) > C.MAX_CLIENT_ID:
            raise InvalidArgument(f"client_id is longer than {C.MAX_CLIENT_ID} characters")
        a[0] = f"{identity.tag}/{a[0]}"
    return a


def _confined(q: Q.Query[Any], answer: Any, volumes: frozenset[str]) -> Any:
    if inspect.isawaitable(answer):
        return _confined_later(q, answer, volumes)
    return q.confine(answer, volumes)


async def _confined_later(q: Q.Query[Any], answer: Awaitable[Any], volumes: frozenset[str]) -> Any:
    return q.confine(await answer, volumes)


def _listing_first(read: Callable[[MetaService, Any], Any], field: str) -> Callable[[MetaService, Any], Any]:
    """A directory read (``field`` names the directory) that first lists a
    pending directory of a lazy repository link (``metanode/repos.py``)."""

    def hook(self: MetaService, q: Any) -> Any:
        lazy = self.state.lazy_dirs
        if lazy and (q.volume, getattr(q, field)) in lazy:
            return self._after_listing(q.volume, getattr(q, field), read, q)
        return read(self, q)

    return hook


@_serves_interface
class MetaService:
    """Register with ``RpcServer(MetaService(state, node), ...)``."""

    def __init__(
        self,
        state: MetaState,
        node: RaftNode | None = None,
        *,
        session_timeout: float = SESSION_TIMEOUT,
        node_timeout: float = NODE_TIMEOUT,
        read_lease: bool = True,
        lease_term: float = DEFAULT_TERM,
    ) -> None:
        self.state = state
        self.read_lease = read_lease
        self._lease: ReadLease | None = None  # made once the node (its timing) is known
        self.node = node
        self.session_timeout = session_timeout
        self.node_timeout = node_timeout
        self._session_seen: dict[str, float] = {}
        self._was_leader = False
        self._leader_term = -1
        self.opens = OpenTable()
        # (volume, ino) -> proposals in flight that may free it (see OpenTable)
        self._freeing: dict[tuple[str, int], int] = {}
        self._freed = trio.Event()  # set (and replaced) when one of those ends
        self._wake = trio.Event()  # housekeeping: an orphan may be purgeable
        self.leases = LeaseTable(lease_term)  # see metanode/leases.py
        if state is not None:
            state.watcher = self.leases
        self._lease_changed = trio.Event()  # set (and replaced) when revocations were acked
        self._polls: dict[str, trio.Event] = {}  # session -> its waiting lease poll
        self.repos = LeaderRepos(state, self.mutate)  # lazily linked directories, listed on first read

    # -- plumbing -----------------------------------------------------------------

    def _raft(self) -> RaftNode:
        if self.node is None:
            raise NotLeader("metanode is starting", leader=None)
        return self.node

    async def _propose(self, cmd: C.Command[Any]) -> Any:
        result = await self._raft().propose(cmd.encode(), decoded=cmd)
        if isinstance(result, Failure):
            raise result.error()
        return result

    def _leased(self) -> bool:
        """Whether the lease lets us read now, without a round to the followers."""
        node = self._raft()
        return (
            self._lease is not None
            and node.is_leader
            and self._lease.valid(node.lease_epoch, time.monotonic())
        )

    def _answer(self, read: Callable[[MetaState], T]) -> T | Awaitable[T]:
        """A read handler's answer: at once under the lease (the RPC layer
        runs plain handlers inline), else an awaitable that confirms the
        leadership first."""
        if self._leased():
            return read(self.state)
        return self._confirmed(read)

    async def _confirmed(self, read: Callable[[MetaState], T]) -> T:
        return read(await self._read())

    async def _read(self) -> MetaState:
        if self._leased():
            return self.state
        node = self._raft()
        start = time.monotonic()  # the confirming heartbeats leave after this
        epoch = node.lease_epoch
        await node.read_index()
        if self.read_lease and node.is_leader and node.lease_epoch == epoch:
            if self._lease is None:
                self._lease = ReadLease(lease_duration(node.core.config.election_tick,
                                                       node.dconfig.tick_interval))
            self._lease.confirmed(epoch, start)
        return self.state

    def _check_leadership(self) -> None:
        """On becoming leader, restart every soft clock (a grace period) and
        forget every open and lease (a new term: see :class:`OpenTable` and
        :class:`LeaseTable`)."""
        node = self.node
        leader = node is not None and node.is_leader
        if node is not None and leader and (not self._was_leader or node.term != self._leader_term):
            now = time.monotonic()
            self._session_seen = dict.fromkeys(self.state.sessions, now)
            self.state.cluster.reset_liveness(now)
            self.opens.reset()
            self.leases.reset(now, node.term)
            self._leader_term = node.term
        self._was_leader = leader

    async def _propose_freeing(self, cmd: C.Command[Any], inos: list[tuple[str, int]]) -> Any:
        """Propose a command that may free ``inos``; opens of them wait for it."""
        for key in inos:
            self._freeing[key] = self._freeing.get(key, 0) + 1
        try:
            return await self._propose(cmd)
        finally:
            for key in inos:
                left = self._freeing[key] - 1
                if left:
                    self._freeing[key] = left
                else:
                    del self._freeing[key]
            self._freed.set()
            self._freed = trio.Event()

    async def _propose_drop(
        self, cmd: C.Unlink | C.Rename, volume: str, parent: int, name: bytes
    ) -> Any:
        """Unlink or rename over ``parent/name``, stamped with ``(expect, keep)``."""
        self._check_leadership()
        expect = self.state.predict_drop(volume, parent, name)
        keep = self.opens.keep(self.state, volume, expect)
        freeing = [(volume, expect)] if expect and not keep else []
        stamped = dataclasses.replace(cmd, expect=expect, keep=keep)
        result = await self._propose_freeing(stamped, freeing)
        if keep:
            self._wake.set()  # kept an orphan nobody may hold: purge it soon
        return result

    def gc_cutoff(self, volume: str, grace: float) -> int | None:
        """Wall-clock ns before which slices trashed on ``volume`` may lose
        their blocks: ``grace`` ago, and before the oldest open this leader
        knows there (a reader may hold the slice list it read after opening;
        the slices trashed before every open are no longer in any such list).
        None while not leader, or while some session's opens are unknown."""
        self._check_leadership()
        if not self._was_leader or not self.opens.settled(self.state, volume):
            return None
        cutoff = time.time_ns() - int(grace * 1e9)
        oldest = self.opens.oldest_open_ns(volume)
        return cutoff if oldest is None else min(cutoff, oldest)

    async def repairs_done(self, volume: str, blocks: list[BlockKey]) -> int:
        """Propose that ``blocks`` are whole again (the repair service's call)."""
        flat = tuple(v for key in blocks for v in (key.slice_id, key.index))
        return await self._propose(C.RepairsDone(volume, flat, now_ns=time.time_ns()))

    async def seal_slices(self, floor: int) -> int:
        """Propose the commit floor (the collector's call, see ``backing/gc.py``)."""
        return await self._propose(C.SealSlices(floor, now_ns=time.time_ns()))

    async def purge_orphans(self) -> int:
        """Propose freeing every orphan no session holds (in settled volumes)."""
        self._check_leadership()
        if not self._was_leader:
            return 0
        freed = 0
        for name, vol in list(self.state.volumes.items()):
            if not vol.orphans or not self.opens.settled(self.state, name):
                continue
            inos = [
                i
                for i in sorted(vol.orphans)
                if not self.opens.is_open(name, i) and (name, i) not in self._freeing
            ][:100_000]
            if not inos:
                continue
            cmd = C.PurgeOrphans(name, tuple(inos), now_ns=time.time_ns())
            m = await self._revoke(cmd, None)
            try:
                # a lapsed lease may have hidden an open (see LeaseTable.blocked)
                inos = [i for i in inos if not self.opens.is_open(name, i)]
                if inos:
                    cmd = C.PurgeOrphans(name, tuple(inos), now_ns=time.time_ns())
                    freed += await self._propose_freeing(cmd, [(name, i) for i in inos])
            finally:
                if m is not None:
                    self.leases.end(m)
        return freed

    async def run_tree_deletes(
        self, interval: float = 0.5, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Purge the trees being deleted (``cachefs tree delete``), step after
        step, while leader (``metanode/trees.py``)."""
        task_status.started()
        while True:
            await trio.sleep(interval)
            try:
                while await self.purge_trees():
                    pass
            except CacheFSError as exc:
                log.info("tree delete paused, will go on: %s", exc)

    async def purge_trees(self, limit: int = 1000) -> int:
        """One ``PurgeTree`` step of every tree being deleted in a volume whose
        opens are known; returns how many inodes they removed. A file is
        freed only if no session has it open (else it is kept as an orphan)."""
        self._check_leadership()
        if not self._was_leader:
            return 0
        removed = 0
        for name, vol in list(self.state.volumes.items()):
            if not vol.doomed or vol.deleted_ns or not self.opens.settled(self.state, name):
                continue
            for root in list(vol.doomed):
                # what the step will remove, read with no await before the command is built
                batch = purge_batch(vol, root, limit)
                inos = {c.ino for _d, _n, c in batch} | {d.ino for d, _n, _c in batch if d is not None}
                files = [c.ino for _d, _n, c in batch if not c.is_dir]
                cmd = C.PurgeTree(name, root, limit, tuple(sorted(inos)), now_ns=time.time_ns())
                m = await self._revoke(cmd, None)
                try:
                    free = tuple(i for i in files if not self.opens.is_open(name, i))
                    cmd = dataclasses.replace(cmd, free=free, now_ns=time.time_ns())
                    removed += await self._propose_freeing(cmd, [(name, i) for i in free])
                finally:
                    if m is not None:
                        self.leases.end(m)
        return removed

    async def run_repo_polls(
        self, *, tick: float = 1.0, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The ``--auto-import`` polls of repository links, while leader (``metanode/repos.py``)."""

        def leading() -> bool:
            self._check_leadership()  # a new term restarts the soft clocks first
            return self._was_leader

        await self.repos.run_polls(leading, tick=tick, task_status=task_status)

    async def run_housekeeping(
        self,
        interval: float = 1.0,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Expire silent sessions and mark silent nodes down, while leader."""
        task_status.started()
        while True:
            with trio.move_on_after(interval):
                await self._wake.wait()
            self._wake = trio.Event()
            self._check_leadership()
            if not self._was_leader:
                continue
            now = time.monotonic()
            self.state.cluster.refresh_liveness(now, self.node_timeout)
            for sid in list(self.state.sessions):
                seen = self._session_seen.setdefault(sid, now)
                if now - seen > self.session_timeout:
                    log.info("session %s silent for %.0fs: closing it", sid, now - seen)
                    try:
                        await self._propose(C.CloseSession(sid, now_ns=time.time_ns()))
                    except CacheFSError as exc:
                        log.info("could not expire session %s: %s", sid, exc)
                    self._session_seen.pop(sid, None)
            for sid in list(self._session_seen):
                if sid not in self.state.sessions:
                    del self._session_seen[sid]
            for sid in list(self.opens.by_session):
                if sid not in self.state.sessions:
                    self.opens.end_session(sid)
            for sid in list(self.leases.holders):
                if sid not in self.state.sessions:
                    self.leases.end_session(sid)
                    self._leases_changed()
                    self._notify_polls({sid})
            try:
                await self.purge_orphans()
            except CacheFSError as exc:
                log.info("could not purge orphans: %s", exc)

    def _touch_session(self, session: str) -> None:
        self._session_seen[session] = time.monotonic()

    # -- the interface: one handler for every command, one for every query -----------

    def _admit(self, identity: Identity, message: Any, scope: _Scope) -> None:
        """What a client credential may name, checked on every call (the RPC
        layer checked its role): only its own volumes; a volume with a mount
        token only while it has a session there (a mount proved the token);
        only sessions it opened. Servers and admins pass (an admin may set the
        token anyway).

        Raises:
            PermissionDenied: a volume or session that is not the caller's.
        """
        if identity.volumes is None:
            return
        for field in scope.volumes:
            volume = getattr(message, field)
            if volume is not None:
                identity.check_volume(volume)
                if type(message) is not C.MountVolume:  # the mount proves the token
                    self.state.check_session_grant(identity.tag, volume)
        if scope.session:
            s = self.state.sessions.get(message.session)
            if s is not None and s.owner != identity.tag:
                raise PermissionDenied(f"session {message.session!r} is not {identity}'s")

    async def mutate(
        self,
        cmd: C.Command[Any],
        token: str | None = None,
        lease: list | None = None,
        grant: bool = False,
    ) -> Any:
        """Propose a client's command (decoded and stamped with ``now_ns``),
        through its leader hook if it has one, once the leases on what it
        changes are revoked; ``token``: a volume's mount token, for the
        commands that take one (it never enters the log); ``lease``:
        ``[session, kept, opens]`` of the mutating session (see
        :meth:`_mutator`); ``grant``: a create of a regular file that
        answers with a lease on it, or of a directory (:meth:`_created`)."""
        if token is not None and type(cmd) not in self._TAKES_TOKEN:
            raise InvalidArgument(f"{cmd.NAME} takes no token")
        if grant and (type(cmd) not in (C.Mknod, C.Mkdir) or lease is None):
            raise InvalidArgument("grant is for a Mknod or Mkdir that names its session's lease")
        hook = self._COMMAND_HOOKS.get(type(cmd))
        m = await self._revoke(cmd, lease)
        try:
            if hook is None:
                result = await self._propose(cmd)
            else:
                result = await hook(self, cmd, token)
        finally:
            if m is not None:
                self.leases.end(m)
        if grant:
            return await self._created(cmd, M.Attr.from_wire(result), lease)
        return result

    async def _created(self, cmd: C.Mknod | C.Mkdir, attr: M.Attr, lease: list) -> M.Created:
        """A create's answer with a lease on the new file for its session, so
        that its open, its first getxattr and its directory's getattr need
        no round trip. Read as the confirmed leader, with no await between
        the read and the grant (as every leased read); no lease when the
        file is gone or changing already. A new directory is leased only
        while it is still empty: the grant says so, and the session then
        knows every name in it (none), so the lookup before each create
        in it is answered from memory."""
        state = await self._read()
        vol = state.volumes.get(cmd.volume)
        inode = vol.inodes.get(attr.ino) if vol is not None else None
        dir_inode = vol.inodes.get(cmd.parent) if vol is not None else None
        parent = state.attr(dir_inode) if dir_inode is not None else None  # an rmdir after an unlink
        if inode is None or not (attr.is_reg or (attr.is_dir and not inode.data.entries)):
            return M.Created(attr, parent, False, M.Grant(self.leases.leader_term, 0, ()))
        session = lease[0]
        s = state.sessions.get(session)
        if s is None or s.client_id != cmd.client_id:
            session = ""  # not the command's client's: no lease (as in _mutator)
        return M.Created(
            state.attr(inode), parent, inode.xattrs is None, self._grant(session, cmd.volume, [attr.ino])
        )

    # -- leases (metanode/leases.py): revocations before a mutation ---------------------

    async def _revoke(self, cmd: C.Command[Any], lease: list | None) -> Mutation | None:
        """Revoke every lease on what ``cmd`` changes and wait until each is
        acknowledged or lapsed (and, after a failover, for the grace); the
        mutation to ``end`` once proposed. None: it changes no inode."""
        while True:
            self._check_leadership()
            touched = self.state.touched(cmd)
            if touched is None or not self._was_leader:
                return None  # no inode; or proposing will say NotLeader
            volume, inos = touched
            mutator, kept = self._mutator(cmd, volume, lease)
            term = self.leases.leader_term
            scope = self.state.resolves_in(cmd)
            m, notify = self.leases.begin(volume, inos, time.monotonic(), mutator, kept, scope)
            self._notify_polls(notify)
            try:
                await self._wait_revoked(m)
            except BaseException:
                self.leases.end(m)
                raise
            self._check_leadership()
            if self.leases.leader_term == term:
                return m
            self.leases.end(m)  # a new term reset the table meanwhile: again

    def _mutator(
        self, cmd: C.Command[Any], volume: str, lease: list | None
    ) -> tuple[str | None, tuple[int, ...]]:
        """The mutating session and the leases of it that the change leaves
        alone (it forgets itself what the change makes stale), from ``lease =
        [session, kept, opens]``; ``opens``: which of the kept inodes it has
        open without having told us (counted here, before anything is
        stamped: an unlink must see them). A session that is not the
        command's client's is ignored: its leases are revoked like anyone's."""
        if lease is None:
            return None, ()
        if (
            len(lease) != 3
            or type(lease[0]) is not str
            or not all(isinstance(x, list) and all(type(i) is int for i in x) for x in lease[1:])
        ):
            raise InvalidArgument("lease must be [session, [ino...], [ino...]]")
        session, kept, opens = lease
        s = self.state.sessions.get(session)
        if s is None or s.volume != volume or s.client_id != cmd.client_id:
            return None, ()
        now_ns = time.time_ns()
        for ino in opens:
            self.opens.open(volume, session, ino, now_ns)
        return session, tuple(kept)

    async def _wait_revoked(self, m: Mutation) -> None:
        while True:
            # the sessions that may hold leases of an older leader (see LeaseTable.reset)
            sessions = [sid for sid, s in self.state.sessions.items() if s.volume == m.volume and s.leases]
            wait = self.leases.blocked(m, time.monotonic(), sessions)
            if m.possibly_open:  # lapsed unacknowledged: the holder may have it open
                now_ns = time.time_ns()
                for session, ino in m.possibly_open:
                    if session in self.state.sessions:
                        self.opens.open(m.volume, session, ino, now_ns)
                m.possibly_open.clear()
            if wait is None:
                return
            changed = self._lease_changed
            with trio.move_on_after(wait):
                await changed.wait()

    def _leases_changed(self) -> None:
        self._lease_changed.set()
        self._lease_changed = trio.Event()

    def _notify_polls(self, sessions: set[str]) -> None:
        for session in sessions:
            event = self._polls.pop(session, None)
            if event is not None:
                event.set()

    def _grant(self, session: str, volume: str, inos: list[int]) -> M.Grant:
        """Leases on ``inos`` for ``session``, as the leader that just read
        them (a session not on ``volume``, or that said it takes none, gets none)."""
        self._check_leadership()
        s = self.state.sessions.get(session)
        if not self._was_leader or s is None or s.volume != volume or not s.leases:
            return M.Grant(self.leases.leader_term, 0, ())
        granted = self.leases.grant(session, volume, inos, time.monotonic())
        return M.Grant(self.leases.leader_term, int(self.leases.term * 1000), granted)

    # -- leader hooks of commands ------------------------------------------------------

    async def _with_token_hash(
        self, cmd: C.CreateVolume | C.SetVolumeAccess, token: str | None
    ) -> Any:
        """Stamp the hash of the request's token: mounts then need the token."""
        return await self._propose(
            dataclasses.replace(cmd, token_hash=hash_token(token) if token else "")
        )

    async def _mount_volume(self, cmd: C.MountVolume, token: str | None) -> Any:
        """Open a session; a volume with a token refuses a wrong or missing one
        (PermissionDenied). The token never enters the log."""
        (await self._read()).check_volume_token(cmd.volume, token)
        self._check_leadership()
        term = self._leader_term
        # decoded as a client would: a retry answered from a restored dedup table is an array
        info = C.MountVolume.REPLY(await self._propose(cmd))
        self._check_leadership()
        if self._leader_term == term:  # mounted on this leader's watch: no opens, no leases
            self.opens.known.add(info.session)
            self.leases.mounted(info.session, cmd.volume, time.monotonic())
        self._touch_session(info.session)
        return info

    async def _close_session(self, cmd: C.CloseSession, token: None) -> None:
        self._session_seen.pop(cmd.session, None)
        await self._propose(cmd)
        self.opens.end_session(cmd.session)
        self.leases.end_session(cmd.session)
        self._leases_changed()
        self._notify_polls({cmd.session})
        try:  # unmount frees the unlinked files it held before it returns
            await self.purge_orphans()
        except CacheFSError as exc:
            log.info("could not purge orphans: %s", exc)
            self._wake.set()

    async def _delete_volume(self, cmd: C.DeleteVolume, token: None) -> dict[str, Any]:
        result = await self._propose(cmd)
        self._wake.set()  # housekeeping ends the opens and leases of sessions it closed (--force)
        return result

    async def _unlink(self, cmd: C.Unlink, token: None) -> Any:
        return await self._propose_drop(cmd, cmd.volume, cmd.parent, cmd.name)

    async def _rename(self, cmd: C.Rename, token: None) -> Any:
        if cmd.flags & C.RENAME_EXCHANGE:  # drops nothing
            return await self._propose(cmd)
        return await self._propose_drop(cmd, cmd.volume, cmd.new_parent, cmd.new_name)

    async def _after_listing(self, volume: str, ino: int, read: Callable[[MetaService, Any], Any], q: Any) -> Any:
        await self._read()  # a follower says NotLeader here, before touching S3
        await self.repos.list_dir(volume, ino)
        answer = read(self, q)
        return await answer if inspect.isawaitable(answer) else answer

    async def _import_objects(self, cmd: C.ImportObjects, token: None) -> dict[str, Any]:
        counts = await self._propose(cmd)
        if counts.get("deleted"):
            self._wake.set()  # deleted objects' files are orphans: purge those nobody holds
        return counts

    async def _register_node(self, cmd: C.RegisterNode, token: None) -> int:
        epoch = await self._propose(cmd)
        self.state.cluster.heartbeat(
            cmd.kind, cmd.node_id, self._used(cmd.kind, cmd.node_id), time.monotonic()
        )
        return epoch

    def _used(self, kind: str, node_id: str) -> int:
        nodes = (
            self.state.cluster.datanodes if kind == "datanode" else self.state.cluster.cachenodes
        )
        node = nodes.get(node_id)
        return node.used if node else 0

    _TAKES_TOKEN = frozenset({C.CreateVolume, C.SetVolumeAccess, C.MountVolume})
    _COMMAND_HOOKS: dict[type, Callable[..., Awaitable[Any]]] = {
        C.CreateVolume: _with_token_hash,
        C.SetVolumeAccess: _with_token_hash,
        C.MountVolume: _mount_volume,
        C.CloseSession: _close_session,
        C.DeleteVolume: _delete_volume,
        C.Unlink: _unlink,
        C.Rename: _rename,
        C.RegisterNode: _register_node,
        C.ImportObjects: _import_objects,
    }

    # -- queries the service answers: soft state and the cluster map -------------------

    async def _open(self, q: Q.Open) -> Any:
        """Count an open (see :class:`OpenTable`); a retry simply counts again."""
        state = await self._leader_read()
        state.check_open(q.volume, q.ino, q.session)
        self._touch_session(q.session)
        self.opens.open(q.volume, q.session, q.ino, time.time_ns())
        while (q.volume, q.ino) in self._freeing:  # stamped "not open" before we counted
            await self._freed.wait()
        try:
            return state.check_open(q.volume, q.ino, q.session)
        except CacheFSError:
            self.opens.release(q.volume, q.session, q.ino)  # the unlink came first
            raise

    async def _release(self, q: Q.Release) -> None:
        state = await self._leader_read()
        self._touch_session(q.session)
        if self.opens.release(q.volume, q.session, q.ino):
            vol = state.volumes.get(q.volume)
            if vol is not None and q.ino in vol.orphans:
                self._wake.set()

    async def _leader_read(self) -> MetaState:
        """A read on the leader, with the open table of the current term."""
        state = await self._read()
        self._check_leadership()
        if not self._was_leader:
            node = self._raft()
            raise NotLeader("not the leader", leader=node.leader_addr)
        return state

    async def _session_heartbeat(self, q: Q.SessionHeartbeat) -> bool:
        state = await self._read()
        s = state.sessions.get(q.session)
        if s is None:
            return False
        self._touch_session(q.session)
        if q.opens is not None:
            self._check_leadership()
            self.opens.announce(s.volume, q.session, list(q.opens))
            self._wake.set()
        return True

    async def _node_heartbeat(self, q: Q.NodeHeartbeat) -> None:
        """Soft state: no log entry; only the leader keeps it."""
        state = await self._read()
        self._check_leadership()
        state.cluster.heartbeat(q.kind, q.node_id, q.used, time.monotonic())

    async def _cluster_map(self, q: Q.ClusterMap) -> dict[str, Any]:
        state = await self._read()
        self._check_leadership()  # a new leader restarts the liveness clocks first
        return q.run(state)

    async def _dump_volume(self, q: Q.DumpVolume) -> Reply:
        """The backup rides as the reply's payload (the header is small)."""
        state = await self._leader_read()
        backup.check_dumpable(state, q.volume)  # the child's errors would come back as an exit code
        if hasattr(os, "fork"):
            # no await between the read and the fork: the child sees one applied index
            child = SnapshotChild.fork(functools.partial(backup.dump_volume, state, q.volume))
            try:
                blob = await child.result()
            except SnapshotChildFailed as exc:
                raise Unavailable(f"dumping volume {q.volume!r} failed: {exc}") from None
        else:
            blob = backup.dump_volume(state, q.volume)
        return Reply(len(blob), payload=blob)

    async def _check_volume(self, q: Q.CheckVolume) -> list[str]:
        state = await self._leader_read()
        return invariants.volume_problems(state, q.volume)  # no await: one applied index

    @rpc_method(roles=ADMINS)
    async def restore_volume(self, *, payload: memoryview) -> dict[str, Any]:
        """``cachefs load``: the backup comes as the payload (a request
        header is at most 1 MiB), the log entry is ``RestoreVolume``."""
        return await self._propose(C.RestoreVolume(bytes(payload), now_ns=time.time_ns()))

    # -- queries that grant leases, and the lease poll -----------------------------------

    def _lease_lookup(self, q: Q.LeaseLookup) -> Any:
        def read(state: MetaState) -> M.LeasedAttr:
            attr = state.lookup(q.volume, q.parent, q.name)
            return M.LeasedAttr(attr, self._grant(q.session, q.volume, [q.parent, attr.ino]))

        return self._answer(read)

    def _lease_getattr(self, q: Q.LeaseGetAttr) -> Any:
        def read(state: MetaState) -> M.LeasedAttr:
            attr = state.getattr(q.volume, q.ino)
            return M.LeasedAttr(attr, self._grant(q.session, q.volume, [q.ino]))

        return self._answer(read)

    def _load_dir(self, q: Q.LoadDir) -> Any:
        limit = min(q.limit, Q.MAX_READDIR)
        small = min(q.small, Q.SMALL_FILE)

        def read(state: MetaState) -> M.DirLoad:
            attr, entries, more = state.load_dir(q.volume, q.ino, q.cookie, limit, small)
            inos = [q.ino, *(e.attr.ino for e in entries)]
            return M.DirLoad(attr, entries, more, self._grant(q.session, q.volume, inos))

        return self._answer(read)

    async def _lease_open(self, q: Q.LeaseOpen) -> M.LeasedAttr:
        attr = await self._open(Q.Open(q.volume, q.ino, q.session))
        return M.LeasedAttr(attr, self._grant(q.session, q.volume, [q.ino]))

    def _lease_poll(self, q: Q.LeasePoll) -> Any:
        """Inline, in the order the session's requests arrived: count the
        opens it reports, then take its acks and drops (an open reported
        with an ack is counted before the mutation waiting for the ack goes
        on). Then, as confirmed leader, renew and wait for news."""
        s = self.state.sessions.get(q.session)
        if s is None:
            raise NotFound(f"no session {q.session!r}")
        received = time.monotonic()
        now_ns = time.time_ns()
        for ino in q.opens:
            self.opens.open(s.volume, q.session, ino, now_ns)
        if self.leases.acknowledge(q.session, q.acks, q.drops):
            self._leases_changed()
        return self._poll_news(q, s.volume, received)

    async def _poll_news(self, q: Q.LeasePoll, volume: str, received: float) -> M.LeaseNews:
        """Renew, then hold the poll until there is news for the session.
        A poll naming an older leader term than this one's is answered at
        once: the term is the news, and the session's next poll, saying it
        holds nothing older, ends the grace after a failover for it."""
        await self._leader_read()  # a renewal is a promise only the leader may make
        term = self.leases.leader_term
        if self.leases.renew(q.session, volume, received, q.held_term):
            self._leases_changed()  # mutations waiting out the grace look again
        wait = min(q.wait_ms / 1000, self.leases.term / 4) if q.held_term == term else 0
        with trio.move_on_after(wait):
            while not self.leases.revocations(q.session) and self.leases.leader_term == term:
                event = self._polls.get(q.session)
                if event is None:
                    event = self._polls[q.session] = trio.Event()
                await event.wait()
        return M.LeaseNews(
            self.leases.leader_term, int(self.leases.term * 1000), self.leases.revocations(q.session)
        )

    _QUERY_HOOKS: dict[type, Callable[..., Awaitable[Any]]] = {
        Q.LeaseLookup: _listing_first(_lease_lookup, "parent"),
        Q.LeaseGetAttr: _lease_getattr,
        Q.LoadDir: _listing_first(_load_dir, "ino"),
        Q.Lookup: _listing_first(_state_read, "parent"),
        Q.ReadDir: _listing_first(_state_read, "ino"),
        Q.LeaseOpen: _lease_open,
        Q.LeasePoll: _lease_poll,
        Q.Open: _open,
        Q.Release: _release,
        Q.SessionHeartbeat: _session_heartbeat,
        Q.NodeHeartbeat: _node_heartbeat,
        Q.ClusterMap: _cluster_map,
        Q.DumpVolume: _dump_volume,
        Q.CheckVolume: _check_volume,
    }

    # -- membership (``cachefs metanode add/remove/replace``) ------------------------

    @rpc_method(roles=ADMINS)
    async def metanode_add(self, addr: str, node_id: int = 0) -> dict[str, Any]:
        """Add the metanode at ``addr`` as a learner (``raft/membership.py``);
        the leader promotes it to voter once it has caught up. ``node_id``
        0 picks one above every id this leader knows, so a removed
        replica's id is not given out again. Idempotent: the same id at the
        same address is already done.

        Raises:
            InvalidArgument: a bad address, or the id is another member's.
        """
        addr = C.check_addr(addr)
        node = self._raft()
        m = node.membership
        existing = {a: i for i, a in m.addrs}.get(addr)
        if existing is not None:  # a retry, or a mistake
            if node_id in (0, existing):
                return {**self._members(), "id": existing}
            raise InvalidArgument(f"{addr} is already metanode {existing}'s address")
        if not node_id:
            node_id = max([*m.members, *node.peers]) + 1
        await node.change_membership(m.add_learner(node_id, addr))
        return {**self._members(), "id": node_id}

    @rpc_method(roles=ADMINS)
    async def metanode_remove(self, node_id: int) -> dict[str, Any]:
        """Remove metanode ``node_id`` (voter or learner). Removing the
        leader is allowed: it steps down once the change commits. Idempotent.

        Raises:
            InvalidArgument: it is the last voter.
        """
        node = self._raft()
        m = node.membership
        if node_id in m.members:
            await node.change_membership(m.remove(node_id))
        return self._members()

    def _members(self) -> dict[str, Any]:
        node = self._raft()
        m = node.membership
        addrs = {**node.peers, **m.addr_map()}
        return {"voters": {str(i): addrs.get(i) for i in m.voters},
                "learners": {str(i): addrs.get(i) for i in m.learners},
                "progress": {str(i): p for i, p in node.progress().items()}}

    # -- status ---------------------------------------------------------------------

    @rpc_method(roles=ADMINS)
    async def meta_sessions(self) -> list[dict[str, Any]]:
        """(Leader) the client sessions: id, volume, owner, and seconds since
        the leader last heard from each (its soft state)."""
        await self._read()
        now = time.monotonic()
        return [{"session": sid, "volume": s.volume, "owner": s.owner,
                 "idle_s": round(now - self._session_seen.get(sid, now), 1)}
                for sid, s in sorted(self.state.sessions.items())]

    @rpc_method(roles=ANYONE)
    async def meta_status(self) -> dict:
        """Where this replica stands (answered by followers too); the
        leader adds each member's replication progress (match, lag)."""
        node = self.node
        out = {
            "id": node.id if node else None,
            "is_leader": bool(node and node.is_leader),
            "leader": node.leader_addr if node else None,
            "term": node.term if node else 0,
            "commit_index": node.commit_index if node else 0,
            "applied_index": self.state.applied_index,
            "volumes": len(self.state.volumes),
            "sessions": len(self.state.sessions),
        }
        if node is not None:
            out["role"] = node.role
            out["last_index"] = node.last_index
            out.update(self._members())
        return out
