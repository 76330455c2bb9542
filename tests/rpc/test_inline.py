"""Plain (non-async) handlers run inline in the connection's reader: they
answer without a task, may hand back an awaitable for a slow path that then
runs under the caller's deadline, and keep every error and limit rule."""

from __future__ import annotations

import pytest
import trio

from cachefs.errors import InvalidArgument, NotFound, TimedOut
from cachefs.rpc import Reply, RpcPool, rpc_method

from .conftest import SECRET, start_server


class InlineService:
    def __init__(self) -> None:
        self.gate = trio.Event()
        self.slow_started = 0

    @rpc_method
    def add(self, a: int, b: int = 0) -> int:
        return a + b

    @rpc_method
    def echo_payload(self, *, payload: memoryview | None = None) -> Reply:
        return Reply(len(payload or b""), payload)

    @rpc_method
    def missing(self, key: str) -> None:
        raise NotFound(f"no {key}")

    @rpc_method
    def broken(self) -> None:
        raise RuntimeError("handler bug")

    @rpc_method
    def maybe_slow(self, wait: bool) -> str | object:
        """Answers at once, or returns a coroutine that waits for the gate."""
        if not wait:
            return "now"
        return self._slow()

    async def _slow(self) -> str:
        self.slow_started += 1
        await self.gate.wait()
        return "later"

    @rpc_method
    def unencodable(self) -> object:
        return object()


@pytest.mark.allow_log("cachefs.rpc", match=r"handler \w+ failed|msgpack cannot encode")
async def test_inline_answers_errors_and_payloads(nursery):
    _, addr = await start_server(nursery, service=InlineService())
    async with RpcPool(secret=SECRET) as pool:
        assert (await pool.call(addr, "add", {"a": 2, "b": 3})).result == 5
        reply = await pool.call(addr, "echo_payload", payload=b"x" * 100_000)
        assert reply.result == 100_000 and bytes(reply.payload) == b"x" * 100_000
        with pytest.raises(NotFound):
            await pool.call(addr, "missing", {"key": "k"})
        with pytest.raises(InvalidArgument, match="'a'"):
            await pool.call(addr, "add", {"a": "two"})
        with pytest.raises(InvalidArgument, match="missing argument"):
            await pool.call(addr, "add", {})
        with pytest.raises(InvalidArgument, match="takes no payload"):
            await pool.call(addr, "add", {"a": 1}, payload=b"zz")
        from cachefs.errors import CacheFSError

        with pytest.raises(CacheFSError) as err:
            await pool.call(addr, "broken")
        assert err.value.code == "EIO"
        with pytest.raises(CacheFSError) as err:
            await pool.call(addr, "unencodable")
        assert err.value.code == "EIO"
        assert (await pool.call(addr, "add", {"a": 1})).result == 1  # connection still fine


async def test_an_inline_answer_overtakes_a_blocked_slow_path(nursery):
    service = InlineService()
    _, addr = await start_server(nursery, service=service)
    async with RpcPool(secret=SECRET) as pool:
        results: list[str] = []

        async def slow() -> None:
            results.append((await pool.call(addr, "maybe_slow", {"wait": True})).result)

        async with trio.open_nursery() as n:
            n.start_soon(slow)
            with trio.fail_after(10):
                while not service.slow_started:
                    await trio.sleep(0.01)
            for _ in range(50):  # same connection, answered while the slow one waits
                assert (await pool.call(addr, "maybe_slow", {"wait": False})).result == "now"
            assert results == []
            service.gate.set()
        assert results == ["later"]


async def test_a_slow_path_runs_under_the_callers_deadline(nursery):
    service = InlineService()
    server, addr = await start_server(nursery, service=service)
    async with RpcPool(secret=SECRET) as pool:
        with pytest.raises(TimedOut):
            await pool.call(addr, "maybe_slow", {"wait": True}, timeout=0.2)
        with trio.fail_after(10):  # the server cancelled it too: nothing stays in flight
            while server._inflight:
                await trio.sleep(0.01)
        assert (await pool.call(addr, "add", {"a": 4})).result == 4
