"""The RPC layer on trio: server, connections and a per-peer connection pool.

The frame format and handshake live in :mod:`cachefs.wire` (sans-IO); this
module owns sockets, tasks, deadlines and limits.

Theory of operation
-------------------
A :class:`Connection` has one reader task, which receives straight into the
decoder's buffers (``recv_into``: bulk payloads land in their final buffer),
and one writer task, which drains an outbox: frames queued by many callers
while the socket was busy go out in one ``sendmsg``. That coalescing is what
lets 64 small calls in flight share syscalls.

Client side, each call takes a slot (a call id and an event), queues its
frame, and waits under ``trio.fail_after``. A reply finds its slot by id, in
any order. A call that times out removes its slot, so its late reply finds
nothing and is dropped.

Server side, the reader spawns one task per request (bounded by
``Limits.max_inflight``; above it the caller gets ``EBUSY`` at once), checks
the arguments against the handler's annotations, runs the handler under the
caller's deadline, and queues the reply. A plain (non-async) handler cannot
block, so the reader runs it inline, with no task and no cancel scope (the
two cost more than a small handler): it answers at once, or returns an
awaitable for its slow path (a read that must first confirm leadership),
which then runs in a task under the deadline like an async handler. Malformed input closes only that
connection, after an error frame; the server keeps serving the others.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import math
import os
import socket
import ssl
import time
import types
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from cachefs import metrics, wire
from cachefs.credentials import (
    ANYONE,
    INSECURE,
    SERVERS,
    Credential,
    Identity,
    Secret,
    as_credential,
    derive_key,
    parse_key_id,
)
from cachefs.errors import (
    AuthFailed,
    Busy,
    CacheFSError,
    ConnectionLost,
    FrameTooLarge,
    InvalidArgument,
    NoSuchMethod,
    PermissionDenied,
    ProtocolError,
    TimedOut,
    Unavailable,
    Unreachable,
    error_from_wire,
)
from cachefs.opstats import OpStats

log = logging.getLogger(__name__)

# Frames per sendmsg. Not everything queued at once: a peer in another process
# starts on the first 32 frames while the rest are still being sent, instead
# of the two sides taking turns on whole batches (measured: 64 small calls in
# flight went from ~18k to ~25k calls/s on 2 cores).
IOV_BATCH = 32


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-connection and per-server limits; the same object configures both ends.

    What a peer can make a server hold: before it authenticates, one frame
    of at most :data:`cachefs.wire.HANDSHAKE_MAX_FRAME` bytes for at most
    ``handshake_timeout`` seconds, in at most ``max_pending`` such
    connections (``max_pending_per_peer`` from one address; a new one evicts
    that peer's, or else the server's, oldest). After it authenticated: the
    request payloads of its calls in flight, at most ``max_inflight_bytes``
    per connection and ``max_total_inflight_bytes`` per server (the reader
    waits for room before it allocates the next payload), one header of at
    most ``max_header``, and replies up to ``max_outbox_bytes`` queued.
    """

    max_payload: int = wire.DEFAULT_MAX_PAYLOAD
    max_header: int = wire.DEFAULT_MAX_HEADER
    max_inflight: int = 1024
    idle_timeout: float = 300.0
    handshake_timeout: float = 3.0
    connect_timeout: float = 5.0
    max_outbox_bytes: int = 32 << 20
    # Abort a connection whose sent data stays unacknowledged this long (a
    # cut link or a frozen peer), instead of the kernel's ~15 minutes.
    tcp_user_timeout: float = 10.0
    max_pending: int = 256
    max_pending_per_peer: int = 32
    max_connections: int = 1024
    max_inflight_bytes: int = 256 << 20
    max_total_inflight_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if not self.max_payload <= self.max_inflight_bytes <= self.max_total_inflight_bytes:
            raise ValueError("Limits: need max_payload <= max_inflight_bytes <= max_total_inflight_bytes")


@dataclass(frozen=True, slots=True)
class Reply:
    """What a call returns: a msgpack-able result and optional bulk bytes."""

    result: Any = None
    payload: wire.Payload | None = None


@dataclass(frozen=True, slots=True)
class CallContext:
    """Who is calling; handlers that want it declare a ``ctx`` parameter (or
    an ``identity`` parameter for the peer's :class:`Identity` alone)."""

    peer: str
    conn_id: int
    deadline: float
    identity: Identity = INSECURE


class _RateLimitedLog:
    """At most one warning per message format per ``interval`` seconds (a
    flood of hostile connections must not flood the log), with a count of
    the ones left out."""

    def __init__(self, logger: logging.Logger, interval: float) -> None:
        self.logger = logger
        self.interval = interval
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        last, skipped = self._last.get(fmt, (-math.inf, 0))
        if now - last < self.interval:
            self._last[fmt] = (last, skipped + 1)
            return
        self._last[fmt] = (now, 0)
        suffix = f" ({skipped} more like it not logged)" if skipped else ""
        self.logger.warning(fmt + suffix, *args)


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"address must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


# ---------------------------------------------------------------- methods

def rpc_method(fn: Callable[..., Any] | None = None, *, name: str | None = None,
               roles: frozenset[str] = SERVERS) -> Any:
    """Mark a method of a service object as callable over RPC: an async
    method, or a plain one that answers inline or returns an awaitable.

    ``roles`` are the credential roles that may call it (see
    :mod:`cachefs.credentials`); by default servers only. The RPC layer
    refuses anyone else with EACCES before the handler runs, and a client
    calling a method with a ``volume`` argument must hold that volume.
    """

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        f.__rpc_name__ = name or f.__name__  # type: ignore[attr-defined]
        f.__rpc_roles__ = frozenset(roles)  # type: ignore[attr-defined]
        return f

    return mark(fn) if fn is not None else mark


