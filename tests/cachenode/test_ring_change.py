"""Gradual ring changes: right after a cache node joins a warm zone, or one
leaves it while still running, the keys that moved are found on their
previous owner (``peers.py``, the handoff) instead of being fetched from
backing storage again. Real cache nodes over real RPC on 127.0.0.1, one
backing block server; the hit rate is 1 - backing fetches / blocks read."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from cachefs.blockstore import BlockStore
from cachefs.cachenode.peers import PeerZones
from cachefs.cachenode.service import CacheService
from cachefs.ids import BlockKey
from cachefs.ring import CacheRouter
from cachefs.rpc import RpcPool, RpcServer

from .blockserver import MemoryBlockService, RpcBlockSource

BLOCKS = {BlockKey(900 + i // 8, i % 8): bytes([i % 251]) * 4096 for i in range(240)}
_ids = itertools.count()


@asynccontextmanager
async def zone(tmp: Path, n: int, handoff_window: float) -> AsyncIterator[dict[str, Any]]:
    """``n`` cache nodes of zone z (none in the map yet) reading through to one backing server."""
    backing = MemoryBlockService(BLOCKS)
    current: dict[str, Any] = {"cachenodes": []}

    async def cluster_map() -> dict[str, Any]:
        return current

    async with trio.open_nursery() as nursery, RpcPool(secret=None) as pool:
        port = await nursery.start(RpcServer(backing, name="blocks", secret=None).serve, "127.0.0.1", 0)
        source = RpcBlockSource(pool, f"127.0.0.1:{port}")
        nodes = []
        for i in range(n):
            peers = PeerZones(pool, "z", f"n{i}", cluster_map, handoff_window=handoff_window)
            store = BlockStore.open(tmp / f"n{i}", 64 << 20, segment_size=16 * 1024)
            service = CacheService(store, source, nursery=nursery, node=f"ring-{next(_ids)}", peers=peers)
            port = await nursery.start(RpcServer(service, name="cachenode", secret=None).serve, "127.0.0.1", 0)
            nodes.append({"id": f"n{i}", "addr": f"127.0.0.1:{port}", "zone": "z", "capacity": 64 << 20,
                          "peers": peers, "service": service})  # fmt: skip

        def set_members(members: list[int]) -> CacheRouter:
            """The map with these nodes, each with the bytes it holds (as heartbeats report them)."""
            current["cachenodes"] = [{**{k: v for k, v in nodes[i].items() if k not in ("peers", "service")},
                                      "used": nodes[i]["service"].store.used} for i in members]  # fmt: skip
            for i in members:
                nodes[i]["peers"].update(current)
            return CacheRouter(current, "z")

        yield {"pool": pool, "backing": backing, "set_members": set_members, "nodes": nodes}
        nursery.cancel_scope.cancel()


async def read_all(z: dict[str, Any], router: CacheRouter) -> float:
    """Every block once from its owner (a client's ``wait`` read); the share not fetched from backing."""
    before = sum(z["backing"].fetches.values())
    for key, data in BLOCKS.items():
        addr = router.candidates(key)[0]
        reply = await z["pool"].call(addr, "get", {"volume": "v", "key": key.to_bytes(), "policy": "wait"},
                                     timeout=10)  # fmt: skip
        assert bytes(reply.payload) == data
    return 1 - (sum(z["backing"].fetches.values()) - before) / len(BLOCKS)


def moved(a: CacheRouter, b: CacheRouter) -> float:
    return sum(a.owners(k)[0].id != b.owners(k)[0].id for k in BLOCKS) / len(BLOCKS)


@pytest.mark.parametrize("handoff", [True, False], ids=["handoff", "no-handoff"])
async def test_the_hit_rate_holds_when_a_node_joins_or_leaves_a_warm_zone(tmp_path, handoff) -> None:
    async with zone(tmp_path, 4, 600.0 if handoff else 0.0) as z:
        three = z["set_members"]([0, 1, 2])
        assert await read_all(z, three) == 0.0  # cold
        assert all(n["peers"].stats["handoff_misses"] == 0 for n in z["nodes"])  # empty owners: not asked
        assert await read_all(z, three) == 1.0  # warm

        four = z["set_members"]([0, 1, 2, 3])  # n3 joins, empty
        share = moved(three, four)
        assert 0.1 < share < 0.45, share  # about a quarter of the keys are n3's now
        joined = await read_all(z, four)
        assert joined == (1.0 if handoff else pytest.approx(1 - share)), (joined, share)
        assert await read_all(z, four) == 1.0  # the moved blocks are n3's now, either way

        left = z["set_members"]([0, 2, 3])  # n1 leaves the ring, still running
        share = moved(four, left)
        assert share > 0.1, share
        after = await read_all(z, left)
        assert after == (1.0 if handoff else pytest.approx(1 - share)), (after, share)
        stats = z["nodes"][3]["peers"].stats
        assert (stats["handoff_hits"] > 0) == handoff
