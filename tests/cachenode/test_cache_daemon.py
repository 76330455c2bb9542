"""Real cachenode processes: kill -9 and restart keeps blocks; a node killed during reads."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import trio

from cachefs.errors import CacheFSError, ConnectionLost, TimedOut, Unavailable, Unreachable
from cachefs.ids import BlockKey
from cachefs.ring import CacheRouter
from cachefs.rpc import RpcPool, RpcServer
from cachefs.testing.ports import free_port

from .blockserver import MemoryBlockService, RpcBlockSource


class Node:
    def __init__(
        self, cache_dir: Path, zone: str, capacity: str = "64M", extra: tuple[str, ...] = ()
    ) -> None:
        self.cache_dir = cache_dir
        self.extra = list(extra)
        self.zone = zone
        self.capacity = capacity
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.cache_dir.with_suffix(".log"), "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cachefs.cli",
                "cachenode",
                "--zone",
                self.zone,
                "--cache-dir",
                str(self.cache_dir),
                "--capacity",
                self.capacity,
                "--listen",
                self.addr,
                "--insecure",
                "--log-level",
                "WARNING",
                *self.extra,
            ],
            stdout=log,
            stderr=log,
        )
        log.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.cache_dir.with_suffix(".log").read_text()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"cachenode on {self.addr} did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # SIGKILL: no shutdown, no flush
            self.proc.wait(timeout=10)

    def as_map_entry(self, node_id: str) -> dict:
        return {
            "id": node_id,
            "addr": self.addr,
            "zone": self.zone,
            "capacity": 64 << 20,
            "state": "up",
        }


@contextmanager
def running(*nodes: Node) -> Iterator[None]:
    try:
        for node in nodes:
            node.start()
        yield
    finally:
        for node in nodes:
            node.kill()


def _blocks(n: int, size: int) -> dict[BlockKey, bytes]:
    rng = random.Random(n * size)
    return {BlockKey(500 + i, i): rng.randbytes(size) for i in range(n)}


async def test_kill_9_and_restart_keeps_blocks(tmp_path: Path) -> None:
    node = Node(tmp_path / "cache", "a")
    blocks = _blocks(12, 300_000)
    with running(node):
        async with RpcPool(secret=None) as pool:
            for key, data in blocks.items():
                reply = await pool.call(
                    node.addr, "put", {"volume": "v", "key": key.to_bytes()}, payload=data
                )
                assert reply.result == {"stored": True}
            node.kill()
    (tmp_path / "cache" / "tmp" / "0000000000000001-00000000.half").write_bytes(b"half written")
    with running(node):
        async with RpcPool(secret=None) as pool:
            for key, data in blocks.items():
                reply = await pool.call(
                    node.addr,
                    "get",
                    {"volume": "v", "key": key.to_bytes(), "offset": 7, "length": 70_000},
                )
                assert reply.result == {"size": 300_000, "hit": True}
                assert bytes(reply.payload) == data[7:70_007]
            stats = (await pool.call(node.addr, "stats")).result
            assert stats["blocks"] == 12 and stats["discarded_on_open"] == 1
            # without metanodes a miss cannot be read through, and says so
            try:
                await pool.call(node.addr, "get", {"volume": "v", "key": BlockKey(1, 1).to_bytes()})
                raise AssertionError("a miss without backing storage must fail")
            except Unavailable:
                pass
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []


async def read_block(
    pool: RpcPool,
    router: CacheRouter,
    backing: RpcBlockSource,
    key: BlockKey,
    offset: int,
    length: int,
) -> tuple[bytes, str]:
    """The client's read path: own zone's owner, the other zone's owner, then backing storage."""
    for addr in router.candidates(key):
        try:
            reply = await pool.call(
                addr,
                "get",
                {"volume": "v", "key": key.to_bytes(), "offset": offset, "length": length},
                timeout=1.0,
            )
        except (Unreachable, ConnectionLost, TimedOut):
            router.mark_down(addr)
            pool.forget(addr)
            continue
        except CacheFSError:
            continue
        router.mark_up(addr)
        return bytes(reply.payload or b""), addr
    data = await backing.get_block("v", key)
    return bytes(data[offset : offset + length]), "backing"


async def test_cache_node_killed_during_reads(tmp_path: Path) -> None:
    a, b = Node(tmp_path / "a", "a"), Node(tmp_path / "b", "b")
    blocks = _blocks(16, 100_000)
    keys = list(blocks)
    cmap = {"epoch": 1, "cachenodes": [a.as_map_entry("na"), b.as_map_entry("nb")]}
    router = CacheRouter(cmap, "a", back_off=30.0)
    source = MemoryBlockService(blocks)
    server = RpcServer(source, name="blocks", secret=None)
    with running(a, b):
        async with trio.open_nursery() as nursery, RpcPool(secret=None) as pool:
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            backing = RpcBlockSource(pool, f"127.0.0.1:{port}")
            for key, data in blocks.items():  # write-through into every zone's owner
                for addr in router.candidates(key):
                    await pool.call(
                        addr, "put", {"volume": "v", "key": key.to_bytes()}, payload=data
                    )
            served: list[str] = []
            rng = random.Random(5)
            for i in range(300):
                if i == 100:
                    a.kill()
                if i == 200:
                    b.kill()
                key = rng.choice(keys)
                off = rng.randrange(100_000)
                data, where = await read_block(pool, router, backing, key, off, 5000)
                assert data == blocks[key][off : off + 5000]
                served.append(where)
            nursery.cancel_scope.cancel()
    assert set(served[:100]) == {a.addr}
    assert set(served[101:200]) == {b.addr}
    assert set(served[201:]) == {"backing"}
    assert sum(source.fetches.values()) == 100
