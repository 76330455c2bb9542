"""What a peer can make a server hold: before authentication (frame size,
pending connections, the handshake deadline) and after it (payload bytes in flight)."""

from __future__ import annotations

import os

import pytest
import trio

from cachefs import wire
from cachefs.errors import Busy
from cachefs.rpc import Limits, RpcPool, rpc_method

from .conftest import SECRET, start_server


async def _raw_connect(addr: str, source: str | None = None) -> trio.SocketStream:
    host, port = addr.rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port), local_address=source)


async def _read_event(stream: trio.SocketStream, decoder: wire.FrameDecoder) -> wire.Event | None:
    while (event := decoder.next_event()) is None:
        data = await stream.receive_some(65536)
        if not data:
            return None
        decoder.receive_data(data)
    return event


async def _closed_by_server(stream: trio.SocketStream) -> bool:
    try:
        while await stream.receive_some(65536):
            pass
    except trio.BrokenResourceError:
        pass
    return True


@pytest.mark.allow_log("cachefs.rpc", match=r"closing connection from .*\(limit 0\)")
async def test_a_big_frame_before_the_handshake_is_refused_at_its_prefix(nursery):
    """The issue's probe: a 2-byte header claiming a 64 MiB payload, before
    authenticating, is refused at once (nothing of that size is allocated)."""
    _, addr = await start_server(nursery)
    stream = await _raw_connect(addr)
    decoder = wire.FrameDecoder()
    assert isinstance(await _read_event(stream, decoder), wire.Hello)
    await stream.send_all(wire.PREFIX.pack(2, 64 << 20) + b"\x91\x04")
    with trio.fail_after(2):
        reply = await _read_event(stream, decoder)
        assert isinstance(reply, wire.ErrorReply) and reply.code == "EMSGSIZE"
        assert "limit 0" in reply.message
        assert await _closed_by_server(stream)
    await stream.aclose()


@pytest.mark.allow_log("cachefs.rpc", match=r"closing connection from .*\(limit 4096\)")
async def test_a_big_header_before_the_handshake_is_refused(nursery):
    _, addr = await start_server(nursery)
    stream = await _raw_connect(addr)
    decoder = wire.FrameDecoder()
    await _read_event(stream, decoder)
    await stream.send_all(wire.PREFIX.pack(wire.HANDSHAKE_MAX_FRAME + 1, 0))
    with trio.fail_after(2):
        reply = await _read_event(stream, decoder)
        assert isinstance(reply, wire.ErrorReply) and reply.code == "EMSGSIZE"
    await stream.aclose()


@pytest.mark.allow_log("cachefs.rpc", match=r"still in the handshake \(pending_per_peer\)")
async def test_pending_connections_per_peer_are_capped_oldest_first(nursery):
    server, addr = await start_server(nursery, limits=Limits(max_pending_per_peer=4, handshake_timeout=30))
    silent = []
    for _ in range(10):
        stream = await _raw_connect(addr)
        await _read_event(stream, wire.FrameDecoder())  # the server took it (Hello sent)
        silent.append(stream)
    with trio.fail_after(5):
        for stream in silent[:6]:  # the six oldest were dropped...
            assert await _closed_by_server(stream)
        assert len(server._pending) == 4
    # ...and a real client from the same address still gets in at once.
    async with RpcPool(secret=SECRET) as pool:
        assert (await pool.call(addr, "echo", {"value": 1}, timeout=5)).result["value"] == 1
    assert len(server._pending) == 3  # the client's connection evicted one more, then authenticated
    for stream in silent:
        await stream.aclose()


@pytest.mark.allow_log("cachefs.rpc", match=r"still in the handshake \(pending\)")
async def test_pending_connections_in_total_are_capped_and_spare_other_peers(nursery):
    limits = Limits(max_pending=6, max_pending_per_peer=6, handshake_timeout=30)
    server, addr = await start_server(nursery, limits=limits)
    hostile = []
    for i in range(12):  # from six other addresses of the loopback network
        stream = await _raw_connect(addr, source=f"127.0.0.{2 + i % 6}")
        await _read_event(stream, wire.FrameDecoder())
        hostile.append(stream)
    assert len(server._pending) == 6
    async with RpcPool(secret=SECRET) as pool:
        assert (await pool.call(addr, "echo", {"value": 2}, timeout=5)).result["value"] == 2
    health_pending = len(server._pending)
    assert health_pending <= 6
    for stream in hostile:
        await stream.aclose()


@pytest.mark.allow_log("cachefs.rpc", match=r"sent no handshake")
async def test_the_handshake_deadline_covers_a_peer_that_trickles(nursery):
    """A peer that sends its Auth one byte at a time is cut at the deadline,
    not at the next idle read."""
    _, addr = await start_server(nursery, limits=Limits(handshake_timeout=0.5))
    stream = await _raw_connect(addr)
    decoder = wire.FrameDecoder()
    await _read_event(stream, decoder)
    frame = b"".join(bytes(b) for b in wire.encode(wire.Auth(os.urandom(32), "server:x", os.urandom(32))))
    started = trio.current_time()
    with trio.fail_after(5):
        try:
            for byte in frame:
                await stream.send_all(bytes([byte]))
                await trio.sleep(0.1)
        except trio.BrokenResourceError:
            pass
        assert await _closed_by_server(stream)
    assert trio.current_time() - started < 2
    await stream.aclose()


@pytest.mark.allow_log("cachefs.rpc", match=r"connections open")
async def test_authenticated_connections_are_capped(nursery):
    _, addr = await start_server(nursery, limits=Limits(max_connections=2))
    async with RpcPool(secret=SECRET) as a, RpcPool(secret=SECRET) as b, RpcPool(secret=SECRET) as c:
        await a.call(addr, "echo")
        await b.call(addr, "echo")
        try:
            await c.call(addr, "echo")
        except Busy as exc:
            assert "connections open" in exc.message
        else:
            raise AssertionError("a third connection was let in")


class Holder:
    """Holds each request payload for a while and records the bytes held at once."""

    def __init__(self) -> None:
        self.held = 0
        self.peak = 0

    @rpc_method
    async def hold(self, *, payload: memoryview) -> int:
        self.held += len(payload)
        self.peak = max(self.peak, self.held)
        try:
            await trio.sleep(0.2)
        finally:
            self.held -= len(payload)
        return len(payload)


async def test_payload_bytes_in_flight_are_bounded_per_connection_and_in_total(nursery):
    MiB = 1 << 20
    holder = Holder()
    limits = Limits(max_payload=MiB, max_inflight_bytes=2 * MiB, max_total_inflight_bytes=3 * MiB)
    server, addr = await start_server(nursery, service=holder, limits=limits)
    results = []
    async with RpcPool(secret=SECRET) as one, RpcPool(secret=SECRET) as two:
        async def call(pool):
            results.append((await pool.call(addr, "hold", payload=bytes(MiB), timeout=20)).result)

        async with trio.open_nursery() as n:
            for i in range(12):
                n.start_soon(call, one if i % 2 else two)
    assert results == [MiB] * 12  # every call served, none refused...
    assert 2 * MiB <= holder.peak <= 3 * MiB  # ...but never more than the total at once
    holder.peak = 0
    async with RpcPool(secret=SECRET) as one, trio.open_nursery() as n:
        for _ in range(6):
            n.start_soon(call, one)
    assert holder.peak == 2 * MiB  # one connection alone: its own limit
    assert server._budget.used == 0
