"""Repair and scrub against real datanodes: wiped disks, corrupt files, moved placement."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest
import trio
from prometheus_client import REGISTRY

from cachefs.backing.client import BackingClient
from cachefs.backing.cluster import ClusterView
from cachefs.backing.policy import VolumePolicy
from cachefs.backing.repair import Repairer, Throttle
from cachefs.errors import NoSpace
from cachefs.ids import BlockKey
from cachefs.rpc import RpcPool
from cachefs.testing.datanodes import SECRET, Datanodes

from .test_backing import new_key


async def _write(client: BackingClient, volume: str, count: int, max_size: int = 300_000) -> dict[BlockKey, bytes]:
    blocks = {}
    for _ in range(count):
        key, data = new_key(), os.urandom(random.randrange(max_size))
        await client.put_block(volume, key, data)
        blocks[key] = data
    return blocks


async def _assert_full_redundancy(client: BackingClient, view: ClusterView, volume: str,
                                  blocks: dict[BlockKey, bytes]) -> None:
    policy = view.policy(volume)
    for key, data in blocks.items():
        pg = view.placement(volume, key)
        shards = {}
        for i in range(policy.n):
            shard = await client.read_shard(pg[i], volume, key, i)
            shards[i] = shard.data
        assert client.codec(policy).decode(shard.header, shards) == data


async def test_wiped_disk_is_rebuilt_by_cachefs_repair(cluster: Datanodes, volume: str, tmp_path: Path) -> None:
    volumes = {volume: VolumePolicy.parse("ec:4+2"), volume + "r": VolumePolicy.parse("replica:3", compression="zstd")}
    view = cluster.view(volumes, pg_count=8)
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, view)
        blocks = {name: await _write(client, name, 12) for name in volumes}
        cluster.kill(2)
        cluster.wipe(2)
        cluster.start(2)
        assert cluster.shard_files(2, volume) == []
        cluster_file = tmp_path / "cluster.json"
        cluster_file.write_text(json.dumps(view.to_map()))
        result = await trio.run_process(
            [sys.executable, "-m", "cachefs.cli", "repair", "--cluster-file", str(cluster_file),
             "--secret-file", str(cluster.secret_file), "--volume", volume, "--volume", volume + "r",
             "--json"], capture_stdout=True, capture_stderr=True, check=False)
        assert result.returncode == 0, result.stderr.decode()
        reports = {r["volume"]: r for r in json.loads(result.stdout)["volumes"]}
        assert reports[volume]["healthy"] and reports[volume]["shards_rebuilt"] > 0
        assert reports[volume]["shards_rebuilt"] == reports[volume]["shards_missing"]
        for name in volumes:
            await _assert_full_redundancy(client, view, name, blocks[name])
        # A second pass finds nothing to do.
        again = await Repairer(client).repair_volume(volume)
        assert again.shards_missing == 0 and again.healthy


@pytest.mark.allow_log("cachefs.backing.repair", match=r"scrub: .* corrupt on")
async def test_scrub_finds_and_repairs_corrupt_shards(cluster: Datanodes, volume: str) -> None:
    view = cluster.view({volume: VolumePolicy.parse("ec:2+1")}, pg_count=8)
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, view)
        blocks = await _write(client, volume, 10)
        damaged, keys = 0, set()
        for i in (0, 3, 5):
            for path in cluster.shard_files(i, volume):
                key_hex = path.name.split(".")[0]
                if key_hex not in keys:  # one bad shard per block: all recoverable
                    keys.add(key_hex)
                    raw = bytearray(path.read_bytes())
                    raw[-1] ^= 0x01
                    path.write_bytes(raw)
                    damaged += 1
                    break
        async def corrupt_found() -> int:
            total = 0
            for i in range(6):
                total += (await pool.call(cluster.addr(i), "stats")).result["corrupt_found"]
            return total

        before = await corrupt_found()
        checked = REGISTRY.get_sample_value("cachefs_repair_checked_blocks_total") or 0
        progress = []
        report = await Repairer(client, progress=lambda r: progress.append(r.pgs_done)).repair_volume(
            volume, scrub=True)
        assert report.shards_corrupt == damaged and report.shards_rebuilt == damaged
        assert REGISTRY.get_sample_value("cachefs_repair_checked_blocks_total") == checked + report.blocks_checked
        assert REGISTRY.get_sample_value("cachefs_repair_progress_ratio", {"volume": volume}) == 1.0
        assert await corrupt_found() == before + damaged
        assert report.healthy and progress == list(range(1, 9))
        await _assert_full_redundancy(client, view, volume, blocks)


async def test_join_moves_shards_and_removes_strays(cluster: Datanodes, volume: str) -> None:
    """Three datanodes join three: reads work before repair moves anything, and after."""
    policy = VolumePolicy.parse("ec:2+1")
    before = ClusterView.build(cluster.infos[::2], {volume: (policy, 16)})  # dn0, dn2, dn4: zones a, b, c
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, before)
        blocks = await _write(client, volume, 24, max_size=50_000)
        from cachefs.backing.placement import place_pgs
        nodes = [(d.id, d.zone, 1.0) for d in cluster.infos]
        pgs = place_pgs(nodes, 16, policy.n, previous=[list(pg) for pg in before.pgs(volume)])
        six = ClusterView.from_map(before.to_map() | {
            "datanodes": ClusterView.build(cluster.infos, {}).to_map()["datanodes"],
            "pgs": {volume: pgs}})
        client.view = six
        # Some PGs lost two of their three slots to the newcomers: only the
        # search outside the PG finds those shards until repair moves them.
        moved = [sum(a != b for a, b in zip(old, new, strict=True))
                 for old, new in zip(before.pgs(volume), six.pgs(volume), strict=True)]
        assert max(moved) >= 2
        for key, data in blocks.items():
            assert await client.get_block(volume, key) == data
        assert client.stats["searches"] > 0
        report = await Repairer(client).repair_volume(volume)
        assert report.healthy and report.shards_moved == report.shards_rebuilt > 0
        await _assert_full_redundancy(client, six, volume, blocks)
        for i in range(6):  # no strays left anywhere
            for path in cluster.shard_files(i, volume):
                key_hex, index = path.name.split(".")
                assert six.placement(volume, BlockKey.from_hex(key_hex))[int(index)] == f"dn{i}"


@pytest.mark.allow_log("cachefs.backing.repair", match=r"scrub: .* corrupt on|cannot be rebuilt")
async def test_unrecoverable_blocks_are_reported(cluster: Datanodes, volume: str) -> None:
    view = cluster.view({volume: VolumePolicy.parse("ec:2+1")}, pg_count=4)
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, view)
        key = new_key()
        await client.put_block(volume, key, b"x" * 1000)
        pg = view.placement(volume, key)
        for i in (0, 1):
            path = cluster.shard_path(int(pg[i][2:]), volume, key.hex(), i)
            assert path is not None
            path.unlink()
        report = await Repairer(client).repair_volume(volume)
        assert not report.healthy and report.unrecoverable[0].startswith(key.hex())
        # Every shard corrupt: scrub still names the block.
        other = new_key()
        await client.put_block(volume, other, b"y" * 1000)
        for i, node in enumerate(view.placement(volume, other)):
            path = cluster.shard_path(int(node[2:]), volume, other.hex(), i)
            assert path is not None
            path.write_bytes(b"garbage")
        report = await Repairer(client).repair_volume(volume, scrub=True)
        assert report.shards_corrupt == 3
        assert any(line.startswith(other.hex()) for line in report.unrecoverable)


async def test_throttle_keeps_the_rate(autojump_clock) -> None:
    throttle = Throttle(1_000_000, burst_seconds=0.5)
    start = trio.current_time()
    for _ in range(20):
        await throttle(500_000)
    assert 9.0 <= trio.current_time() - start <= 10.5


async def test_disk_full(tmp_path: Path) -> None:
    nodes = Datanodes(tmp_path, ["a", "b", "c"], capacity="3M")
    nodes.start()
    try:
        volume = "full"
        view = nodes.view({volume: VolumePolicy.parse("ec:2+1")}, pg_count=4)
        stored = {}
        async with RpcPool(secret=SECRET) as pool:
            client = BackingClient(pool, view)
            with pytest.raises(NoSpace, match="shards stored"):
                for n in range(20):
                    key, data = BlockKey(900_000 + n, 0), os.urandom(1 << 20)
                    await client.put_block(volume, key, data)
                    stored[key] = data
            assert 2 <= len(stored) < 10
            for key, data in stored.items():
                assert await client.get_block(volume, key) == data
            for i in range(3):
                stats = (await pool.call(nodes.addr(i), "stats")).result
                assert stats["used"] <= stats["capacity"]
                assert list((nodes.data_dir(i) / "tmp").iterdir()) == []
                # The failed block left nothing behind on any datanode.
                assert len(nodes.shard_files(i, volume)) == len(stored)
    finally:
        nodes.stop_all()
