"""A whole zone down: puts hand shards off to other datanodes, reads find them,
and repair moves them back to their placement groups. Real datanode processes."""

from __future__ import annotations

import collections
import os
import random

import trio

from cachefs.backing.client import BackingClient, _durable
from cachefs.backing.placement import handoff_order
from cachefs.backing.policy import VolumePolicy
from cachefs.backing.repair import Repairer
from cachefs.ids import BlockKey
from cachefs.rpc import RpcPool
from cachefs.testing.datanodes import SECRET, Datanodes

MiB = 1 << 20
_slices = iter(range(1 << 41, 1 << 42))


def new_key() -> BlockKey:
    return BlockKey(next(_slices), random.randrange(16))


def holdings(cluster: Datanodes, volume: str) -> dict[str, dict[int, set[str]]]:
    """key hex -> shard index -> datanodes whose disk holds it."""
    out: dict[str, dict[int, set[str]]] = collections.defaultdict(lambda: collections.defaultdict(set))
    for i in range(len(cluster.zones)):
        for path in cluster.shard_files(i, volume):
            key, index = path.name.split(".")
            out[key][int(index)].add(f"dn{i}")
    return out


def zone_nodes(cluster: Datanodes, zone: str) -> list[int]:
    return [i for i, z in enumerate(cluster.zones) if z == zone]


def test_durable_rule() -> None:
    assert _durable({i: {f"n{i}"} for i in range(5)}, 5)
    assert not _durable({i: {f"n{i}"} for i in range(4)}, 5)
    # Six shards on four nodes, two nodes with two: losing any node leaves four.
    assert _durable({0: {"a"}, 1: {"b"}, 2: {"c"}, 3: {"d"}, 4: {"a"}, 5: {"b"}}, 5)
    # Five shards that way do not: losing "a" leaves three.
    assert not _durable({0: {"a"}, 1: {"b"}, 2: {"c"}, 3: {"d"}, 4: {"a"}}, 5)
    # Replicas: two copies on one node are one copy.
    assert not _durable({0: {"a"}, 1: {"a"}}, 2)
    assert _durable({0: {"a"}, 1: {"b"}}, 2)


def test_handoff_order_is_deterministic_and_prefers_outsiders() -> None:
    nodes = [f"dn{i}" for i in range(9)]
    pg = ("dn0", "dn3", "dn6", "dn1", "dn4", "dn7")
    key = BlockKey(5, 1)
    order = handoff_order(key, 2, nodes, pg)
    assert "dn6" not in order and len(order) == 8
    assert set(order[:3]) == {"dn2", "dn5", "dn8"}  # outside the PG first
    assert order == handoff_order(key, 2, reversed(nodes), pg)
    assert {tuple(handoff_order(key, i, nodes, pg)[:3]) for i in range(6)} != {tuple(order[:3])}


async def test_zone_killed_writes_go_on_and_repair_moves_shards_home(cluster: Datanodes, volume: str) -> None:
    """ec:4+2 on 6 nodes in 3 zones (every PG is all six): zone a killed, the
    four nodes left hold all six shards, no node more than two."""
    pol = VolumePolicy.parse("ec:4+2")
    view = cluster.view({volume: pol}, pg_count=8)
    blocks = {new_key(): os.urandom(random.randrange(1, 2 * MiB)) for _ in range(8)}
    down = zone_nodes(cluster, "a")
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, view, timeout=5.0)
        for i in down:
            cluster.kill(i)
        with trio.fail_after(30):
            for key, data in blocks.items():
                await client.put_block(volume, key, data)
        for key, data in blocks.items():
            assert await client.get_block(volume, key) == data
            assert await client.get_block(volume, key, 100, 1000) == data[100:1100]
        held = holdings(cluster, volume)
        for key in blocks:
            shards = held[key.hex()]
            assert sorted(shards) == list(range(6))
            per_node = collections.Counter(n for nodes in shards.values() for n in nodes)
            assert max(per_node.values()) == 2 and not {f"dn{i}" for i in down} & set(per_node)
        assert client.stats["handoffs"] == 2 * len(blocks)
        assert {m.node for m in client.missing} == {f"dn{i}" for i in down}
        assert all(m.handoff is not None for m in client.missing)

        # Zone a back (empty for these blocks). Reads work before repair too.
        for i in down:
            cluster.start(i)
        for key, data in blocks.items():
            assert await client.get_block(volume, key) == data
        # One more node lost before repair: a reader that never wrote these
        # blocks finds the handed-off shards on the substitutes.
        other = zone_nodes(cluster, "b")[0]
        cluster.kill(other)
        reader = BackingClient(pool, view, timeout=5.0)
        for key, data in blocks.items():
            assert await reader.get_block(volume, key) == data
        assert reader.stats["searches"] > 0
        cluster.start(other)
        report = await Repairer(client).repair_missing(client.missing)
        assert report.healthy, report
        assert report.shards_rebuilt == report.shards_moved == 2 * len(blocks)
        held = holdings(cluster, volume)
        for key in blocks:
            pg = view.placement(volume, key)
            assert held[key.hex()] == {i: {pg[i]} for i in range(6)}  # every shard home, no strays
        again = await Repairer(client).repair_volume(volume)
        assert again.healthy and again.shards_missing == again.shards_moved == 0


async def test_zone_frozen_writes_hand_off_to_nodes_outside_the_pg(cluster: Datanodes, volume: str) -> None:
    """ec:2+1 (PGs of 3, one per zone) with zone b SIGSTOPped: alive but silent,
    so only the handoff delay helps. Shards go to nodes outside their PG, and
    a reader that never wrote them finds them."""
    pol = VolumePolicy.parse("ec:2+1")
    view = cluster.view({volume: pol}, pg_count=8)
    blocks = {new_key(): os.urandom(random.randrange(1, MiB)) for _ in range(6)}
    frozen = zone_nodes(cluster, "b")
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, view, timeout=20.0)
        await client.put_block(volume, new_key(), b"warm up the connections")
        for i in frozen:
            cluster.pause(i)
        try:
            with trio.fail_after(15):
                for key, data in blocks.items():
                    await client.put_block(volume, key, data)
            held = holdings(cluster, volume)
            for key in blocks:
                pg = view.placement(volume, key)
                nodes = [n for shard in held[key.hex()].values() for n in shard]
                assert len(nodes) == len(set(nodes)) == 3  # distinct nodes
                assert len(set(nodes) - set(pg)) == 1
            with trio.fail_after(10):
                for key, data in blocks.items():
                    assert await client.get_block(volume, key) == data
            # A fresh client that never saw the put looks on the substitutes.
            reader = BackingClient(pool, view, timeout=20.0)
            with trio.fail_after(15):
                for key, data in list(blocks.items())[:2]:
                    assert await reader.get_block(volume, key) == data
        finally:
            for i in frozen:
                cluster.resume(i)
        report = await Repairer(client).repair_volume(volume)
        assert report.healthy, report
        # A frozen node may still store a write it received before the put moved
        # on (it runs again on SIGCONT): then only the stray copy goes.
        assert report.shards_moved == len(blocks) >= report.shards_rebuilt
        held = holdings(cluster, volume)
        for key in blocks:
            pg = view.placement(volume, key)
            assert held[key.hex()] == {i: {pg[i]} for i in range(3)}
        # With zone b back, the substitutes no longer hold anything: reads go home.
        for key, data in blocks.items():
            assert await reader.get_block(volume, key) == data
