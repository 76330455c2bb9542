"""Round trips, concurrency, deadlines, reconnects and limits over real TCP."""

from __future__ import annotations

import os

import pytest
import trio

from cachefs import wire
from cachefs.credentials import Credential
from cachefs.errors import (
    AuthFailed,
    Busy,
    ConnectionLost,
    InvalidArgument,
    NoSuchMethod,
    NotLeader,
    TimedOut,
    Unavailable,
    Unreachable,
)
from cachefs.rpc import Limits, RpcPool
from cachefs.testing.ports import free_port

from .conftest import SECRET, EchoService, start_server


async def test_small_call_round_trip(nursery):
    _, addr = await start_server(nursery)
    async with RpcPool(secret=SECRET) as pool:
        reply = await pool.call(addr, "echo", {"value": 42})
    assert reply.result == {"value": 42, "size": 0}
    assert reply.payload is None


@pytest.mark.parametrize("size", [1 << 20, 16 << 20])
async def test_bulk_payload_round_trip(nursery, size):
    _, addr = await start_server(nursery)
    data = os.urandom(size)
    async with RpcPool(secret=SECRET) as pool:
        reply = await pool.call(addr, "echo", {"value": "bulk"}, payload=data)
    assert reply.result["size"] == size
    assert bytes(reply.payload) == data


async def test_a_reply_payload_lands_in_the_buffer_the_caller_gave(nursery):
    _, addr = await start_server(nursery)
    data = os.urandom(3 << 20)
    block = bytearray(len(data) + 10)
    async with RpcPool(secret=SECRET) as pool:
        place = memoryview(block)[10:]
        reply = await pool.call(addr, "echo", {"value": "x"}, payload=data, into=place)
        assert reply.payload is place and bytes(block[10:]) == data
        other = bytearray(5)
        reply = await pool.call(addr, "echo", {"value": "y"}, payload=data[:1000], into=memoryview(other))
        assert bytes(reply.payload) == data[:1000] and other == bytes(5)  # not that size: not used


async def test_a_reply_lands_in_the_first_bytes_of_a_larger_scratch(nursery):
    _, addr = await start_server(nursery)
    data = os.urandom(3 << 20)
    scratch = bytearray(b"s" * (4 << 20))
    async with RpcPool(secret=SECRET) as pool:
        reply = await pool.call(addr, "echo", {"value": "x"}, payload=data, scratch=memoryview(scratch))
        assert isinstance(reply.payload, memoryview) and reply.payload.obj is scratch
        assert bytes(reply.payload) == data and scratch[len(data):] == b"s" * (1 << 20)
        big = os.urandom(5 << 20)  # larger than the scratch: a buffer of its own
        reply = await pool.call(addr, "echo", {"value": "y"}, payload=big, scratch=memoryview(scratch))
        assert bytes(reply.payload) == big and scratch[:len(data)] == data
        with pytest.raises(ValueError, match="into or scratch"):
            await pool.call(addr, "echo", {}, into=memoryview(bytearray(1)), scratch=memoryview(scratch))


async def test_thousand_calls_in_flight_on_one_connection(nursery):
    service = EchoService()
    _, addr = await start_server(nursery, service=service)
    results = {}
    async with RpcPool(secret=SECRET) as pool:
        async def one(i):
            results[i] = (await pool.call(addr, "echo", {"value": i}, payload=i.to_bytes(4, "big"))).result

        async with trio.open_nursery() as n:
            for i in range(1000):
                n.start_soon(one, i)
        assert len(pool._conns) == 1
    assert results == {i: {"value": i, "size": 4} for i in range(1000)}
    assert service.calls == 1000


async def test_replies_arrive_out_of_order(nursery):
    _, addr = await start_server(nursery)
    order = []
    async with RpcPool(secret=SECRET) as pool:
        async def one(tag, delay):
            order.append(await pool.call(addr, "sleep", {"seconds": delay, "tag": tag}))

        async with trio.open_nursery() as n:
            n.start_soon(one, 1, 0.3)
            await trio.sleep(0.05)
            n.start_soon(one, 2, 0.0)
    assert [r.result for r in order] == [2, 1]


