"""An in-process metanode: the real state machine and service, one replica that always leads.

:class:`LocalMetanode` runs the real ``MetaState`` and the real
``MetaService`` (every leader hook, the open table, session expiry, orphan
purges) behind a real ``RpcServer`` on 127.0.0.1, over :class:`LocalRaft`,
a stand-in for Raft with a single replica that is always the leader: a
proposal is applied at once, from its log encoding, with no disk and no
election. Clients reach it with a real ``MetaClient``; so everything but
replication is what a metanode cluster runs, in milliseconds. The POSIX
tests (``tests/client/localfs.py``) and benches mount on it.

    async with local_metanode() as meta:
        await meta.create_volume("vol", block_size=64 * 1024)
        client = meta.client(pool)  # a MetaClient
        session = await meta.session(pool, "vol")  # or a client Session of the volume
        ...
        meta.check()  # the namespace invariants (fsck) hold
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from cachefs.client.session import Session
from cachefs.commands import CreateVolume
from cachefs.errors import NotSupported
from cachefs.metanode.client import MetaClient
from cachefs.metanode.invariants import check
from cachefs.metanode.namespace import MetaState
from cachefs.metanode.raft.core import RaftConfig
from cachefs.metanode.raft.driver import DriverConfig
from cachefs.metanode.raft.membership import Membership
from cachefs.metanode.service import MetaService
from cachefs.queries import ClusterMap
from cachefs.rpc import RpcPool, RpcServer
from cachefs.testing.backing import DictBacking
from cachefs.transport.tcp import TcpTransport


@dataclass(frozen=True)
class _Core:
    config: RaftConfig  # what the service reads its lease length from, as of a RaftNode


class LocalRaft:
    """The part of ``RaftNode`` that ``MetaService`` uses, for a lone replica
    that always leads: committing is applying (every proposal is decoded from
    its log entry, as a follower would), and a read needs no confirmation."""

    id = 1
    term = 1
    is_leader = True
    role = "leader"
    lease_epoch = (1, 0)
    membership = Membership.of([1])

    def __init__(self, state: MetaState, addr: str | None = None) -> None:
        self.state = state
        self.leader_addr = addr
        self.commit_index = state.applied_index
        self.core = _Core(RaftConfig())
        self.dconfig = DriverConfig()
        self.peers: dict[int, str] = {}

    async def propose(self, command: bytes, *, decoded: Any = None) -> Any:
        del decoded  # apply what the log would hold
        await trio.lowlevel.checkpoint()  # other tasks run while "replicating", as in Raft
        self.commit_index += 1
        return self.state.apply(self.commit_index, command)

    async def read_index(self) -> None:
        await trio.lowlevel.checkpoint()

    @property
    def last_index(self) -> int:
        return self.commit_index

    def progress(self) -> dict[int, dict[str, Any]]:
        return {}  # no followers

    async def change_membership(self, new: Membership) -> None:
        raise NotSupported("a lone in-process metanode has no membership to change")


class LocalMetanode:
    """One in-process metanode (see the module docstring); start it with
    :func:`local_metanode`."""

    def __init__(self, secret: bytes | None = None, **service_options: Any) -> None:
        self.state = MetaState()
        self.service = MetaService(self.state, **service_options)
        self.server = RpcServer(self.service, name="metanode", secret=secret)
        self.addr = ""

    def client(self, pool: RpcPool, **options: Any) -> MetaClient:
        """A real MetaClient of this metanode (``pool``: with a credential
        of the metanode's ``secret``, or ``secret=None`` if it has none)."""
        return MetaClient(pool, [self.addr], **options)

    async def session(self, pool: RpcPool, volume: str, **options: Any) -> Session:
        """A client session of ``volume`` mounted on this metanode (``options``:
        the MetaClient's), its blocks kept in a :class:`DictBacking`."""
        meta = self.client(pool, **options)
        info = await meta.mount_volume(volume)
        return Session(
            meta, volume, info.session, await meta.query(ClusterMap()),
            zone="", transport=TcpTransport(pool), backing=DictBacking(),  # type: ignore[arg-type]
        )  # fmt: skip

    async def create_volume(
        self, name: str, policy: str = "replica:1", *, block_size: int = 4 << 20
    ) -> dict[str, Any]:
        """An open volume, created through the service as an admin would."""
        cmd = CreateVolume(name, policy, "none", block_size, 8, now_ns=time.time_ns())
        return await self.service.mutate(cmd)

    def check(self) -> None:
        """Raise AssertionError if the namespace breaks an invariant (fsck)."""
        check(self.state)


@asynccontextmanager
async def local_metanode(
    *, housekeeping: float = 1.0, secret: bytes | None = None, **service_options: Any
) -> AsyncIterator[LocalMetanode]:
    """Serve a :class:`LocalMetanode` on 127.0.0.1 (a free port) until the
    block ends; ``housekeeping``: seconds between session expiry passes;
    ``secret``: the cluster secret (None: insecure, everyone may do anything)."""
    meta = LocalMetanode(secret, **service_options)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(meta.server.serve, "127.0.0.1", 0)
        meta.addr = f"127.0.0.1:{port}"
        meta.service.node = LocalRaft(meta.state, meta.addr)  # type: ignore[assignment]
        await nursery.start(meta.service.run_housekeeping, housekeeping)
        await nursery.start(functools.partial(meta.service.run_repo_polls, tick=min(housekeeping, 1.0)))
        await nursery.start(meta.service.run_tree_deletes, min(housekeeping, 0.5))
        try:
            yield meta
        finally:
            with trio.CancelScope(shield=True):
                await meta.server.shutdown(grace=0.5)
            nursery.cancel_scope.cancel()