_SIMPLE = {int: (int,), float: (float, int), str: (str,), bytes: (bytes,), bool: (bool,),
           list: (list,), dict: (dict,), type(None): (type(None),)}


def _accepted_types(annotation: Any) -> tuple[type, ...] | None:
    """The runtime types an annotation admits, or None for "anything"."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        out: list[type] = []
        for arg in typing.get_args(annotation):
            sub = _accepted_types(arg)
            if sub is None:
                return None
            out.extend(sub)
        return tuple(out)
    if origin is not None:
        annotation = origin
    return _SIMPLE.get(annotation)


def _type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """Resolved annotations; one that cannot be resolved admits anything."""
    try:
        return typing.get_type_hints(fn)
    except NameError:
        hints = {}
        for name, annotation in getattr(fn, "__annotations__", {}).items():
            try:
                hints[name] = eval(annotation, fn.__globals__) if isinstance(annotation, str) else annotation
            except Exception:
                hints[name] = Any
        return hints


@dataclass(frozen=True, slots=True)
class _Param:
    name: str
    types: tuple[type, ...] | None
    required: bool


class Method:
    """A handler with its argument checker, built once at registration."""

    def __init__(self, name: str, fn: Callable[..., Any], roles: frozenset[str] | None = None) -> None:
        self.name = name
        self.fn = fn
        self.roles = roles if roles is not None else getattr(fn, "__rpc_roles__", SERVERS)
        self.inline = not inspect.iscoroutinefunction(fn)
        hints = _type_hints(fn)
        sig = inspect.signature(fn)
        self.wants_payload = "payload" in sig.parameters
        self.wants_ctx = "ctx" in sig.parameters
        # just the peer's identity: cheaper than a CallContext on hot inline paths
        self.wants_identity = "identity" in sig.parameters
        self.params: dict[str, _Param] = {}
        for p in sig.parameters.values():
            if p.name in ("self", "payload", "ctx", "identity") or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            self.params[p.name] = _Param(p.name, _accepted_types(hints.get(p.name, Any)),
                                         p.default is inspect.Parameter.empty)
        self.required = [p.name for p in self.params.values() if p.required]
        self.names_volume = "volume" in self.params

    def admit(self, identity: Identity, args: dict[str, Any]) -> None:
        """Check the caller's role, then the arguments, then (for a client)
        the volume they name; the role first, so a caller without it learns
        nothing of the method's signature.

        Raises:
            PermissionDenied: not this caller's method or volume. InvalidArgument: bad arguments.
        """
        if not identity.may(self.roles):
            raise PermissionDenied(f"{self.name} is not allowed for {identity} "
                                   f"(needs {' or '.join(sorted(self.roles))})")
        self.check(args)
        if identity.volumes is not None and self.names_volume:
            volume = args.get("volume")
            if isinstance(volume, str):
                identity.check_volume(volume)

    def check(self, args: dict[str, Any]) -> None:
        for key, value in args.items():
            param = self.params.get(key)
            if param is None:
                raise InvalidArgument(f"{self.name}: unexpected argument {key!r}")
            if param.types is not None and (
                not isinstance(value, param.types)
                or (isinstance(value, bool) and bool not in param.types)
            ):
                raise InvalidArgument(
                    f"{self.name}: argument {key!r} must be "
                    f"{' or '.join(t.__name__ for t in param.types)}, got {type(value).__name__}"
                )
        for key in self.required:
            if key not in args:
                raise InvalidArgument(f"{self.name}: missing argument {key!r}")


def collect_methods(*services: Any) -> dict[str, Method]:
    """Every ``@rpc_method`` of the given service objects, by wire name."""
    methods: dict[str, Method] = {}
    for service in services:
        for attr in dir(type(service)):
            fn = getattr(service, attr, None)
            name = getattr(fn, "__rpc_name__", None)
            if name is None:
                continue
            if name in methods:
                raise ValueError(f"RPC method {name!r} defined twice")
            methods[name] = Method(name, fn)
    return methods


# ---------------------------------------------------------------- connection

_conn_ids = itertools.count(1)
RECV_BUFFER = 256 * 1024


class _Budget:
    """Request payload bytes in flight on one server, and per connection.

    A connection's reader reserves a payload before the decoder allocates it
    and waits while either limit would be passed; the call releases it when
    its handler is done. So an authenticated peer cannot make the server
    hold more than the limits by sending payloads faster than they are served.
    """

    def __init__(self, limits: Limits) -> None:
        self.per_connection = limits.max_inflight_bytes
        self.total = limits.max_total_inflight_bytes
        self.used = 0
        self._freed = trio.Event()

    async def acquire(self, conn: Connection, n: int) -> None:
        while self.used + n > self.total or conn.inflight_bytes + n > self.per_connection:
            await self._freed.wait()
        self.used += n
        conn.inflight_bytes += n

    def release(self, conn: Connection, n: int) -> None:
        if n:
            self.used -= n
            conn.inflight_bytes -= n
            self._freed.set()
            self._freed = trio.Event()


class Connection:
    """One stream's framing, outbox and writer task, for server and client.

    Over plain TCP it receives with ``recv_into`` straight into the decoder's
    buffers and sends with ``sendmsg``; over TLS (``trio.SSLStream``) it goes
    through the stream's own calls, since the bytes must be decrypted anyway.
    """

    def __init__(self, stream: trio.SocketStream | trio.SSLStream, peer: str, limits: Limits,
                 *, budget: _Budget | None = None) -> None:
        self.stream = stream
        self.sock = stream.socket if isinstance(stream, trio.SocketStream) else None
        raw = stream if isinstance(stream, trio.SocketStream) else stream.transport_stream
        if limits.tcp_user_timeout and hasattr(socket, "TCP_USER_TIMEOUT"):
            try:
                raw.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                                      int(limits.tcp_user_timeout * 1000))
            except OSError:
                pass  # not TCP (a test's socketpair)
        self.peer = peer
        self.peer_host = peer.rpartition(":")[0]
        self.limits = limits
        self.conn_id = next(_conn_ids)
        # Handshake-sized frames until authenticated(); with a budget (server
        # side) every payload is reserved from it before it is allocated.
        self.decoder = wire.FrameDecoder(max_header=wire.HANDSHAKE_MAX_FRAME, max_payload=0,
                                         buffer_size=wire.HANDSHAKE_MAX_FRAME, defer_payload=budget is not None)
        self._recv_size = wire.HANDSHAKE_MAX_FRAME
        self.budget = budget
        self.inflight_bytes = 0  # payload bytes reserved from the budget, not yet released
        self.identity: Identity = INSECURE  # the peer's, once authenticated (server side)
        self.send_mac: wire.FrameMac | None = None
        self._outbox: list[wire.Payload] = []
        self._outbox_bytes = 0
        self._wakeup = trio.Event()
        self._drained = trio.Event()
        self._sending = False
        self.closed = False
        self.last_activity = time.monotonic()

    def authenticated(self, macs: tuple[bytes, bytes] | None = None) -> None:
        """The handshake is done: frames up to the full limits from now on,
        sealed and opened with ``macs`` (send key, receive key) over plain TCP."""
        if macs is not None and self.sock is not None:
            self.send_mac = wire.FrameMac(macs[0])
            self.decoder.mac = wire.FrameMac(macs[1])
        self.decoder.set_limits(max_header=self.limits.max_header, max_payload=self.limits.max_payload,
                                buffer_size=RECV_BUFFER)
        self._recv_size = RECV_BUFFER

    # -- sending

    def send(self, event: wire.Event) -> None:
        """Queue a frame; the writer task sends it. Never blocks."""
        if self.closed:
            raise ConnectionLost(f"connection to {self.peer} is closed")
        bufs = wire.encode(event, self.send_mac)
        self._outbox.extend(bufs)
        for b in bufs:
            self._outbox_bytes += len(b)
        self._wakeup.set()

    async def send_and_wait(self, event: wire.Event) -> None:
        """Queue a frame, waiting first if the outbox is over its limit."""
        while self._outbox_bytes > self.limits.max_outbox_bytes and not self.closed:
            await self._drained.wait()
        self.send(event)

    def backlogged(self) -> bool:
        return self._outbox_bytes > self.limits.max_outbox_bytes and not self.closed

    async def drained(self) -> None:
        """Wait until the outbox is back under its limit (or the connection closed)."""
        while self.backlogged():
            await self._drained.wait()

    async def writer(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
            self._sending = True
            while self._outbox and not self.closed:
                bufs, self._outbox, self._outbox_bytes = self._outbox, [], 0
                await self._send_buffers(bufs)
                # Let go of what was sent at once: a payload may be a leased
                # mapping of a cache file that another process waits to write.
                del bufs
            self._sending = False
            self._drained.set()
            self._drained = trio.Event()

    async def flush(self) -> None:
        """Wait until everything queued so far has been written."""
        while (self._outbox or self._sending) and not self.closed:
            await self._drained.wait()

    async def _send_buffers(self, bufs: list[wire.Payload]) -> None:
        if self.sock is None:
            try:
                for buf in bufs:
                    await self.stream.send_all(buf)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                log.debug("send to %s failed: %s", self.peer, exc)
                self.closed = True
            return
        views = [memoryview(b).cast("B") for b in bufs]
        while views:
            batch = views[:IOV_BATCH]
            try:
                sent = await self.sock.sendmsg(batch)
            except (OSError, trio.ClosedResourceError) as exc:
                # Reader and callers notice through ``closed`` and the socket.
                log.debug("send to %s failed: %s", self.peer, exc)
                self.closed = True
                self.sock.close()  # wakes a reader blocked on this socket
                return
            while sent:
                first = views[0]
                if sent >= len(first):
                    sent -= len(first)
                    views.pop(0)
                else:
                    views[0] = first[sent:]
                    sent = 0

    # -- receiving

    async def receive_event(self) -> wire.Event:
        """The next frame.

        Raises:
            ConnectionLost: the peer closed the stream.
            ProtocolError, FrameTooLarge: the peer sent garbage.
        """
        decoder = self.decoder
        while True:
            event = decoder.next_event()
            if event is not None:
                self.last_activity = time.monotonic()
                return event
            if decoder.wanted:
                assert self.budget is not None  # only a budgeted decoder defers
                await self.budget.acquire(self, decoder.wanted)
                decoder.accept_payload()
                continue
            if self.sock is None:
                try:
                    data = await self.stream.receive_some(self._recv_size)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    reason = exc.__cause__ or exc  # the SSL error (a refused certificate) behind it
                    raise ConnectionLost(f"{self.peer}: TLS stream failed: {reason}") from None
                if not data:
                    raise ConnectionLost(f"{self.peer} closed the connection")
                decoder.receive_data(data)
                continue
            buf = decoder.get_buffer()
            try:
                n = await self.sock.recv_into(buf)
            except (OSError, trio.ClosedResourceError) as exc:
                raise ConnectionLost(f"{self.peer}: {exc}") from None
            if n == 0:
                raise ConnectionLost(f"{self.peer} closed the connection")
            decoder.buffer_updated(n)

    def sock_close(self) -> None:
        """Close the socket now; the reader and writer tasks notice and end."""
        self.closed = True
        self._wakeup.set()
        self._drained.set()
        raw = self.stream if isinstance(self.stream, trio.SocketStream) else self.stream.transport_stream
        raw.socket.close()

    async def close(self) -> None:
        self.closed = True
        self._wakeup.set()
        self._drained.set()
        with trio.move_on_after(1) as scope:
            scope.shield = True
            try:
                await self.stream.aclose()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                # TLS sends close_notify, on a socket sock_close() may have closed.
                raw = self.stream.transport_stream if isinstance(self.stream, trio.SSLStream) else self.stream
                raw.socket.close()


async def _flush_and_close(conn: Connection, event: wire.Event | None = None) -> None:
    """Best effort: send a last frame (an error) through the outbox, behind
    what is queued (its MAC counts on that order), then close. The
    connection's writer task must be running."""
    with trio.move_on_after(1):
        if event is not None:
            try:
                conn.send(event)
                await conn.flush()
            except ConnectionLost:
                pass
    await conn.close()


