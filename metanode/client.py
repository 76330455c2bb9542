"""MetaClient: the metanodes' interface for the FUSE client, tools and benches.

Callers build a command (:mod:`cachefs.commands`) or a query
(:mod:`cachefs.queries`), which validates itself, and hand it to
:meth:`MetaClient.mutate` or :meth:`MetaClient.query`; the answer comes back
decoded by the class's ``REPLY`` (a typed reply of :mod:`cachefs.messages`)::

    attr = await meta.mutate(C.Mkdir(volume, parent, b"dir", 0o755, uid, gid))
    attr = await meta.query(Q.GetAttr(volume, attr.ino))

It finds the leader (asking the addresses in turn and following ``NotLeader``
hints), retries a call that failed for reasons of availability (no leader
yet, leader died, connection lost, timed out) until its deadline, and raises
typed errors for everything else. A mutation gets this client's
``client_id`` and a fresh ``seq``, and keeps them across all its retries, so
the metanodes apply it once and answer a retry with the first answer: a
create whose reply was lost in a failover comes back as the inode it made,
not as EEXIST.

A mounted session must heartbeat, or the leader ends it after its timeout
(and frees the unlinked files it held open). ``mount_volume`` therefore
starts a heartbeat task for the session, in the injected ``nursery`` if one
was given, else as a trio system task; ``close_session`` stops it.
"""

from __future__ import annotations

import itertools
import logging
import os
import uuid
from typing import Any, TypeVar

import trio

from cachefs import commands as C
from cachefs import messages as M
from cachefs import queries as Q
from cachefs.errors import (
    Busy,
    CacheFSError,
    ConnectionLost,
    NotADirectory,
    NotLeader,
    TimedOut,
    Unavailable,
    Unreachable,
)
from cachefs.messages import MountInfo
from cachefs.rpc import RpcPool

ROOT = 1  # every volume's root inode
log = logging.getLogger(__name__)

R = TypeVar("R")

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

    async def mutate(
        self,
        cmd: C.Command[R],
        *,
        token: str | None = None,
        lease: tuple[str, tuple[int, ...], tuple[int, ...]] | None = None,
        deadline: float | None = None,
    ) -> R:
        """Apply ``cmd`` once, however often it has to be sent; its decoded reply.
        ``token``: a volume's mount token, for the commands that take one.
        ``lease``: ``(session, kept, opens)``: the sending session's leases
        this change leaves alone (the session forgets what it makes stale)
        and which of those inodes it has open unannounced
        (``client/leases.py``).

        Raises:
            TimedOut: no leader answered within the deadline.
            CacheFSError: the metanodes' answer, typed.
            IOFailure: the reply was malformed.
        """
        if not cmd.NAME:
            raise ValueError(f"{type(cmd).__name__} is proposed by the leader, not sent")
        args: dict[str, Any] = {"a": cmd.to_request(self.client_id, next(self._seq))}
        if token is not None:
            args["token"] = token
        if lease is not None:
            args["lease"] = [lease[0], list(lease[1]), list(lease[2])]
        return type(cmd).REPLY(await self.call(cmd.NAME, args, deadline=deadline))

    async def create(
        self, cmd: C.Mknod | C.Mkdir, lease: tuple[str, tuple[int, ...], tuple[int, ...]]
    ) -> M.Created:
        """Create a regular file or a directory as :meth:`mutate` does, and
        have the answer carry a lease on it for the session of ``lease``
        (with its and its directory's attributes, and whether it has
        extended attributes; a directory is leased only while empty)."""
        args = {
            "a": cmd.to_request(self.client_id, next(self._seq)),
            "lease": [lease[0], list(lease[1]), list(lease[2])],
            "grant": True,
        }
        return M.Created.from_wire(await self.call(cmd.NAME, args))

    async def query(self, q: Q.Query[R], *, deadline: float | None = None) -> R:
        """Ask the leader ``q``; its decoded reply (raises as :meth:`mutate`)."""
        return type(q).REPLY(await self.call(q.NAME, {"a": q.to_wire()}, deadline=deadline))

    async def resolve(self, volume: str, path: str) -> Any:
        """The attributes of ``path`` (``/a/b``) in ``volume``, looked up name by
        name from the root (the admin tools' paths; a mount resolves through the kernel)."""
        attr = await self.query(Q.GetAttr(volume, ROOT))
        for name in [p for p in path.split("/") if p]:
            if not attr.is_dir:
                raise NotADirectory(f"{path}: a component before {name!r} is not a directory")
            attr = await self.query(Q.Lookup(volume, attr.ino, os.fsencode(name)))
        return attr

    async def call(
        self,
        method: str,
        args: dict[str, Any],
        *,
        deadline: float | None = None,
        payload: bytes | None = None,
        full: bool = False,
    ) -> Any:
        """Call ``method`` on the leader, retrying availability failures; the
        raw result (:meth:`mutate` and :meth:`query` build the arguments), or
        with ``full`` the whole :class:`~cachefs.rpc.Reply` (its payload too).

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
                    reply = await conn.call(method, args, payload=payload, timeout=timeout)
                else:
                    with trio.fail_after(timeout + 0.05):  # connecting included
                        reply = await self.pool.call(
                            addr, method, args, payload=payload, timeout=timeout
                        )
                self.leader = addr
                self._failed.pop(addr, None)
                return reply if full else reply.result
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

    # -- sessions ---------------------------------------------------------------------

    async def mount_volume(self, volume: str, token: str | None = None, leases: bool = True) -> MountInfo:
        """Open a session on ``volume`` and keep it alive with heartbeats until
        :meth:`close_session`. ``token``: the volume's mount token (kept for
        later remounts). ``leases``: whether the session may take metadata
        leases (``MountVolume``)."""
        if token is not None:
            self._tokens[volume] = token
        info = await self.mutate(C.MountVolume(volume, leases), token=self._tokens.get(volume))
        if info.session not in self._heartbeats:
            scope = trio.CancelScope()
            self._heartbeats[info.session] = scope
            if self._nursery is not None:
                self._nursery.start_soon(self._heartbeat, info.session, scope)
            else:
                trio.lowlevel.spawn_system_task(self._heartbeat, info.session, scope)
        return info

    async def _heartbeat(self, session: str, scope: trio.CancelScope) -> None:
        """Keep ``session`` alive until it is closed; never raises."""
        warned = False
        with scope:
            while True:
                await trio.sleep(self.heartbeat_interval)
                try:
                    alive = await self.query(
                        Q.SessionHeartbeat(session), deadline=self.heartbeat_interval
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

    async def close_session(self, session: str) -> None:
        """Stop the session's heartbeats and end it (its unlinked-open files go)."""
        scope = self._heartbeats.pop(session, None)
        if scope is not None:
            scope.cancel()
        await self.mutate(C.CloseSession(session))

    def close(self) -> None:
        """Stop every heartbeat (the sessions then expire on the metanodes)."""
        for scope in self._heartbeats.values():
            scope.cancel()
        self._heartbeats.clear()

    async def meta_status(self, addr: str) -> dict[str, Any]:
        """One replica's view (any replica answers)."""
        return (await self.pool.call(addr, "meta_status", {}, timeout=self.attempt_timeout)).result
