"""The metanode RPC service: the contract's methods on top of a RaftNode.

Mutations are validated by constructing their :mod:`commands` class (a bad
argument is refused here, before it reaches the log), stamped with the
leader's clock, and proposed; the apply result comes back, or its
:class:`~cachefs.metanode.namespace.Failure` is raised as the typed error.
Reads are linearizable: they wait for ``read_index`` and then read the
local state. With ``read_lease`` on (the default), a leader that had its
leadership confirmed by a quorum at most half an election timeout ago serves
reads without another round (the issue's "leader lease bounded by the
election timeout"): followers that confirmed it ignore votes for an election
timeout after hearing from it (check-quorum in ``raft/core.py``), so no other
leader can exist yet. As with etcd's lease reads this trusts clock rates, and
a follower that crashes and restarts inside the lease forgets it; turn the
lease off (``--no-read-lease``) to pay one heartbeat round per read instead.
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

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from cachefs.errors import CacheFSError, FileTooLarge, NotLeader
from cachefs.rpc import rpc_method

from . import commands as C
from .namespace import Failure, MetaState, hash_token
from .opentable import OpenTable

if TYPE_CHECKING:
    from .raft.driver import RaftNode

log = logging.getLogger(__name__)

T = TypeVar("T")

SESSION_TIMEOUT = 60.0
NODE_TIMEOUT = 15.0
MAX_READDIR = 10_000
LEASE_FRACTION = 0.5  # of the shortest election timeout


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
        self._lease_term = -1
        self._lease_until = 0.0
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

    async def _propose(self, cls: type[C.Command], client_id: str, seq: int, *args: Any) -> Any:
        cmd = cls(client_id, seq, time.time_ns(), *args)  # validates: may raise EINVAL etc.
        result = await self._raft().propose(cmd.encode(), decoded=cmd)
        if isinstance(result, Failure):
            raise result.error()
        return result

    def _leased(self) -> bool:
        """Whether the lease lets us read now, without a round to the followers."""
        node = self._raft()
        return (
            self.read_lease
            and node.is_leader
            and node.term == self._lease_term
            and time.monotonic() < self._lease_until
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
            lease = LEASE_FRACTION * node.core.config.election_tick * node.dconfig.tick_interval
            if node.term != self._lease_term or start + lease > self._lease_until:
                self._lease_term = node.term
                self._lease_until = start + lease
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

    async def _propose_freeing(
        self,
        cls: type[C.Command],
        client_id: str,
        seq: int,
        inos: list[tuple[str, int]],
        *args: Any,
    ) -> Any:
        """Propose a command that may free ``inos``; opens of them wait for it."""
        for key in inos:
            self._freeing[key] = self._freeing.get(key, 0) + 1
        try:
            return await self._propose(cls, client_id, seq, *args)
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
        self,
        cls: type[C.Command],
        client_id: str,
        seq: int,
        volume: str,
        parent: int,
        name: bytes,
        *args: Any,
    ) -> Any:
        """Unlink or rename over ``parent/name``, stamped with ``(expect, keep)``."""
        self._check_leadership()
        expect = self.state.predict_drop(volume, parent, name)
        keep = self.opens.keep(self.state, volume, expect)
        freeing = [(volume, expect)] if expect and not keep else []
        result = await self._propose_freeing(cls, client_id, seq, freeing, *args, expect, keep)
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
                freed += await self._propose_freeing(
                    C.PurgeOrphans, "", 0, [(name, i) for i in inos], name, inos
                )
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
                        await self._propose(C.CloseSession, "", 0, sid)
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

    # -- status ---------------------------------------------------------------------

    @rpc_method
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

    # -- volumes and sessions ---------------------------------------------------------

    @rpc_method
    async def create_volume(
        self,
        name: str,
        policy: str,
        compression: str = "none",
        block_size: int = 4 << 20,
        pg_count: int = 64,
        client_id: str = "",
        seq: int = 0,
        token: str | None = None,
    ) -> dict:
        """``token``: mounts then need it; without one the volume is open."""
        hashed = hash_token(token) if token else ""
        return await self._propose(
            C.CreateVolume, client_id, seq, name, policy, compression, block_size, pg_count, hashed
        )

    @rpc_method
    async def set_volume_access(
        self, name: str, token: str | None = None, client_id: str = "", seq: int = 0
    ) -> dict:
        """Require ``token`` for mounts of ``name`` from now on, or (None) open it."""
        return await self._propose(
            C.SetVolumeAccess, client_id, seq, name, hash_token(token) if token else ""
        )

    @rpc_method
    async def set_volume(
        self, name: str, compression: str, client_id: str = "", seq: int = 0
    ) -> dict:
        """Change a volume's compression (for new blocks)."""
        return await self._propose(C.SetVolumeCompression, client_id, seq, name, compression)

    @rpc_method
    async def list_volumes(self) -> dict:
        state = await self._read()
        out = {}
        for name, spec in state.cluster.volumes.items():
            stats = state.statfs(name)
            out[name] = {
                **spec.to_dict(),
                "used_bytes": stats["used_bytes"],
                "used_inodes": stats["used_inodes"],
                "open": not state.volumes[name].token_hash,
            }
        return out

    @rpc_method
    async def mount_volume(
        self, volume: str, client_id: str, seq: int = 0, token: str | None = None
    ) -> dict:
        """Open a session; a volume with a token refuses a wrong or missing one
        (PermissionDenied). The token never enters the log."""
        (await self._read()).check_volume_token(volume, token)
        self._check_leadership()
        term = self._leader_term
        result = await self._propose(C.MountVolume, client_id, seq, volume)
        self._check_leadership()
        if self._leader_term == term:  # mounted on this leader's watch: no opens yet
            self.opens.known.add(result["session"])
        self._touch_session(result["session"])
        return result

    @rpc_method
    async def session_heartbeat(self, session: str, opens: list | None = None) -> bool:
        """Keep a session alive; False if it is gone (the client must remount).
        ``opens``: the inodes the session has open, which a new leader learns
        this way (see :class:`OpenTable`)."""
        state = await self._read()
        s = state.sessions.get(session)
        if s is None:
            return False
        self._touch_session(session)
        if opens is not None:
            self._check_leadership()
            self.opens.announce(s.volume, session, [int(i) for i in opens])
            self._wake.set()
        return True

    @rpc_method
    async def close_session(
        self, volume: str, session: str, client_id: str = "", seq: int = 0
    ) -> None:
        self._session_seen.pop(session, None)
        await self._propose(C.CloseSession, client_id, seq, session)
        self.opens.end_session(session)
        try:  # unmount frees the unlinked files it held before it returns
            await self.purge_orphans()
        except CacheFSError as exc:
            log.info("could not purge orphans: %s", exc)
            self._wake.set()

    # -- namespace reads ----------------------------------------------------------------

    @rpc_method
    def lookup(self, volume: str, parent: int, name: bytes) -> dict | Awaitable[dict]:
        return self._answer(lambda s: s.lookup(volume, parent, name))

    @rpc_method
    def getattr(self, volume: str, ino: int) -> dict | Awaitable[dict]:
        return self._answer(lambda s: s.getattr(volume, ino))

    @rpc_method
    def readlink(self, volume: str, ino: int) -> bytes | Awaitable[bytes]:
        return self._answer(lambda s: s.readlink(volume, ino))

    @rpc_method
    def readdir(self, volume: str, ino: int, cookie: int = 0, limit: int = 1000) -> list | Awaitable[list]:
        return self._answer(lambda s: s.readdir(volume, ino, cookie, min(limit, MAX_READDIR)))

    @rpc_method
    def statfs(self, volume: str) -> dict | Awaitable[dict]:
        return self._answer(lambda s: s.statfs(volume))

    @rpc_method
    def getxattr(self, volume: str, ino: int, name: bytes) -> bytes | Awaitable[bytes]:
        return self._answer(lambda s: s.getxattr(volume, ino, name))

    @rpc_method
    def listxattr(self, volume: str, ino: int) -> list | Awaitable[list]:
        return self._answer(lambda s: s.listxattr(volume, ino))

    @rpc_method
    def read_chunk(self, volume: str, ino: int, chunk: int) -> list | Awaitable[list]:
        return self._answer(lambda s: s.read_chunk(volume, ino, chunk))

    @rpc_method
    def get_usage(self, volume: str, ino: int) -> dict | Awaitable[dict]:
        """Bytes and inodes of a directory's subtree, and its quota."""
        return self._answer(lambda s: s.usage(volume, ino))

    @rpc_method
    def list_trash(
        self, volume: str, limit: int = 1000, before_ns: int | None = None
    ) -> list | Awaitable[list]:
        """Unreferenced slices for the garbage collector: ``[slice_id, size, deleted_ns]``."""
        return self._answer(lambda s: s.trash(volume, max(1, min(limit, 100_000)), before_ns))

    # -- namespace mutations -------------------------------------------------------------

    @rpc_method
    async def setattr(
        self,
        volume: str,
        ino: int,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
        client_id: str = "",
        seq: int = 0,
    ) -> dict:
        if isinstance(size, int) and size > C.MAX_FILE_SIZE:
            # truncate(2) says EFBIG here; the command's own check says EINVAL.
            raise FileTooLarge(f"size {size} is past the largest file ({C.MAX_FILE_SIZE})")
        return await self._propose(
            C.SetAttr, client_id, seq, volume, ino, mode, uid, gid, size, atime_ns, mtime_ns
        )

    @rpc_method
    async def mknod(
        self,
        volume: str,
        parent: int,
        name: bytes,
        mode: int,
        rdev: int = 0,
        uid: int = 0,
        gid: int = 0,
        client_id: str = "",
        seq: int = 0,
    ) -> dict:
        return await self._propose(
            C.Mknod, client_id, seq, volume, parent, name, mode, rdev, uid, gid
        )

    @rpc_method
    async def mkdir(
        self,
        volume: str,
        parent: int,
        name: bytes,
        mode: int,
        uid: int = 0,
        gid: int = 0,
        client_id: str = "",
        seq: int = 0,
    ) -> dict:
        return await self._propose(C.Mkdir, client_id, seq, volume, parent, name, mode, uid, gid)

    @rpc_method
    async def symlink(
        self,
        volume: str,
        parent: int,
        name: bytes,
        target: bytes,
        uid: int = 0,
        gid: int = 0,
        client_id: str = "",
        seq: int = 0,
    ) -> dict:
        return await self._propose(
            C.Symlink, client_id, seq, volume, parent, name, target, uid, gid
        )

    @rpc_method
    async def link(
        self,
        volume: str,
        ino: int,
        new_parent: int,
        new_name: bytes,
        client_id: str = "",
        seq: int = 0,
    ) -> dict:
        return await self._propose(C.Link, client_id, seq, volume, ino, new_parent, new_name)

    @rpc_method
    async def unlink(
        self, volume: str, parent: int, name: bytes, client_id: str = "", seq: int = 0
    ) -> None:
        await self._propose_drop(
            C.Unlink, client_id, seq, volume, parent, name, volume, parent, name
        )

    @rpc_method
    async def rmdir(
        self, volume: str, parent: int, name: bytes, client_id: str = "", seq: int = 0
    ) -> None:
        await self._propose(C.Rmdir, client_id, seq, volume, parent, name)

    @rpc_method
    async def rename(
        self,
        volume: str,
        parent: int,
        name: bytes,
        new_parent: int,
        new_name: bytes,
        flags: int = 0,
        new_volume: str | None = None,
        client_id: str = "",
        seq: int = 0,
    ) -> None:
        if flags & C.RENAME_EXCHANGE:  # drops nothing
            await self._propose(
                C.Rename, client_id, seq, volume, parent, name, new_parent, new_name, flags,
                new_volume,
            )  # fmt: skip
            return
        await self._propose_drop(
            C.Rename, client_id, seq, volume, new_parent, new_name,
            volume, parent, name, new_parent, new_name, flags, new_volume,
        )  # fmt: skip

    @rpc_method
    async def setxattr(
        self,
        volume: str,
        ino: int,
        name: bytes,
        value: bytes,
        flags: int = 0,
        client_id: str = "",
        seq: int = 0,
    ) -> None:
        await self._propose(C.SetXattr, client_id, seq, volume, ino, name, value, flags)

    @rpc_method
    async def removexattr(
        self, volume: str, ino: int, name: bytes, client_id: str = "", seq: int = 0
    ) -> None:
        await self._propose(C.RemoveXattr, client_id, seq, volume, ino, name)

    @rpc_method
    async def open(
        self, volume: str, ino: int, session: str, client_id: str = "", seq: int = 0
    ) -> dict:
        """Count an open of a regular file: leader soft state, no log entry
        (see :class:`OpenTable`). Idempotent per session and inode."""
        del client_id, seq  # not a log entry: a retry simply counts again
        state = await self._leader_read()
        state.check_open(volume, ino, session)
        self._touch_session(session)
        self.opens.open(volume, session, ino, time.time_ns())
        while (volume, ino) in self._freeing:  # stamped "not open" before we counted
            await self._freed.wait()
        try:
            return state.check_open(volume, ino, session)
        except CacheFSError:
            self.opens.release(volume, session, ino)  # the unlink came first
            raise

    @rpc_method
    async def release(
        self, volume: str, ino: int, session: str, client_id: str = "", seq: int = 0
    ) -> None:
        """Uncount an open (soft state); the last release of an orphan purges it."""
        del client_id, seq
        state = await self._leader_read()
        self._touch_session(session)
        if self.opens.release(volume, session, ino):
            vol = state.volumes.get(volume)
            if vol is not None and ino in vol.orphans:
                self._wake.set()

    async def _leader_read(self) -> MetaState:
        """A read on the leader, with the open table of the current term."""
        state = await self._read()
        self._check_leadership()
        if not self._was_leader:
            node = self._raft()
            raise NotLeader("not the leader", leader=node.leader_addr)
        return state

    @rpc_method
    async def set_quota(
        self,
        volume: str,
        ino: int,
        max_bytes: int | None = None,
        max_inodes: int | None = None,
        client_id: str = "",
        seq: int = 0,
    ) -> dict:
        return await self._propose(C.SetQuota, client_id, seq, volume, ino, max_bytes, max_inodes)

    # -- data -------------------------------------------------------------------------

    @rpc_method
    async def alloc_slices(self, count: int = 1, client_id: str = "", seq: int = 0) -> int:
        return await self._propose(C.AllocSlices, client_id, seq, count)

    @rpc_method
    async def write_slice(
        self,
        volume: str,
        ino: int,
        chunk: int,
        slice_id: int,
        pos: int,
        length: int,
        offset: int,
        mtime_ns: int,
        client_id: str = "",
        seq: int = 0,
    ) -> dict:
        return await self._propose(
            C.WriteSlice,
            client_id,
            seq,
            volume,
            ino,
            chunk,
            slice_id,
            pos,
            length,
            offset,
            mtime_ns,
        )

    @rpc_method
    async def compact_chunk(
        self,
        volume: str,
        ino: int,
        chunk: int,
        expect: list,
        slice_id: int,
        length: int,
        client_id: str = "",
        seq: int = 0,
    ) -> dict:
        return await self._propose(
            C.CompactChunk, client_id, seq, volume, ino, chunk, expect, slice_id, length
        )

    @rpc_method
    async def purge_trash(
        self, volume: str, slice_ids: list, client_id: str = "", seq: int = 0
    ) -> int:
        return await self._propose(C.PurgeTrash, client_id, seq, volume, slice_ids)

    # -- cluster map --------------------------------------------------------------------

    @rpc_method
    async def cluster_map(self) -> dict:
        state = await self._read()
        self._check_leadership()
        return state.cluster.to_dict()

    @rpc_method
    async def register_node(
        self,
        kind: str,
        id: str,
        addr: str,
        zone: str,
        capacity: int,
        client_id: str = "",
        seq: int = 0,
    ) -> int:
        epoch = await self._propose(C.RegisterNode, client_id, seq, kind, id, addr, zone, capacity)
        self.state.cluster.heartbeat(kind, id, self._used(kind, id), time.monotonic())
        return epoch

    def _used(self, kind: str, node_id: str) -> int:
        nodes = (
            self.state.cluster.datanodes if kind == "datanode" else self.state.cluster.cachenodes
        )
        node = nodes.get(node_id)
        return node.used if node else 0

    @rpc_method
    async def remove_node(self, kind: str, id: str, client_id: str = "", seq: int = 0) -> int:
        return await self._propose(C.RemoveNode, client_id, seq, kind, id)

    @rpc_method
    async def node_heartbeat(self, kind: str, id: str, used: int = 0) -> None:
        """Soft state: no log entry; only the leader keeps it."""
        state = await self._read()
        self._check_leadership()
        state.cluster.heartbeat(kind, id, used, time.monotonic())
