"""Credentials, roles and frame MACs: who gets in, what each role may call,
and that traffic cannot be changed, replayed or reordered on the way."""

from __future__ import annotations

import pytest
import trio

from cachefs import wire
from cachefs.credentials import ADMINS, ANYONE, CLIENTS, Credential, parse_key_id
from cachefs.errors import (
    AuthFailed,
    ConnectionLost,
    InvalidArgument,
    PermissionDenied,
    ProtocolError,
)
from cachefs.rpc import CallContext, RpcPool, rpc_method

from .conftest import SECRET, EchoService, start_server
from .rawpeer import RawPeer


class Guarded:
    """One method per role set, each counting the calls that reached it."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    @rpc_method
    def servers_only(self) -> str:
        self.ran.append("servers_only")
        return "ok"

    @rpc_method(roles=ADMINS)
    def admins(self) -> str:
        self.ran.append("admins")
        return "ok"

    @rpc_method(roles=CLIENTS)
    def read(self, volume: str, ctx: CallContext) -> list:
        self.ran.append("read")
        return [ctx.identity.role, ctx.identity.name, sorted(ctx.identity.volumes or [])]

    @rpc_method(roles=ANYONE)
    async def whoami(self, ctx: CallContext) -> str:
        return str(ctx.identity)


def client(name="job", volumes=("train",)) -> Credential:
    return Credential.issue(SECRET, "client", name, volumes)


async def test_each_role_reaches_only_its_methods(nursery):
    service = Guarded()
    _, addr = await start_server(nursery, service=service)
    admin = Credential.issue(SECRET, "admin", "ops")
    async with RpcPool(secret=client()) as c, RpcPool(secret=admin) as a, RpcPool(secret=SECRET) as s:
        assert (await c.call(addr, "read", {"volume": "train"})).result == ["client", "job", ["train"]]
        assert (await c.call(addr, "whoami")).result == "client 'job'"
        assert (await c.call(addr, "health")).result["service"] == "test"
        for method in ("servers_only", "admins"):
            with pytest.raises(PermissionDenied, match=f"{method} is not allowed for client 'job'"):
                await c.call(addr, method)
        assert (await a.call(addr, "admins")).result == "ok"
        assert (await a.call(addr, "read", {"volume": "any"})).result == ["admin", "ops", []]
        with pytest.raises(PermissionDenied, match="needs server"):
            await a.call(addr, "servers_only")
        assert (await s.call(addr, "servers_only")).result == "ok"  # the cluster secret: a server
        assert (await s.call(addr, "whoami")).result == "server 'cluster'"
    assert service.ran == ["read", "admins", "read", "servers_only"]  # no refused call ran


async def test_a_client_reaches_only_its_own_volumes(nursery):
    service = Guarded()
    _, addr = await start_server(nursery, service=service)
    async with RpcPool(secret=client(volumes=("train", "eval"))) as pool:
        assert (await pool.call(addr, "read", {"volume": "eval"})).result[2] == ["eval", "train"]
        with pytest.raises(PermissionDenied, match="no credential for volume 'other'"):
            await pool.call(addr, "read", {"volume": "other"})
    assert service.ran == ["read"]


@pytest.mark.allow_log("cachefs.rpc", match=r"authentication failed")
async def test_a_credential_cannot_be_widened_or_forged(nursery):
    """The key id is the MAC's input: the same key with more volumes, another
    role, or a key made up does not get in."""
    _, addr = await start_server(nursery)
    mine = client(volumes=("train",))
    for forged in (Credential("client:job:other,train", mine.key), Credential("admin:job", mine.key),
                   Credential("client:job:train", bytes(32))):
        async with RpcPool(secret=forged) as pool:
            with pytest.raises(AuthFailed, match="authentication failed"):
                await pool.call(addr, "health")
    peer = await RawPeer.connect(addr)
    answer = await peer.login(Credential("root", mine.key))  # not a key id at all
    assert isinstance(answer, wire.ErrorReply) and answer.code == "EAUTH"
    await peer.aclose()


def test_key_ids_are_canonical_and_checked():
    assert Credential.issue(SECRET, "client", "a", ["v2", "v1", "v1"]).key_id == "client:a:v1,v2"
    assert parse_key_id("client:a:v1,v2").volumes == {"v1", "v2"}
    assert parse_key_id("server:metanode-3").metanode_id == 3
    assert parse_key_id("server:datanode-3").metanode_id is None
    for bad in ("client:a", "client:a:v2,v1", "admin:a:v1", "nobody:a", "server:", "server:a b", ""):
        with pytest.raises(AuthFailed):
            parse_key_id(bad)
    with pytest.raises(InvalidArgument, match="needs at least one volume"):
        Credential.issue(SECRET, "client", "a")
    with pytest.raises(InvalidArgument, match="not a cachefs credential"):
        Credential.from_json('{"key_id": "client:a:v"}')
    cred = Credential.issue(SECRET, "admin", "ops")
    assert Credential.from_json(cred.to_json()) == cred and cred.key.hex() not in repr(cred)


# ---------------------------------------------------------------- frame MACs

class Proxy:
    """A TCP relay between a client and the server that can rewrite what the
    client sends once the handshake frame (the first one) has passed."""

    def __init__(self, upstream: str, rewrite) -> None:
        self.upstream = upstream
        self.rewrite = rewrite

    async def serve(self, nursery) -> str:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        nursery.start_soon(trio.serve_listeners, self._relay, listeners)
        return f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"

    async def _relay(self, down: trio.SocketStream) -> None:
        host, port = self.upstream.rsplit(":", 1)
        up = await trio.open_tcp_stream(host, int(port))

        async def pump(src, dst, rewrite) -> None:
            buf, first = b"", None  # held client bytes; the handshake frame's size
            try:
                while data := await src.receive_some(65536):
                    if rewrite is None:
                        await dst.send_all(data)
                        continue
                    buf += data
                    if first is None and len(buf) >= wire.PREFIX.size:
                        first = wire.PREFIX.size + wire.PREFIX.unpack_from(buf)[0]
                    if first is None or len(buf) < first:
                        continue
                    await dst.send_all(buf[:first])  # the handshake passes as it is
                    rest, buf, first = buf[first:], b"", 0
                    if rest:  # the first frame after it: rewritten, once
                        await dst.send_all(rewrite(rest))
                        rewrite = None
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                await dst.aclose()

        async with trio.open_nursery() as n:
            n.start_soon(pump, down, up, self.rewrite)
            n.start_soon(pump, up, down, None)


async def _through_proxy(nursery, rewrite, value):
    service = EchoService()
    _, addr = await start_server(nursery, service=service)
    proxied = await Proxy(addr, rewrite).serve(nursery)
    async with RpcPool(secret=SECRET) as pool:
        try:
            return (await pool.call(proxied, "echo", {"value": value}, timeout=5)).result, service
        except (ConnectionLost, ProtocolError) as exc:
            return exc, service


@pytest.mark.allow_log("cachefs.rpc", match=r"frame authentication failed")
async def test_a_changed_frame_is_refused_before_its_handler_runs(nursery):
    # 1111 and 2222 are both uint16 in msgpack: the change keeps the frame well formed.
    result, service = await _through_proxy(
        nursery, lambda b: b.replace(b"\xcd\x04\x57", b"\xcd\x08\xae"), 1111)
    assert isinstance(result, ConnectionLost | ProtocolError), result
    assert service.calls == 0


@pytest.mark.allow_log("cachefs.rpc", match=r"frame authentication failed")
async def test_a_replayed_frame_is_refused(nursery):
    result, service = await _through_proxy(nursery, lambda b: b + b, 1111)
    assert service.calls <= 1  # the copy never reaches the handler


async def test_macs_are_on_only_after_the_handshake_and_over_plain_tcp(nursery):
    _, addr = await start_server(nursery)
    async with RpcPool(secret=SECRET) as pool:
        conn = await pool.connection(addr)
        assert conn.conn.send_mac is not None and conn.conn.decoder.mac is not None
        payload = bytes(range(256)) * 4096
        reply = await pool.call(addr, "echo", {"value": 5}, payload=payload)
        assert bytes(reply.payload) == payload
        assert conn.conn.send_mac.counter == conn.conn.decoder.mac.counter == 1  # the handshake is not counted
