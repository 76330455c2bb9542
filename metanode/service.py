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
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.credentials import ANYONE, Identity
from cachefs.errors import CacheFSError, InvalidArgument, NotLeader, PermissionDenied
from cachefs.ids import BlockKey
from cachefs.rpc import rpc_method

from .namespace import Failure, MetaState, hash_token
from .opentable import OpenTable
from .raft.lease import ReadLease, lease_duration

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

        async def handle(self: MetaService, a: list, identity: Identity, token: str | None = None) -> Any:
            cmd = command.from_request(_stamped(a, identity), time.time_ns())
            self._admit(identity, cmd, scope)
            return await self.mutate(cmd, token)

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
            and self._lease.valid(node.term, time.monotonic())
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
        await node.read_index()
        if self.read_lease and node.is_leader:
            if self._lease is None:
                self._lease = ReadLease(lease_duration(node.core.config.election_tick,
                                                       node.dconfig.tick_interval))
            self._lease.confirmed(node.term, start)
        return self.state

    def _check_leadership(self) -> None:
        """On becoming leader, restart every soft clock (a grace period) and
        forget every open (a new term: see :class:`OpenTable`)."""
        node = self.node
        leader = node is not None and node.is_leader
        if node is not None and leader and (not self._was_leader or node.term != self._leader_term):
            now = time.monotonic()
            self._session_seen = dict.fromkeys(self.state.sessions, now)
            self.state.cluster.reset_liveness(now)
            self.opens.reset()
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
            if inos:
                cmd = C.PurgeOrphans(name, tuple(inos), now_ns=time.time_ns())
                freed += await self._propose_freeing(cmd, [(name, i) for i in inos])
        return freed

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

    async def mutate(self, cmd: C.Command[Any], token: str | None = None) -> Any:
        """Propose a client's command (decoded and stamped with ``now_ns``),
        through its leader hook if it has one; ``token``: a volume's mount
        token, for the commands that take one (it never enters the log)."""
        if token is not None and type(cmd) not in self._TAKES_TOKEN:
            raise InvalidArgument(f"{cmd.NAME} takes no token")
        hook = self._COMMAND_HOOKS.get(type(cmd))
        if hook is None:
            return await self._propose(cmd)
        return await hook(self, cmd, token)

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
        if self._leader_term == term:  # mounted on this leader's watch: no opens yet
            self.opens.known.add(info.session)
        self._touch_session(info.session)
        return info

    async def _close_session(self, cmd: C.CloseSession, token: None) -> None:
        self._session_seen.pop(cmd.session, None)
        await self._propose(cmd)
        self.opens.end_session(cmd.session)
        try:  # unmount frees the unlinked files it held before it returns
            await self.purge_orphans()
        except CacheFSError as exc:
            log.info("could not purge orphans: %s", exc)
            self._wake.set()

    async def _unlink(self, cmd: C.Unlink, token: None) -> None:
        await self._propose_drop(cmd, cmd.volume, cmd.parent, cmd.name)

    async def _rename(self, cmd: C.Rename, token: None) -> None:
        if cmd.flags & C.RENAME_EXCHANGE:  # drops nothing
            await self._propose(cmd)
        else:
            await self._propose_drop(cmd, cmd.volume, cmd.new_parent, cmd.new_name)

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
        C.Unlink: _unlink,
        C.Rename: _rename,
        C.RegisterNode: _register_node,
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

    _QUERY_HOOKS: dict[type, Callable[..., Awaitable[Any]]] = {
        Q.Open: _open,
        Q.Release: _release,
        Q.SessionHeartbeat: _session_heartbeat,
        Q.NodeHeartbeat: _node_heartbeat,
        Q.ClusterMap: _cluster_map,
    }

    # -- status ---------------------------------------------------------------------

    @rpc_method(roles=ANYONE)
    async def meta_status(self) -> dict:
        """Where this replica stands (answered by followers too)."""
        node = self.node
        return {
            "id": node.id if node else None,
            "is_leader": bool(node and node.is_leader),
            "leader": node.leader_addr if node else None,
            "term": node.term if node else 0,
            "commit_index": node.commit_index if node else 0,
            "applied_index": self.state.applied_index,
            "volumes": len(self.state.volumes),
            "sessions": len(self.state.sessions),
        }
