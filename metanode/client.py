"""MetaClient: the metanode RPC surface for the FUSE client, tools and benches.

It finds the leader (asking the addresses in turn and following ``NotLeader``
hints), retries a call that failed for reasons of availability (no leader
yet, leader died, connection lost, timed out) until its deadline, and raises
typed errors for everything else. A mutation keeps the same
``(client_id, seq)`` across all its retries, so the metanodes apply it once
and answer a retry with the first answer: a create whose reply was lost in a
failover comes back as the inode it made, not as EEXIST.

A mounted session must heartbeat, or the leader ends it after its timeout
(and frees the unlinked files it held open). ``mount_volume`` therefore
starts a heartbeat task for the session, in the injected ``nursery`` if one
was given, else as a trio system task; ``close_session`` stops it.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from typing import Any

import trio

from cachefs.errors import (
    Busy,
    CacheFSError,
    ConnectionLost,
    NotLeader,
    TimedOut,
    Unavailable,
    Unreachable,
)
from cachefs.rpc import RpcPool

log = logging.getLogger(__name__)

_RETRY = (NotLeader, Unreachable, ConnectionLost, TimedOut, Unavailable, Busy)


class MetaClient:
    """One per process (or per mount); safe for many concurrent tasks."""

    MIN_ATTEMPT = 0.25  # seconds: an attempt never gets less, unless the deadline has less left
    BACKOFF_MIN = 1.0  # seconds an address that did not answer is skipped, doubling ...
    BACKOFF_MAX = 4.0  # ... up to this while it stays silent

    def __init__(
        self,
        pool: RpcPool,
        addrs: list[str],
        *,
        client_id: str | None = None,
        deadline: float = 30.0,
        attempt_timeout: float = 5.0,
        heartbeat_interval: float = 10.0,
        nursery: trio.Nursery | None = None,
    ) -> None:
        if not addrs:
            raise ValueError("MetaClient needs at least one metanode address")
        self.pool = pool
        self.addrs = list(addrs)
        self.client_id = client_id or f"mc-{uuid.uuid4().hex[:16]}"
        self.deadline = deadline
        self.attempt_timeout = attempt_timeout
        self.leader: str | None = None
        self._failed: dict[str, tuple[float, float]] = {}  # addr -> (skip until, back-off)
        self._turn = 0
        self._seq = itertools.count(1)
        self.retries = 0
        self.heartbeat_interval = heartbeat_interval
        self._nursery = nursery
        self._heartbeats: dict[str, trio.CancelScope] = {}
        self._tokens: dict[str, str] = {}  # volume -> mount token, for remounts

    async def call(
        self,
        method: str,
        args: dict[str, Any],
        *,
        mutation: bool = False,
        deadline: float | None = None,
    ) -> Any:
        """Call ``method`` on the leader, retrying availability failures.

        One unreachable or frozen metanode costs a bounded share of the
        deadline, not all of it: an attempt on the known leader gets at most
        half of what is left while other addresses remain, an attempt while
        the leader is unknown gets an equal share among the addresses, and
        connecting counts against it. An address that failed that way is
        skipped for a back-off (:meth:`_pick`), so the next calls go to the
        others at once.

        Raises:
            TimedOut: no leader answered within the deadline (the last
                availability error is chained).
            CacheFSError: the metanodes' answer, typed.
        """
        if mutation:
            args = {
                **args,
                "client_id": args.get("client_id") or self.client_id,
                "seq": next(self._seq),
            }
        budget = self.deadline if deadline is None else deadline
        give_up = trio.current_time() + budget
        backoff = 0.02
        last: CacheFSError | None = None
        while True:
            left = give_up - trio.current_time()
            if left <= 0:
                raise TimedOut(
                    f"{method}: no metanode leader answered within {budget:.0f}s "
                    f"(last error: {last})"
                ) from last
            addr, alternatives = self._pick()
            if not alternatives:
                share = left
            elif addr == self.leader:
                share = left / 2
            else:
                share = left / (alternatives + 1)
            timeout = min(self.attempt_timeout, left, max(self.MIN_ATTEMPT, share))
            conn = self.pool.live(addr)
            try:
                if conn is not None:  # nothing to connect: the call's own deadline bounds it
                    reply = await conn.call(method, args, timeout=timeout)
                else:
                    with trio.fail_after(timeout + 0.05):  # connecting included
                        reply = await self.pool.call(addr, method, args, timeout=timeout)
                self.leader = addr
                self._failed.pop(addr, None)
                return reply.result
            except trio.TooSlowError:
                last = TimedOut(f"{method} to {addr}: connecting took over {timeout:.2f}s")
                self._fail(addr)
            except NotLeader as exc:
                last = exc
                self._failed.pop(addr, None)  # it answered
                hint = exc.details.get("leader")
                if hint and hint != addr and not self._backed_off(hint):
                    self.leader = hint
                    continue  # follow the redirect at once
                self.leader = None
                self._turn += 1
            except _RETRY as exc:
                last = exc
                if isinstance(exc, ConnectionLost | Unreachable | TimedOut):
                    self._fail(addr)
                else:
                    if self.leader == addr:
                        self.leader = None
                    self._turn += 1
            self.retries += 1
            await trio.sleep(min(backoff, max(0.0, give_up - trio.current_time())))
            backoff = min(backoff * 2, 0.5)

    def _backed_off(self, addr: str) -> bool:
        entry = self._failed.get(addr)
        return entry is not None and entry[0] > trio.current_time()

    def _fail(self, addr: str) -> None:
        """``addr`` did not answer: skip it for a while (doubling while it stays silent)."""
        _until, delay = self._failed.get(addr, (0.0, 0.0))
        delay = min(self.BACKOFF_MAX, max(self.BACKOFF_MIN, 2 * delay))
        self._failed[addr] = (trio.current_time() + delay, delay)
        if self.leader == addr:
            self.leader = None
        self._turn += 1
        self.pool.forget(addr)

    def _pick(self) -> tuple[str, int]:
        """The address to try next, and how many others are worth trying after it.

        The known leader first, else the addresses in turn; those that failed
        recently are skipped until their back-off ends, unless all have
        failed, and then the one whose back-off ends first is tried.
        """
        live = [a for a in self.addrs if not self._backed_off(a)]
        if self.leader is not None and not self._backed_off(self.leader):
            return self.leader, len([a for a in live if a != self.leader])
        if not live:
            return min(self.addrs, key=lambda a: self._failed[a][0]), 0
        addr = live[self._turn % len(live)]
        return addr, len(live) - 1

    async def _m(self, method: str, **args: Any) -> Any:
        return await self.call(method, args, mutation=True)

    async def _r(self, method: str, **args: Any) -> Any:
        return await self.call(method, args)

    # -- volumes and sessions ---------------------------------------------------------

    async def create_volume(
        self,
        name: str,
        policy: str,
        compression: str = "none",
        block_size: int = 4 << 20,
        pg_count: int = 64,
    ) -> dict[str, Any]:
        return await self._m(
            "create_volume",
            name=name,
            policy=policy,
            compression=compression,
            block_size=block_size,
            pg_count=pg_count,
        )

    async def set_volume(self, name: str, compression: str) -> dict[str, Any]:
        return await self._m("set_volume", name=name, compression=compression)

    async def list_volumes(self) -> dict[str, Any]:
        return await self._r("list_volumes")

    async def mount_volume(
        self, volume: str, client_id: str | None = None, token: str | None = None
    ) -> dict[str, Any]:
        """``token``: the volume's mount token (kept for later remounts)."""
        if token is not None:
            self._tokens[volume] = token
        info = await self._m(
            "mount_volume",
            volume=volume,
            client_id=client_id or self.client_id,
            token=self._tokens.get(volume),
        )
        session = str(info["session"])
        if session not in self._heartbeats:
            scope = trio.CancelScope()
            self._heartbeats[session] = scope
            if self._nursery is not None:
                self._nursery.start_soon(self._heartbeat, session, scope)
            else:
                trio.lowlevel.spawn_system_task(self._heartbeat, session, scope)
        return info

    async def _heartbeat(self, session: str, scope: trio.CancelScope) -> None:
        """Keep ``session`` alive until it is closed; never raises."""
        warned = False
        with scope:
            while True:
                await trio.sleep(self.heartbeat_interval)
                try:
                    alive = await self.call(
                        "session_heartbeat", {"session": session}, deadline=self.heartbeat_interval
                    )
                except CacheFSError as exc:
                    if not warned:
                        log.warning("session %s: heartbeat failed: %s", session, exc)
                    warned = True
                    continue
                except Exception as exc:  # noqa: BLE001 - a system task must not raise
                    log.warning("session %s: heartbeats stop: %r", session, exc)
                    return
                warned = False
                if not alive:
                    log.error(
                        "session %s was ended by the metanodes (silent too long); "
                        "files it held open after unlink are gone",
                        session,
                    )
                    return

    async def session_heartbeat(self, session: str, opens: list[int] | None = None) -> bool:
        """Keep ``session`` alive; ``opens`` (the inodes it holds open) lets a
        new leader learn the session's open set."""
        args: dict[str, Any] = {"session": session}
        if opens is not None:
            args["opens"] = opens
        return bool(await self.call("session_heartbeat", args))

    async def close_session(self, volume: str, session: str) -> None:
        scope = self._heartbeats.pop(session, None)
        if scope is not None:
            scope.cancel()
        await self._m("close_session", volume=volume, session=session)

    def close(self) -> None:
        """Stop every heartbeat (the sessions then expire on the metanodes)."""
        for scope in self._heartbeats.values():
            scope.cancel()
        self._heartbeats.clear()

    async def meta_status(self, addr: str) -> dict[str, Any]:
        """One replica's view (any replica answers)."""
        return (await self.pool.call(addr, "meta_status", {}, timeout=self.attempt_timeout)).result

    # -- namespace reads ----------------------------------------------------------------

    async def lookup(self, volume: str, parent: int, name: bytes) -> dict[str, Any]:
        return await self._r("lookup", volume=volume, parent=parent, name=name)

    async def getattr(self, volume: str, ino: int) -> dict[str, Any]:
        return await self._r("getattr", volume=volume, ino=ino)

    async def readlink(self, volume: str, ino: int) -> bytes:
        return await self._r("readlink", volume=volume, ino=ino)

    async def readdir(self, volume: str, ino: int, cookie: int = 0, limit: int = 1000) -> list[Any]:
        return await self._r("readdir", volume=volume, ino=ino, cookie=cookie, limit=limit)

    async def statfs(self, volume: str) -> dict[str, Any]:
        return await self._r("statfs", volume=volume)

    async def getxattr(self, volume: str, ino: int, name: bytes) -> bytes:
        return await self._r("getxattr", volume=volume, ino=ino, name=name)

    async def listxattr(self, volume: str, ino: int) -> list[bytes]:
        return await self._r("listxattr", volume=volume, ino=ino)

    async def read_chunk(self, volume: str, ino: int, chunk: int) -> list[list[int]]:
        return await self._r("read_chunk", volume=volume, ino=ino, chunk=chunk)

    async def get_usage(self, volume: str, ino: int) -> dict[str, Any]:
        return await self._r("get_usage", volume=volume, ino=ino)

    async def list_trash(
        self, volume: str, limit: int = 1000, before_ns: int | None = None
    ) -> list[list[int]]:
        return await self._r("list_trash", volume=volume, limit=limit, before_ns=before_ns)

    # -- namespace mutations -------------------------------------------------------------

    async def setattr(
        self,
        volume: str,
        ino: int,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
    ) -> dict[str, Any]:
        return await self._m(
            "setattr",
            volume=volume,
            ino=ino,
            mode=mode,
            uid=uid,
            gid=gid,
            size=size,
            atime_ns=atime_ns,
            mtime_ns=mtime_ns,
        )

    async def mknod(
        self,
        volume: str,
        parent: int,
        name: bytes,
        mode: int,
        rdev: int = 0,
        uid: int = 0,
        gid: int = 0,
    ) -> dict[str, Any]:
        return await self._m(
            "mknod", volume=volume, parent=parent, name=name, mode=mode, rdev=rdev, uid=uid, gid=gid
        )

    async def mkdir(
        self, volume: str, parent: int, name: bytes, mode: int, uid: int = 0, gid: int = 0
    ) -> dict[str, Any]:
        return await self._m(
            "mkdir", volume=volume, parent=parent, name=name, mode=mode, uid=uid, gid=gid
        )

    async def symlink(
        self, volume: str, parent: int, name: bytes, target: bytes, uid: int = 0, gid: int = 0
    ) -> dict[str, Any]:
        return await self._m(
            "symlink", volume=volume, parent=parent, name=name, target=target, uid=uid, gid=gid
        )

    async def link(self, volume: str, ino: int, new_parent: int, new_name: bytes) -> dict[str, Any]:
        return await self._m(
            "link", volume=volume, ino=ino, new_parent=new_parent, new_name=new_name
        )

    async def unlink(self, volume: str, parent: int, name: bytes) -> None:
        await self._m("unlink", volume=volume, parent=parent, name=name)

    async def rmdir(self, volume: str, parent: int, name: bytes) -> None:
        await self._m("rmdir", volume=volume, parent=parent, name=name)

    async def rename(
        self,
        volume: str,
        parent: int,
        name: bytes,
        new_parent: int,
        new_name: bytes,
        flags: int = 0,
    ) -> None:
        await self._m(
            "rename",
            volume=volume,
            parent=parent,
            name=name,
            new_parent=new_parent,
            new_name=new_name,
            flags=flags,
        )

    async def setxattr(
        self, volume: str, ino: int, name: bytes, value: bytes, flags: int = 0
    ) -> None:
        await self._m("setxattr", volume=volume, ino=ino, name=name, value=value, flags=flags)

    async def removexattr(self, volume: str, ino: int, name: bytes) -> None:
        await self._m("removexattr", volume=volume, ino=ino, name=name)

    async def open(self, volume: str, ino: int, session: str) -> dict[str, Any]:
        return await self._m("open", volume=volume, ino=ino, session=session)

    async def release(self, volume: str, ino: int, session: str) -> None:
        await self._m("release", volume=volume, ino=ino, session=session)

    async def set_quota(
        self, volume: str, ino: int, max_bytes: int | None = None, max_inodes: int | None = None
    ) -> dict[str, Any]:
        return await self._m(
            "set_quota", volume=volume, ino=ino, max_bytes=max_bytes, max_inodes=max_inodes
        )

    # -- data -------------------------------------------------------------------------

    async def alloc_slices(self, count: int = 1) -> int:
        return await self._m("alloc_slices", count=count)

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
    ) -> dict[str, Any]:
        return await self._m(
            "write_slice",
            volume=volume,
            ino=ino,
            chunk=chunk,
            slice_id=slice_id,
            pos=pos,
            length=length,
            offset=offset,
            mtime_ns=mtime_ns,
        )

    async def compact_chunk(
        self, volume: str, ino: int, chunk: int, expect: list[int], slice_id: int, length: int
    ) -> dict[str, Any]:
        return await self._m(
            "compact_chunk",
            volume=volume,
            ino=ino,
            chunk=chunk,
            expect=list(expect),
            slice_id=slice_id,
            length=length,
        )

    async def purge_trash(self, volume: str, slice_ids: list[int]) -> int:
        return await self._m("purge_trash", volume=volume, slice_ids=list(slice_ids))

    # -- cluster map --------------------------------------------------------------------

    async def cluster_map(self) -> dict[str, Any]:
        return await self._r("cluster_map")

    async def register_node(self, kind: str, id: str, addr: str, zone: str, capacity: int) -> int:
        return await self._m(
            "register_node", kind=kind, id=id, addr=addr, zone=zone, capacity=capacity
        )

    async def remove_node(self, kind: str, id: str) -> int:
        return await self._m("remove_node", kind=kind, id=id)

    async def node_heartbeat(self, kind: str, id: str, used: int) -> None:
        await self._r("node_heartbeat", kind=kind, id=id, used=used)
