from __future__ import annotations

import trio

from cachefs.rpc import Reply, rpc_method

SECRET = b"test-cluster-secret"


class EchoService:
    """A service with the shapes the tests need: echo, sleep, freeze, fail."""

    def __init__(self) -> None:
        self.calls = 0
        self.thaw = trio.Event()

    @rpc_method
    async def echo(self, value: int | str | None = None, *, payload: memoryview | None = None) -> Reply:
        self.calls += 1
        return Reply({"value": value, "size": len(payload or b"")}, payload)

    @rpc_method
    async def sleep(self, seconds: float, tag: int = 0) -> int:
        await trio.sleep(seconds)
        return tag

    @rpc_method
    async def freeze(self) -> None:
        """Sends nothing back, not even at the call's deadline, until ``thaw``
        is set: a frozen peer (``sleep`` answers ETIMEDOUT at its deadline)."""
        with trio.CancelScope(shield=True):
            await self.thaw.wait()

    @rpc_method
    async def fail(self, code: str) -> None:
        from cachefs.errors import error_from_wire

        err = error_from_wire(code, f"asked to fail with {code}", {"leader": "10.0.0.1:1"})
        err.remote = False
        raise err

    @rpc_method
    async def crash(self) -> None:
        raise RuntimeError("handler bug")


async def start_server(nursery, *, secret=SECRET, limits=None, port=0, service=None):
    from cachefs.rpc import Limits, RpcServer

    server = RpcServer(service or EchoService(), name="test", secret=secret, limits=limits or Limits())
    port = await nursery.start(server.serve, "127.0.0.1", port)
    return server, f"127.0.0.1:{port}"