async def test_deadline_frees_the_slot_and_drops_the_late_reply(nursery):
    _, addr = await start_server(nursery)
    async with RpcPool(secret=SECRET) as pool:
        with pytest.raises(TimedOut):
            await pool.call(addr, "sleep", {"seconds": 0.5}, timeout=0.1)
        conn = await pool.connection(addr)
        assert conn._slots == {}
        await trio.sleep(0.6)  # the late reply arrives and is dropped
        reply = await pool.call(addr, "echo", {"value": 1})
        assert reply.result["value"] == 1
        assert conn is await pool.connection(addr)


@pytest.mark.allow_log("cachefs.rpc", match=r"handler \w+ failed")
async def test_errors_cross_the_wire_typed_with_details(nursery):
    _, addr = await start_server(nursery)
    async with RpcPool(secret=SECRET) as pool:
        with pytest.raises(NotLeader) as info:
            await pool.call(addr, "fail", {"code": "ENOTLEADER"})
        assert info.value.remote and info.value.details["leader"] == "10.0.0.1:1"
        with pytest.raises(NoSuchMethod, match="no method 'nope'"):
            await pool.call(addr, "nope")
        with pytest.raises(InvalidArgument, match="argument 'seconds' must be float"):
            await pool.call(addr, "sleep", {"seconds": "soon"})
        with pytest.raises(InvalidArgument, match="missing argument 'seconds'"):
            await pool.call(addr, "sleep", {})
        with pytest.raises(InvalidArgument, match="unexpected argument 'bogus'"):
            await pool.call(addr, "echo", {"bogus": 1})
        with pytest.raises(InvalidArgument, match="takes no payload"):
            await pool.call(addr, "sleep", {"seconds": 0}, payload=b"x")
        from cachefs.errors import IOFailure
        with pytest.raises(IOFailure, match="internal error in crash"):
            await pool.call(addr, "crash")
        # The connection survived all of it.
        assert (await pool.call(addr, "echo", {"value": 3})).result["value"] == 3


async def test_server_restart_and_client_reconnect():
    async with RpcPool(secret=SECRET, backoff_initial=0.01) as pool:
        async with trio.open_nursery() as n1:
            server, addr = await start_server(n1)
            assert (await pool.call(addr, "echo", {"value": 1})).result["value"] == 1
            n1.cancel_scope.cancel()
        with pytest.raises((Unreachable, ConnectionLost)):
            await pool.call(addr, "echo", {"value": 2})
        port = int(addr.rsplit(":", 1)[1])
        async with trio.open_nursery() as n2:
            await start_server(n2, port=port)
            with trio.fail_after(5):
                while True:
                    try:
                        reply = await pool.call(addr, "echo", {"value": 3})
                        break
                    except (Unreachable, ConnectionLost):
                        await trio.sleep(0.02)
            assert reply.result["value"] == 3
            n2.cancel_scope.cancel()


async def test_graceful_shutdown_finishes_calls_in_flight(nursery):
    server, addr = await start_server(nursery)
    async with RpcPool(secret=SECRET) as pool:
        async with trio.open_nursery() as n:
            results = []

            async def slow():
                results.append((await pool.call(addr, "sleep", {"seconds": 0.3, "tag": 9})).result)

            n.start_soon(slow)
            with trio.fail_after(5):
                while server._inflight == 0:  # the call reached the handler
                    await trio.sleep(0.01)
                await server.shutdown(grace=3.0)
        assert results == [9]
        # New calls are refused once the server is down.
        with pytest.raises((Unreachable, ConnectionLost, Unavailable)):
            await pool.call(addr, "echo", {"value": 1})


async def test_shutdown_grace_bounds_the_wait(nursery):
    server, addr = await start_server(nursery)
    async with RpcPool(secret=SECRET) as pool, trio.open_nursery() as n:
        async def stuck():
            with pytest.raises(ConnectionLost):
                await pool.call(addr, "sleep", {"seconds": 30})

        n.start_soon(stuck)
        while server._inflight == 0:
            await trio.sleep(0.01)
        with trio.fail_after(2):
            await server.shutdown(grace=0.2)