# ---------------------------------------------------------------- server

class RpcServer:
    """Serves the ``@rpc_method`` handlers of one or more service objects."""

    def __init__(self, *services: Any, name: str, secret: bytes | None,
                 limits: Limits = Limits(), methods: dict[str, Method] | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        if isinstance(secret, Credential):
            raise TypeError("a server verifies credentials: it needs the cluster secret, not a credential")
        self.name = name
        self.secret = secret
        self.tls = tls
        self.limits = limits
        self.methods = methods if methods is not None else collect_methods(*services)
        self.started = time.monotonic()
        if "health" not in self.methods:
            self.methods["health"] = Method("health", self._health, roles=ANYONE)
        self.port: int | None = None
        self._listen_scope: trio.CancelScope | None = None
        self._conn_scope: trio.CancelScope | None = None
        self.conn_nursery: trio.Nursery | None = None  # one task per connection
        self._draining = False
        self._inflight = 0
        self._idle = trio.Event()
        self._idle.set()
        self.connections: set[Connection] = set()
        # Connections still in the handshake, oldest first, with the scope
        # that ends the handshake (eviction cancels it).
        self._pending: dict[Connection, trio.CancelScope] = {}
        self._budget = _Budget(limits)
        self._refusals = _RateLimitedLog(log, 10.0)

    def _health(self) -> dict[str, Any]:
        """Built into every server: what `cachefs health` and healthchecks ask."""
        return {"service": self.name, "uptime_s": round(time.monotonic() - self.started, 3),
                "connections": len(self.connections), "inflight": self._inflight,
                "pending": len(self._pending), "inflight_bytes": self._budget.used,
                "draining": self._draining}

    def add_service(self, service: Any) -> None:
        """Register more handlers (e.g. Raft's) before serving."""
        for name, method in collect_methods(service).items():
            if name in self.methods:
                raise ValueError(f"RPC method {name!r} defined twice")
            self.methods[name] = method

    async def serve(self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until cancelled or :meth:`shutdown` finishes."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        self.port = listeners[0].socket.getsockname()[1]
        log.info("%s listening on %s:%d%s", self.name, host, self.port, " (TLS)" if self.tls else "")
        if self.tls is not None:
            listeners = [trio.SSLListener(lst, self.tls, https_compatible=False) for lst in listeners]
        async with trio.open_nursery() as conn_nursery:
            self.conn_nursery = conn_nursery
            self._conn_scope = conn_nursery.cancel_scope
            with trio.CancelScope() as self._listen_scope:
                task_status.started(self.port)
                await trio.serve_listeners(
                    functools.partial(self._serve_connection, conn_nursery=conn_nursery),
                    listeners, handler_nursery=conn_nursery)
            # Listening stopped (shutdown); connections finish in shutdown().
            await trio.sleep_forever()

    async def shutdown(self, grace: float = 5.0) -> None:
        """Stop accepting, let calls in flight finish up to ``grace`` seconds."""
        self._draining = True
        if self._listen_scope is not None:
            self._listen_scope.cancel()
        with trio.move_on_after(grace):
            await self._idle.wait()
            for conn in list(self.connections):
                await conn.flush()  # the last replies reach their callers
        if self._conn_scope is not None:
            self._conn_scope.cancel()

    async def _serve_connection(self, stream: trio.SocketStream | trio.SSLStream, *,
                                conn_nursery: trio.Nursery) -> None:
        raw = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
        try:
            host, port = raw.socket.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            raw.socket.close()
            return
        conn = Connection(stream, peer, self.limits, budget=self._budget)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(conn.writer)
                try:
                    if await self._handshake(conn):
                        await self._read_requests(conn, nursery)
                except (FrameTooLarge, ProtocolError) as exc:
                    log.warning("%s: closing connection from %s: %s", self.name, peer, exc.message)
                    await _flush_and_close(conn, wire.ErrorReply(0, exc.code, exc.message))
                except ConnectionLost:
                    pass
                nursery.cancel_scope.cancel()
        finally:
            self.connections.discard(conn)
            self._budget.release(conn, conn.inflight_bytes)  # a payload cut off mid-frame
            await conn.close()

    def _admit(self, conn: Connection) -> trio.CancelScope:
        """Register a connection that starts its handshake, evicting the
        oldest one of the same peer, or else of the server, over the limits."""
        same_peer = [c for c in self._pending if c.peer_host == conn.peer_host]
        if len(same_peer) >= self.limits.max_pending_per_peer:
            self._evict(same_peer[0], "pending_per_peer")
        elif len(self._pending) >= self.limits.max_pending:
            self._evict(next(iter(self._pending)), "pending")
        scope = trio.CancelScope(deadline=trio.current_time() + self.limits.handshake_timeout)
        self._pending[conn] = scope
        return scope

    def _evict(self, conn: Connection, reason: str) -> None:
        self._pending.pop(conn).cancel()
        metrics.refused_connection(self.name, reason)
        self._refusals.warning("%s: too many connections still in the handshake (%s); dropped the oldest, "
                               "from %s", self.name, reason, conn.peer)

    async def _handshake(self, conn: Connection) -> bool:
        """Authenticate the peer (within the handshake deadline, TLS included)."""
        scope = self._admit(conn)
        try:
            with scope:
                admitted, macs = await self._authenticate(conn)
                if admitted:
                    conn.authenticated(macs)  # so a refusal below is sealed like any frame
                    if len(self.connections) >= self.limits.max_connections:
                        metrics.refused_connection(self.name, "connections")
                        self._refusals.warning("%s: refusing %s: %d connections open", self.name,
                                               conn.peer, len(self.connections))
                        await _flush_and_close(conn, wire.ErrorReply(
                            0, Busy.code, f"{self.name} has {len(self.connections)} connections open"))
                        return False
                    self.connections.add(conn)
                    return True
                return False
        finally:
            self._pending.pop(conn, None)
        if scope.cancelled_caught and trio.current_time() >= scope.deadline:
            metrics.refused_connection(self.name, "handshake_timeout")
            self._refusals.warning("%s: %s sent no handshake within %.1fs", self.name, conn.peer,
                                   self.limits.handshake_timeout)
        return False

    async def _authenticate(self, conn: Connection) -> tuple[bool, tuple[bytes, bytes] | None]:
        """Check the peer's credential and set ``conn.identity``: whether it
        got in, and the (send, receive) frame MAC keys."""
        nonce = os.urandom(wire.NONCE_SIZE)
        conn.send(wire.Hello(wire.PROTOCOL_VERSION, nonce, self.secret is not None))
        event = await conn.receive_event()
        if not isinstance(event, wire.Auth):
            raise ProtocolError(f"expected the handshake, got {type(event).__name__}")
        if self.secret is None:
            conn.send(wire.Welcome(b""))
            return True, None
        try:
            identity = parse_key_id(event.key_id)
        except AuthFailed as exc:
            self._refusals.warning("%s: authentication failed from %s: %s", self.name, conn.peer, exc.message)
            await _flush_and_close(conn, wire.ErrorReply(0, AuthFailed.code, "authentication failed"))
            return False, None
        key = derive_key(self.secret, event.key_id)
        if not wire.proofs_match(wire.client_proof(key, nonce, event.nonce, event.key_id), event.proof):
            self._refusals.warning("%s: authentication failed from %s (wrong cluster secret or credential?)",
                                   self.name, conn.peer)
            await _flush_and_close(conn, wire.ErrorReply(0, AuthFailed.code, "authentication failed"))
            return False, None
        conn.send(wire.Welcome(wire.server_proof(key, nonce, event.nonce)))
        conn.identity = identity
        c2s, s2c = wire.frame_keys(key, nonce, event.nonce)
        return True, (s2c, c2s)

    async def _read_requests(self, conn: Connection, nursery: trio.Nursery) -> None:
        inflight = 0
        idle = self.limits.idle_timeout
        # The idle clock runs only while nothing is in flight on this connection.
        idle_scope = trio.CancelScope(deadline=trio.current_time() + idle)

        budget = self._budget

        def done(payload_bytes: int) -> None:
            nonlocal inflight
            budget.release(conn, payload_bytes)
            inflight -= 1
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
            if inflight == 0:
                idle_scope.deadline = trio.current_time() + idle

        with idle_scope:
            while True:
                event = await conn.receive_event()
                if not isinstance(event, wire.Request):
                    raise ProtocolError(f"expected a request, got {type(event).__name__}")
                payload_bytes = len(event.payload) if event.payload is not None else 0
                if self._draining:
                    budget.release(conn, payload_bytes)
                    conn.send(wire.ErrorReply(event.call_id, Unavailable.code, f"{self.name} is shutting down"))
                    continue
                if inflight >= self.limits.max_inflight:
                    budget.release(conn, payload_bytes)
                    conn.send(wire.ErrorReply(event.call_id, Busy.code,
                                              f"more than {self.limits.max_inflight} calls in flight on one connection"))
                    continue
                pending = None
                method = self.methods.get(event.method)
                if method is not None and method.inline:
                    pending = self._call_inline(conn, event, method)
                    if pending is None:
                        budget.release(conn, payload_bytes)
                        if inflight == 0:
                            idle_scope.deadline = trio.current_time() + idle
                        if conn.backlogged():  # replies pile up: stop reading for a while
                            await conn.drained()
                        continue
                inflight += 1
                self._inflight += 1
                idle_scope.deadline = math.inf
                self._idle = trio.Event() if self._idle.is_set() else self._idle
                nursery.start_soon(self._run_call, conn, event, done, pending)
                if conn.backlogged():
                    await conn.drained()
        log.info("%s: closing idle connection from %s", self.name, conn.peer)

    def _call_inline(self, conn: Connection, req: wire.Request, method: Method) -> Awaitable[Any] | None:
        """Run a plain handler in the reader; its awaitable if it returned one."""
        started = time.perf_counter()
        code = "OK"
        try:
            result = method.fn(**self._kwargs(conn, req, method))
            if inspect.isawaitable(result):
                return result
            reply: wire.Event = self._response(req, result)
        except Exception as exc:
            code, reply = self._failure(req, exc)
        try:
            conn.send(reply)
        except TypeError:
            code = "EIO"
            log.error("%s: %s returned a value msgpack cannot encode", self.name, req.method)
            conn.send(wire.ErrorReply(req.call_id, "EIO", f"unencodable result from {req.method}"))
        except ConnectionLost:
            pass
        metrics.observe_call(self.name, req.method, code, time.perf_counter() - started,
                             len(req.payload or b""))
        return None

    async def _run_call(self, conn: Connection, req: wire.Request, done: Callable[[int], None],
                        pending: Awaitable[Any] | None = None) -> None:
        started = time.perf_counter()
        code = "OK"
        try:
            try:
                reply = await self._dispatch(conn, req, pending)
            except Exception as exc:
                code, reply = self._failure(req, exc)
            try:
                await conn.send_and_wait(reply)
            except TypeError:
                code = "EIO"
                log.error("%s: %s returned a value msgpack cannot encode", self.name, req.method)
                await conn.send_and_wait(wire.ErrorReply(req.call_id, "EIO", f"unencodable result from {req.method}"))
            except ConnectionLost:
                pass
        finally:
            if inspect.iscoroutine(pending) and inspect.getcoroutinestate(pending) == inspect.CORO_CREATED:
                pending.close()  # cancelled before it could start: never awaited
            done(len(req.payload) if req.payload is not None else 0)
            metrics.observe_call(self.name, req.method if req.method in self.methods else "<unknown>",
                                 code, time.perf_counter() - started,
                                 len(req.payload or b""))

    def _failure(self, req: wire.Request, exc: Exception) -> tuple[str, wire.ErrorReply]:
        """The metrics code and error reply for a handler that raised: its typed
        error as it is, anything else (a bug) logged and answered as EIO."""
        if isinstance(exc, CacheFSError):
            return exc.code, wire.ErrorReply(req.call_id, exc.code, exc.message, _wire_details(exc.details))
        log.error("%s: handler %s failed", self.name, req.method, exc_info=exc)
        return "EIO", wire.ErrorReply(req.call_id, "EIO", f"internal error in {req.method}")

    def _kwargs(self, conn: Connection, req: wire.Request, method: Method) -> dict[str, Any]:
        method.admit(conn.identity, req.args)
        kwargs = req.args  # decoded for this call alone: no copy needed
        if method.wants_payload:
            kwargs["payload"] = req.payload
        elif req.payload:
            raise InvalidArgument(f"{req.method} takes no payload")
        if method.wants_identity:
            kwargs["identity"] = conn.identity
        if method.wants_ctx:
            kwargs["ctx"] = CallContext(conn.peer, conn.conn_id, trio.current_time() + self._timeout(req),
                                        conn.identity)
        return kwargs

    def _timeout(self, req: wire.Request) -> float:
        return req.timeout_ms / 1000 if req.timeout_ms else self.limits.idle_timeout

    @staticmethod
    def _response(req: wire.Request, result: Any) -> wire.Response:
        if isinstance(result, Reply):
            return wire.Response(req.call_id, result.result, result.payload)
        return wire.Response(req.call_id, result)

    async def _dispatch(self, conn: Connection, req: wire.Request,
                        pending: Awaitable[Any] | None = None) -> wire.Event:
        """Run the handler (or the awaitable an inline one returned) under the
        caller's deadline."""
        timeout = self._timeout(req)
        if pending is None:
            method = self.methods.get(req.method)
            if method is None:
                raise NoSuchMethod(f"{self.name} has no method {req.method!r}")
            pending = method.fn(**self._kwargs(conn, req, method))
        with trio.CancelScope(deadline=trio.current_time() + timeout) as scope:
            result = await pending
        if scope.cancelled_caught:
            raise TimedOut(f"{req.method} passed its deadline of {timeout:.3f}s on {self.name}")
        return self._response(req, result)


def _wire_details(details: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in details.items() if isinstance(v, str | int | float | bool | bytes | None)}


# ---------------------------------------------------------------- client

class _Slot:
    __slots__ = ("event", "into", "prefix", "reply")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.reply: wire.Event | CacheFSError | None = None
        self.into: memoryview | None = None  # where the reply's payload should land (call's ``into``)
        self.prefix = False  # ``into`` is a scratch: a shorter payload lands in its first bytes


class ClientConnection:
    """The calling side of one connection; many calls in flight."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._ids = itertools.count(1)
        self._slots: dict[int, _Slot] = {}
        self._limit = trio.Semaphore(conn.limits.max_inflight)
        self.calls: OpStats | None = None  # the pool's, when it times its calls
        conn.decoder.payload_sink = self._payload_sink

    def _payload_sink(self, call_id: int, size: int) -> memoryview | None:
        """The caller's buffer for this reply's payload, if it gave one of
        that size (or a scratch at least that large: its first bytes)."""
        slot = self._slots.get(call_id)
        if slot is None or slot.into is None:
            return None
        into = slot.into
        if len(into) == size:
            return into
        if slot.prefix and len(into) > size:
            return into[:size]
        return None

    @classmethod
    async def connect(cls, addr: str, *, credential: Credential | None, limits: Limits,
                      nursery: trio.Nursery, tls: ssl.SSLContext | None = None) -> ClientConnection:
        """Open and authenticate a connection whose tasks live in ``nursery``.

        Raises:
            Unreachable: nothing listens there. AuthFailed: credential refused.
            TimedOut: no handshake in time.
        """
        host, port = parse_addr(addr)
        try:
            with trio.fail_after(limits.connect_timeout):
                stream = await trio.open_tcp_stream(host, port)
        except trio.TooSlowError:
            raise TimedOut(f"connecting to {addr} took over {limits.connect_timeout}s") from None
        except OSError as exc:
            raise Unreachable(f"cannot connect to {addr}: {exc.strerror or exc}") from None
        if tls is not None:
            stream = trio.SSLStream(stream, tls, server_hostname=host, https_compatible=False)
            try:
                with trio.fail_after(limits.handshake_timeout):
                    await stream.do_handshake()
            except (trio.BrokenResourceError, trio.TooSlowError) as exc:
                await stream.aclose()
                cause = exc.__cause__ or exc
                raise AuthFailed(f"TLS handshake with {addr} failed: {cause}") from None
        conn = Connection(stream, addr, limits)
        try:
            with trio.fail_after(limits.handshake_timeout):
                await cls._handshake(conn, credential)
        except trio.TooSlowError:
            await conn.close()
            raise TimedOut(f"{addr} did not finish the handshake in time") from None
        except BaseException:
            await conn.close()
            raise
        client = cls(conn)
        nursery.start_soon(client._run)
        return client

    @staticmethod
    async def _handshake(conn: Connection, credential: Credential | None) -> None:
        hello = await conn.receive_event()
        if isinstance(hello, wire.ErrorReply):
            raise error_from_wire(hello.code, hello.message, hello.details)
        if not isinstance(hello, wire.Hello):
            raise ProtocolError(f"{conn.peer} did not start with a handshake")
        if hello.version != wire.PROTOCOL_VERSION:
            raise ProtocolError(f"{conn.peer} speaks protocol version {hello.version}, "
                                f"this side {wire.PROTOCOL_VERSION}")
        if hello.auth_required and credential is None:
            raise AuthFailed(f"{conn.peer} requires the cluster secret or a credential, and none is configured")
        if not hello.auth_required and credential is not None:
            raise AuthFailed(f"{conn.peer} runs without authentication but this side has a secret")
        nonce = os.urandom(wire.NONCE_SIZE)
        if credential is None:
            auth = wire.Auth(nonce, "", b"")
        else:
            auth = wire.Auth(nonce, credential.key_id,
                             wire.client_proof(credential.key, hello.nonce, nonce, credential.key_id))
        for buf in wire.encode(auth):
            await conn.stream.send_all(buf)
        answer = await conn.receive_event()
        if isinstance(answer, wire.ErrorReply):
            raise error_from_wire(answer.code, answer.message, answer.details)
        if not isinstance(answer, wire.Welcome):
            raise ProtocolError(f"{conn.peer} answered the handshake with {type(answer).__name__}")
        if credential is None:
            conn.authenticated()
            return
        if not wire.proofs_match(wire.server_proof(credential.key, hello.nonce, nonce), answer.proof):
            raise AuthFailed(f"{conn.peer} could not prove knowledge of the cluster secret")
        conn.authenticated(wire.frame_keys(credential.key, hello.nonce, nonce))

    async def _run(self) -> None:
        conn = self.conn
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(conn.writer)
                try:
                    while True:
                        event = await conn.receive_event()
                        call_id = getattr(event, "call_id", None)
                        if call_id == 0 and isinstance(event, wire.ErrorReply):
                            raise error_from_wire(event.code, event.message, event.details)
                        slot = self._slots.pop(call_id, None) if call_id is not None else None
                        if slot is not None:  # else: a reply to a call that timed out
                            slot.reply = event
                            slot.event.set()
                except (ConnectionLost, ProtocolError, FrameTooLarge) as exc:
                    self._fail_all(exc)
                except CacheFSError as exc:
                    self._fail_all(exc)
                nursery.cancel_scope.cancel()
        finally:
            self._fail_all(ConnectionLost(f"connection to {conn.peer} closed"))
            await conn.close()

    def _fail_all(self, exc: CacheFSError) -> None:
        self.conn.closed = True
        slots, self._slots = self._slots, {}
        for slot in slots.values():
            slot.reply = exc
            slot.event.set()

    @property
    def closed(self) -> bool:
        return self.conn.closed

    async def call(self, method: str, args: dict[str, Any] | None = None, *,
                   payload: wire.Payload | None = None, timeout: float = 30.0,
                   into: memoryview | None = None, scratch: memoryview | None = None) -> Reply:
        """One call. Raises the typed error the peer sent, or TimedOut.

        ``into``: a writable buffer the reply's payload is received into
        when it has exactly that size (the reply's payload is then ``into``
        itself; else a buffer of its own). ``scratch``: one that may be
        larger; a payload that fits lands in its first bytes (the reply's
        payload is then a view of them), for a caller that copies it out and
        uses the scratch again. A call that fails or is cancelled may leave
        bytes of a late reply in either, or write them later: use it only
        after success, and never lend it to another call after a failure.
        """
        if into is not None and scratch is not None:
            raise ValueError("a call takes into or scratch, not both")
        # A free slot is taken without the scheduler round trip that
        # ``async with Semaphore`` makes; the call still yields (it waits
        # for the reply), so it stays a checkpoint.
        try:
            self._limit.acquire_nowait()
        except trio.WouldBlock:
            await self._limit.acquire()
        try:
            call_id = next(self._ids)
            slot = _Slot()
            if scratch is not None:
                slot.into, slot.prefix = scratch, True
            else:
                slot.into = into
            self._slots[call_id] = slot
            # A bare CancelScope: trio.fail_after's context manager costs
            # more than the rest of a small call.
            sent_at = time.monotonic()
            try:
                with trio.CancelScope(deadline=trio.current_time() + timeout) as scope:
                    await self.conn.send_and_wait(
                        wire.Request(call_id, method, args or {}, max(1, int(timeout * 1000)), payload))
                    await slot.event.wait()
            finally:
                self._slots.pop(call_id, None)  # a late reply is dropped
                # Nor does the slot keep the caller's buffer: a slot can outlive
                # the call (in a finished task's frame, until the cycle collector
                # runs), and its view would keep a pool from reusing the buffer.
                slot.into = None
                if self.calls is not None:
                    self.calls.observe(method, time.monotonic() - sent_at)
            if scope.cancelled_caught:
                if self.conn.last_activity < sent_at and not self.conn.closed:
                    # Not a byte from the peer during the whole wait: treat the
                    # connection as dead (cut link, frozen peer) so the next
                    # call reconnects instead of queueing behind it.
                    log.info("closing silent connection to %s after %s timed out", self.conn.peer, method)
                    self._fail_all(ConnectionLost(f"{self.conn.peer} went silent"))
                    self.conn.sock_close()
                raise TimedOut(f"{method} to {self.conn.peer} passed its deadline of {timeout}s")
        finally:
            self._limit.release()
        reply = slot.reply
        if isinstance(reply, wire.Response):
            return Reply(reply.result, reply.payload)
        if isinstance(reply, wire.ErrorReply):
            raise error_from_wire(reply.code, reply.message, reply.details)
        if isinstance(reply, CacheFSError):
            raise type(reply)(reply.message, remote=reply.remote, **reply.details)
        raise ProtocolError(f"{self.conn.peer} answered {method} with {type(reply).__name__}")

    async def aclose(self) -> None:
        await self.conn.close()


class RpcPool:
    """One connection per peer address, reconnected on demand with back-off.

    Use as ``async with RpcPool(secret=...) as pool``; the pool's nursery owns
    the connections' tasks. A broken connection is noticed by its reader
    (the peer's FIN or RST) and replaced on the next call; calls are never
    retried here, since only the caller knows what is idempotent.
    """

    def __init__(self, *, secret: Secret | None, limits: Limits = Limits(),
                 backoff_initial: float = 0.05, backoff_max: float = 2.0,
                 tls: ssl.SSLContext | None = None) -> None:
        self.credential = as_credential(secret)
        self.tls = tls
        self.limits = limits
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self._conns: dict[str, ClientConnection] = {}
        self._connecting: dict[str, trio.Lock] = {}
        self._backoff: dict[str, tuple[float, float]] = {}  # addr -> (retry_at, delay)
        self._nursery: trio.Nursery | None = None
        # Round trip of every call by method, once someone asks (the mount's
        # metrics and `cachefs stats`): see time_calls.
        self.calls: OpStats | None = None
        self._allocate: Callable[[int], bytearray] = bytearray

    def allocate_payloads(self, allocate: Callable[[int], bytearray]) -> None:
        """Receive every reply's payload (without a call's ``into``) into
        ``allocate(size)``, on every connection from now on (a mount's pool
        of block buffers)."""
        self._allocate = allocate
        for conn in self._conns.values():
            conn.conn.decoder.allocate = allocate

    def time_calls(self) -> OpStats:
        """Time every call from now on, on every connection (a few hundred ns per call)."""
        if self.calls is None:
            self.calls = OpStats()
            for conn in self._conns.values():
                conn.calls = self.calls
        return self.calls

    async def __aenter__(self) -> RpcPool:
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()
        # The body's exception is not the nursery's business: handing it over
        # would wrap it in an ExceptionGroup, and callers want the typed error.
        await self._nursery_cm.__aexit__(None, None, None)
        return False

    def live(self, addr: str) -> ClientConnection | None:
        """The open connection to ``addr``, or None if a call would have to connect."""
        conn = self._conns.get(addr)
        return conn if conn is not None and not conn.closed else None

    async def connection(self, addr: str) -> ClientConnection:
        conn = self._conns.get(addr)
        if conn is not None and not conn.closed:
            return conn
        lock = self._connecting.setdefault(addr, trio.Lock())
        async with lock:
            conn = self._conns.get(addr)
            if conn is not None and not conn.closed:
                return conn
            retry_at, delay = self._backoff.get(addr, (0.0, 0.0))
            now = trio.current_time()
            if now < retry_at:
                raise Unreachable(f"{addr} is unreachable (retrying in {retry_at - now:.2f}s)")
            if self._nursery is None:
                raise RuntimeError("RpcPool used outside 'async with'")
            try:
                conn = await ClientConnection.connect(addr, credential=self.credential, limits=self.limits,
                                                      nursery=self._nursery, tls=self.tls)
            except (Unreachable, TimedOut):
                delay = min(self.backoff_max, max(self.backoff_initial, delay * 2))
                self._backoff[addr] = (trio.current_time() + delay, delay)
                raise
            self._backoff.pop(addr, None)
            conn.calls = self.calls
            conn.conn.decoder.allocate = self._allocate
            self._conns[addr] = conn
            return conn

    async def call(self, addr: str, method: str, args: dict[str, Any] | None = None, *,
                   payload: wire.Payload | None = None, timeout: float = 30.0,
                   into: memoryview | None = None, scratch: memoryview | None = None) -> Reply:
        """One call to ``addr``; connecting counts against ``timeout`` too
        (``into`` and ``scratch``: see :meth:`ClientConnection.call`)."""
        deadline = trio.current_time() + timeout
        conn = await self.connection(addr)
        remaining = deadline - trio.current_time()
        if remaining <= 0:
            raise TimedOut(f"{method} to {addr} passed its deadline of {timeout}s while connecting")
        return await conn.call(method, args, payload=payload, timeout=remaining, into=into, scratch=scratch)

    def forget(self, addr: str) -> None:
        """Drop the connection to ``addr`` (e.g. after the peer restarted)."""
        self._conns.pop(addr, None)


# ---------------------------------------------------------------- TLS

def server_tls(cert_file: str, key_file: str, client_ca_file: str | None = None) -> ssl.SSLContext:
    """A server context; with ``client_ca_file`` clients must show a certificate too."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        ctx.load_verify_locations(client_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_tls(ca_file: str, cert_file: str | None = None, key_file: str | None = None) -> ssl.SSLContext:
    """A client context that trusts only ``ca_file`` (the cluster's own CA)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    if cert_file:
        ctx.load_cert_chain(cert_file, key_file)
    return ctx
