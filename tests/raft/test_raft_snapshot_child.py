"""The forked snapshot child: a node that stops while its child serializes
kills and reaps it (no stray process, no zombie), and the state machine's
snapshot() really runs in another process while the node goes on."""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgpack
import trio

from cachefs.metanode.raft.driver import DriverConfig, RaftNode
from cachefs.rpc import RpcPool, RpcServer
from cachefs.testing.ports import free_ports

from .sim import KV


class GatedKV(KV):
    """snapshot() waits (bounded) for ``gate`` and records who ran it."""

    def __init__(self, gate: Path, ran_in: Path) -> None:
        super().__init__()
        self.gate = gate
        self.ran_in = ran_in

    def snapshot(self) -> bytes:
        self.ran_in.write_text(str(os.getpid()))
        deadline = time.monotonic() + 30
        while not self.gate.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        return super().snapshot()


def gone(pid: int) -> bool:
    """True once ``pid`` has exited and been reaped (a zombie still exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_stopping_during_a_snapshot_kills_and_reaps_the_child(tmp_path: Path) -> None:
    gate, ran_in = tmp_path / "gate", tmp_path / "ran-in"
    addr = f"127.0.0.1:{free_ports(1)[0]}"
    sm = GatedKV(gate, ran_in)
    async with trio.open_nursery() as outer:
        with trio.CancelScope() as scope:
            async with RpcPool(secret=None) as pool, trio.open_nursery() as n:
                server = RpcServer(name="solo", secret=None)
                await n.start(server.serve, "127.0.0.1", int(addr.rsplit(":", 1)[1]))
                node = await RaftNode.create(
                    1, {1: addr}, tmp_path / "m1", sm, pool, nursery=n, server=server,
                    driver_config=DriverConfig(tick_interval=0.02, snapshot_entries=20))
                with trio.fail_after(10):
                    while not node.is_leader:
                        await trio.sleep(0.01)
                seq = 0
                with trio.fail_after(20):
                    while node.snapshot_child is None:
                        seq += 1
                        await node.propose(msgpack.packb(["c", seq, "put", "k", seq, None]))
                pid = node.snapshot_child
                with trio.fail_after(20):  # the child is in snapshot(); the node still commits
                    while not await trio.Path(ran_in).exists():
                        await trio.sleep(0.01)
                    assert int(await trio.Path(ran_in).read_text()) == pid != os.getpid()
                    for k in range(5):
                        await node.propose(msgpack.packb(["c", seq + 1 + k, "put", "k", k, None]))
                assert node.snapshotting and sm.data["k"] == 4
                scope.cancel()
        with trio.fail_after(20):
            while not gone(pid):
                await trio.sleep(0.01)
        assert not list((tmp_path / "m1").glob("snap-*.snap"))  # it never finished
        outer.cancel_scope.cancel()