# ---------------------------------------------------------------- auth

@pytest.mark.allow_log("cachefs.rpc", match=r"authentication failed")
async def test_wrong_secret_is_refused(nursery):
    _, addr = await start_server(nursery)
    async with RpcPool(secret=b"wrong") as pool:
        with pytest.raises(AuthFailed, match="authentication failed"):
            await pool.call(addr, "echo")


async def test_missing_or_unexpected_secret_is_refused(nursery):
    _, secure = await start_server(nursery)
    _, insecure = await start_server(nursery, secret=None)
    async with RpcPool(secret=None) as pool:
        with pytest.raises(AuthFailed, match="requires the cluster secret"):
            await pool.call(secure, "echo")
        assert (await pool.call(insecure, "echo", {"value": 1})).result["value"] == 1
    async with RpcPool(secret=SECRET) as pool:
        with pytest.raises(AuthFailed, match="without authentication"):
            await pool.call(insecure, "echo")


async def _raw_connect(addr):
    host, port = addr.rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port))


async def _read_event(stream, decoder=None):
    decoder = decoder or wire.FrameDecoder()
    while (event := decoder.next_event()) is None:
        data = await stream.receive_some(65536)
        if not data:
            return None
        decoder.receive_data(data)
    return event


async def _send(stream, event):
    for buf in wire.encode(event):
        await stream.send_all(buf)


@pytest.mark.allow_log("cachefs.rpc", match=r"expected the handshake, got Request")
async def test_request_without_handshake_is_refused(nursery):
    server, addr = await start_server(nursery)
    stream = await _raw_connect(addr)
    hello = await _read_event(stream)
    assert isinstance(hello, wire.Hello) and hello.auth_required
    await _send(stream, wire.Request(1, "echo", {}, 1000))
    with trio.fail_after(3):
        reply = await _read_event(stream)
        assert isinstance(reply, wire.ErrorReply) and reply.code == "EPROTO"
        assert await stream.receive_some(100) == b""
    await stream.aclose()
    assert server.connections == set()


@pytest.mark.allow_log("cachefs.rpc", match=r"authentication failed")
async def test_replayed_handshake_is_refused(nursery):
    _, addr = await start_server(nursery)
    # Record a valid handshake...
    stream = await _raw_connect(addr)
    hello = await _read_event(stream)
    nonce = os.urandom(32)
    cred = Credential.server(SECRET)
    recorded = wire.Auth(nonce, cred.key_id, wire.client_proof(cred.key, hello.nonce, nonce, cred.key_id))
    await _send(stream, recorded)
    assert isinstance(await _read_event(stream), wire.Welcome)
    await stream.aclose()
    # ...and replay it on a new connection: the server's nonce is new.
    stream = await _raw_connect(addr)
    await _read_event(stream)
    await _send(stream, recorded)
    with trio.fail_after(3):
        reply = await _read_event(stream)
    await stream.aclose()
    assert isinstance(reply, wire.ErrorReply) and reply.code == "EAUTH"


@pytest.mark.allow_log("cachefs.rpc", match=r"sent no handshake")
async def test_silent_peer_is_dropped_after_handshake_timeout(nursery):
    server, addr = await start_server(nursery, limits=Limits(handshake_timeout=0.2))
    stream = await _raw_connect(addr)
    await _read_event(stream)
    with trio.fail_after(3):
        assert await stream.receive_some(100) == b""
    await stream.aclose()


# ---------------------------------------------------------------- limits

@pytest.mark.allow_log("cachefs.rpc", match=r"closing connection from .*\(limit \d+\)")
async def test_frame_over_the_size_limit_closes_only_that_connection(nursery):
    _, addr = await start_server(nursery, limits=Limits(max_payload=1 << 20))
    async with RpcPool(secret=SECRET, limits=Limits(max_payload=64 << 20)) as big, \
            RpcPool(secret=SECRET) as good:
        with pytest.raises((ConnectionLost, Exception)) as info:
            await big.call(addr, "echo", payload=bytes(2 << 20))
        assert info.value.code in ("EMSGSIZE", "ECONNRESET")
        assert (await good.call(addr, "echo", {"value": 5})).result["value"] == 5


