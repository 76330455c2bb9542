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
because of a failover.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import trio

from cachefs.errors import CacheFSError, NotLeader
from cachefs.rpc import rpc_method

from . import commands as C
from .namespace import Failure, MetaState

if TYPE_CHECKING:
    from .raft.driver import RaftNode

log = logging.getLogger(__name__)

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

    # -- plumbing -----------------------------------------------------------------

    def _raft(self) -> RaftNode:
        if self.node is None:
            raise NotLeader("metanode is starting", leader=None)
        return self.node

    async def _propose(self, cls: type[C.Command], client_id: str, seq: int, *args: Any) -> Any:
        cmd = cls(client_id, seq, time.time_ns(), *args)  # validates: may raise EINVAL etc.
        result = await self._raft().propose(cmd.encode())
        if isinstance(result, Failure):
            raise result.error()
        return result

    async def _read(self) -> MetaState:
        node = self._raft()
        if (
            self.read_lease
            and node.is_leader
            and node.term == self._lease_term
            and time.monotonic() < self._lease_until
        ):
            return self.state
        start = time.monotonic()  # the confirming heartbeats leave after this
        await node.read_index()
        if self.read_lease and node.is_leader:
            lease = LEASE_FRACTION * node.core.config.election_tick * node.dconfig.tick_interval
            if node.term != self._lease_term or start + lease > self._lease_until:
                self._lease_term = node.term
                self._lease_until = start + lease
        return self.state

    def _check_leadership(self) -> None:
        """On becoming leader, restart every soft clock (a grace period)."""
        node = self.node
        leader = node is not None and node.is_leader
        if leader and not self._was_leader:
            now = time.monotonic()
            self._session_seen = dict.fromkeys(self.state.sessions, now)
            self.state.cluster.reset_liveness(now)
        self._was_leader = leader

    async def run_housekeeping(
        self,
        interval: float = 1.0,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Expire silent sessions and mark silent nodes down, while leader."""
        task_status.started()
        while True:
            await trio.sleep(interval)
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
    ) -> dict:
        return await self._propose(
            C.CreateVolume, client_id, seq, name, policy, compression, block_size, pg_count
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
            }
        return out

    @rpc_method
    async def mount_volume(self, volume: str, client_id: str, seq: int = 0) -> dict:
        result = await self._propose(C.MountVolume, client_id, seq, volume)
        self._touch_session(result["session"])
        return result

    @rpc_method
    async def session_heartbeat(self, session: str) -> bool:
        """Keep a session alive; False if it is gone (the client must remount)."""
        state = await self._read()
        if session not in state.sessions:
            return False
        self._touch_session(session)
        return True

    @rpc_method
    async def close_session(
        self, volume: str, session: str, client_id: str = "", seq: int = 0
    ) -> None:
        self._session_seen.pop(session, None)
        await self._propose(C.CloseSession, client_id, seq, session)

    # -- namespace reads ----------------------------------------------------------------

    @rpc_method
    async def lookup(self, volume: str, parent: int, name: bytes) -> dict:
        return (await self._read()).lookup(volume, parent, name)

    @rpc_method
    async def getattr(self, volume: str, ino: int) -> dict:
        return (await self._read()).getattr(volume, ino)

    @rpc_method
    async def readlink(self, volume: str, ino: int) -> bytes:
        return (await self._read()).readlink(volume, ino)

    @rpc_method
    async def readdir(self, volume: str, ino: int, cookie: int = 0, limit: int = 1000) -> list:
        return (await self._read()).readdir(volume, ino, cookie, min(limit, MAX_READDIR))

    @rpc_method
    async def statfs(self, volume: str) -> dict:
        return (await self._read()).statfs(volume)

    @rpc_method
    async def getxattr(self, volume: str, ino: int, name: bytes) -> bytes:
        return (await self._read()).getxattr(volume, ino, name)

    @rpc_method
    async def listxattr(self, volume: str, ino: int) -> list:
        return (await self._read()).listxattr(volume, ino)

    @rpc_method
    async def read_chunk(self, volume: str, ino: int, chunk: int) -> list:
        return (await self._read()).read_chunk(volume, ino, chunk)

    @rpc_method
    async def get_usage(self, volume: str, ino: int) -> dict:
        """Bytes and inodes of a directory's subtree, and its quota."""
        return (await self._read()).usage(volume, ino)

    @rpc_method
    async def list_trash(
        self, volume: str, limit: int = 1000, before_ns: int | None = None
    ) -> list:
        """Unreferenced slices for the garbage collector: ``[slice_id, size, deleted_ns]``."""
        return (await self._read()).trash(volume, max(1, min(limit, 100_000)), before_ns)

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
        await self._propose(C.Unlink, client_id, seq, volume, parent, name)

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
        await self._propose(
            C.Rename, client_id, seq, volume, parent, name, new_parent, new_name, flags, new_volume
        )

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
        self._touch_session(session)
        return await self._propose(C.Open, client_id, seq, volume, ino, session)

    @rpc_method
    async def release(
        self, volume: str, ino: int, session: str, client_id: str = "", seq: int = 0
    ) -> None:
        self._touch_session(session)
        await self._propose(C.Release, client_id, seq, volume, ino, session)

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