async def test_calls_over_the_inflight_limit_get_busy(nursery):
    _, addr = await start_server(nursery, limits=Limits(max_inflight=4))
    async with RpcPool(secret=SECRET, limits=Limits(max_inflight=64)) as pool:
        outcomes = []

        async def one():
            try:
                await pool.call(addr, "sleep", {"seconds": 0.2})
                outcomes.append("ok")
            except Busy:
                outcomes.append("busy")

        async with trio.open_nursery() as n:
            for _ in range(10):
                n.start_soon(one)
    assert outcomes.count("ok") == 4 and outcomes.count("busy") == 6


async def test_idle_connections_are_closed_and_reopened(nursery):
    server, addr = await start_server(nursery, limits=Limits(idle_timeout=0.2))
    async with RpcPool(secret=SECRET) as pool:
        first = await pool.connection(addr)
        await pool.call(addr, "echo")
        with trio.fail_after(10):  # closed after 0.2 s idle; allow a loaded machine
            while not (first.closed and server.connections == set()):
                await trio.sleep(0.05)
        assert (await pool.call(addr, "echo", {"value": 7})).result["value"] == 7
        assert await pool.connection(addr) is not first


async def test_unreachable_peer_backs_off(nursery):
    addr = f"127.0.0.1:{free_port()}"  # nothing listens there
    async with RpcPool(secret=SECRET, backoff_initial=0.5) as pool:
        with pytest.raises(Unreachable, match="cannot connect"):
            await pool.call(addr, "echo")
        with pytest.raises(Unreachable, match="retrying in"):
            await pool.call(addr, "echo")


async def test_every_server_answers_health(nursery):
    _, addr = await start_server(nursery)
    async with RpcPool(secret=SECRET) as pool:
        health = (await pool.call(addr, "health")).result
    assert health["service"] == "test" and health["connections"] == 1 and not health["draining"]


async def test_errors_in_the_pool_body_propagate_unwrapped(nursery):
    _, addr = await start_server(nursery)
    with pytest.raises(NotLeader):
        async with RpcPool(secret=SECRET) as pool:
            await pool.call(addr, "fail", {"code": "ENOTLEADER"})


async def test_timed_out_call_with_a_silent_peer_closes_the_connection():
    service = EchoService()
    async with trio.open_nursery() as n:
        server, addr = await start_server(n, service=service)
        async with RpcPool(secret=SECRET) as pool:
            first = await pool.connection(addr)
            with pytest.raises(TimedOut):
                await pool.call(addr, "freeze", timeout=0.5)
            assert first.closed  # nothing came back during the wait
            assert (await pool.call(addr, "echo", {"value": 1})).result["value"] == 1
            assert await pool.connection(addr) is not first
        service.thaw.set()
        n.cancel_scope.cancel()


async def test_closing_a_silent_connection_while_its_writer_is_blocked_is_clean():
    """sock_close() with the writer mid-send must not crash the pool's tasks."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    addr = f"127.0.0.1:{listener.socket.getsockname()[1]}"

    async def stalled_server():
        # Hands out the handshake, then stops reading: the client's writer
        # blocks once the socket buffers fill.
        stream = await listener.accept()
        try:
            await _send(stream, wire.Hello(wire.PROTOCOL_VERSION, os.urandom(32), False))
            await _read_event(stream)
            await _send(stream, wire.Welcome(b""))
            await trio.sleep_forever()
        finally:
            await stream.aclose()

    async with trio.open_nursery() as inner:
        inner.start_soon(stalled_server)
        async with RpcPool(secret=None) as pool:
            with pytest.raises(TimedOut):
                await pool.call(addr, "echo", payload=bytes(32 << 20), timeout=0.5)
        inner.cancel_scope.cancel()
    await listener.aclose()
