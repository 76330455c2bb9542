"""The backing-storage client against 6 real datanode processes in 3 zones."""

from __future__ import annotations

import os
import random

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachefs.backing.client import BackingClient
from cachefs.backing.policy import VolumePolicy
from cachefs.backing.repair import Repairer
from cachefs.buffers import BufferPool
from cachefs.errors import Corrupt, NotFound, Unavailable
from cachefs.ids import BlockKey
from cachefs.rpc import RpcPool
from cachefs.testing.datanodes import SECRET, Datanodes
from cachefs.testing.pagecache import evict_from_page_cache

MiB = 1 << 20
_slices = iter(range(1, 1 << 40))


def new_key() -> BlockKey:
    return BlockKey(next(_slices), random.randrange(16))


def sizes(rng: random.Random) -> list[int]:
    return [0, 1, 4095, 65536 + 3, rng.randrange(8 * MiB), 8 * MiB]


@pytest.mark.parametrize(("policy", "compression"), [
    ("ec:4+2", "none"), ("ec:2+1", "zstd"), ("replica:3", "none"), ("replica:3", "zstd"),
])
async def test_round_trips_and_ranges(cluster: Datanodes, volume: str, policy: str, compression: str) -> None:
    rng = random.Random(f"{policy}{compression}")
    pol = VolumePolicy.parse(policy, compression=compression, block_size=8 * MiB)
    view = cluster.view({volume: pol})
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, view, zone="b")
        blocks = {}
        for size in sizes(rng):
            data = rng.randbytes(size) if size % 2 else bytes(size // 3) + rng.randbytes(size - size // 3)
            key = new_key()
            await client.put_block(volume, key, data)
            blocks[key] = data
        for key, data in blocks.items():
            assert await client.get_block(volume, key) == data
            for _ in range(3):
                offset = rng.randrange(len(data) + 10)
                length = rng.choice([-1, 0, 1, rng.randrange(2 * MiB)])
                want = data[offset:] if length == -1 else data[offset : offset + length]
                assert await client.get_block(volume, key, offset, length) == want
        assert not client.missing
        assert client.stats["degraded_reads"] == 0
        if compression == "none":
            assert client.stats["range_reads"] > 0
        with pytest.raises(NotFound):
            await client.get_block(volume, new_key())


async def test_shards_not_in_the_page_cache_are_read_from_the_disk(cluster: Datanodes, volume: str) -> None:
    """A datanode answers shards in the page cache in its event loop and
    reads the others in a worker thread: both give the block back."""
    pol = VolumePolicy.parse("ec:4+2", block_size=4 * MiB)
    view = cluster.view({volume: pol})
    data = random.Random(5).randbytes(4 * MiB - 1000)
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, view)
        key = new_key()
        await client.put_block(volume, key, data)
        assert await client.get_block(volume, key) == data  # from the page cache
        files = [p for i in range(len(cluster.zones)) for p in cluster.shard_files(i, volume)]
        assert len(files) == 6
        if not all(evict_from_page_cache(p) for p in files):
            pytest.skip("this filesystem keeps shard files in the page cache")
        assert await client.get_block(volume, key) == data
        assert await client.get_block(volume, key, 5, 3 * MiB) == data[5 : 3 * MiB + 5]
        assert client.stats["degraded_reads"] == 0


async def test_whole_blocks_are_read_in_place_and_checked_against_the_block_checksum(
        cluster: Datanodes, volume: str) -> None:
    """A whole block is its data shards' payloads received in place; a data
    shard whose bytes changed (its own checksums recomputed, so the datanode
    serves it) fails the block checksum: Corrupt, never wrong bytes."""
    pol = VolumePolicy.parse("ec:4+2", block_size=4 * MiB)
    view = cluster.view({volume: pol})
    data = os.urandom(4 * MiB)
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, view)
        key = new_key()
        await client.put_block(volume, key, data)
        got = await client.get_block(volume, key)
        assert got == data and client.stats["whole_reads"] == 1 and client.stats["whole_fallbacks"] == 0
        pg = view.placement(volume, key)
        header, shards = await client.read_shards(volume, key)
        bad = bytearray(shards[1])
        bad[header.frag_offset + 12345] ^= 0xFF
        await client.write_shard(pg[1], volume, key, 1, header, bad)
        with pytest.raises(Corrupt):
            await client.get_block(volume, key)
        assert client.stats["whole_fallbacks"] == 1
        short = os.urandom(3 * MiB + 7)  # a file's last block: the first plan (a full block's) is wrong
        key2 = new_key()
        await client.put_block(volume, key2, short)
        assert await client.get_block(volume, key2) == short
        assert client.stats["whole_reads"] == 2


@pytest.mark.parametrize("size", [1, 110 * 1024 + 5, 3 * MiB + 7])
async def test_a_short_block_read_first_takes_one_round_of_shard_reads(
        cluster: Datanodes, volume: str, size: int) -> None:
    """The first read of a whole block shorter than the volume's block size
    plans with a full block's layout; the replies (clipped at each shard's
    end) hold the real ranges, so no second round is sent: K shard reads."""
    pol = VolumePolicy.parse("ec:4+2", block_size=4 * MiB)
    view = cluster.view({volume: pol})
    rng = random.Random(size)
    async with RpcPool(secret=SECRET) as pool:
        buffers = BufferPool()
        client = BackingClient(pool, view, buffers=buffers)
        key, other = new_key(), new_key()
        data = rng.randbytes(size)
        await client.put_block(volume, key, data)
        await client.put_block(volume, other, data[::-1])
        calls = pool.time_calls()
        assert await client.get_block(volume, key) == data
        assert sum(calls.counts["get"]) == 4
        assert client.stats["whole_reads"] == 1 and client.stats["whole_fallbacks"] == 0
        assert await client.get_block(volume, key) == data  # its header known: the shards with its bytes
        assert 4 < sum(calls.counts["get"]) <= 8
        # The guessed full block's buffer went back to the pool, and the next guess reuses it.
        assert buffers.stats["buffers_kept"] == 1
        assert await client.get_block(volume, other) == data[::-1]
        assert buffers.stats["buffers_reused"] == 1


async def test_range_read_touches_only_covering_data_shards(cluster: Datanodes, volume: str) -> None:
    """With every shard but data shard 1 gone, a range inside shard 1 still reads."""
    view = cluster.view({volume: VolumePolicy.parse("ec:4+2")})
    data = os.urandom(4 * MiB)
    key = new_key()
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, view)
        await client.put_block(volume, key, data)
        pg = view.placement(volume, key)
        for index in (0, 2, 3, 4, 5):
            path = cluster.shard_path(int(pg[index][2:]), volume, key.hex(), index)
            assert path is not None
            path.unlink()
        assert await client.get_block(volume, key, MiB + 100, 5000) == data[MiB + 100 : MiB + 5100]
        with pytest.raises(Unavailable):
            await client.get_block(volume, key)


def _damage(cluster: Datanodes, volume: str, key: BlockKey, node: str, index: int, how: str) -> None:
    path = cluster.shard_path(int(node[2:]), volume, key.hex(), index)
    assert path is not None
    if how == "delete":
        path.unlink()
    elif how == "flip":
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        path.write_bytes(raw)
    else:
        path.write_bytes(path.read_bytes()[:-1])


@pytest.mark.parametrize("policy", ["ec:4+2", "ec:2+1", "replica:3"])
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
async def test_any_m_shards_lost_or_corrupt_still_read(cluster: Datanodes, volume: str, policy: str, data) -> None:
    pol = VolumePolicy.parse(policy)
    view = cluster.view({volume: pol})
    block = os.urandom(data.draw(st.integers(0, 600_000)))
    key = new_key()
    bad = data.draw(st.sets(st.integers(0, pol.n - 1), min_size=1, max_size=pol.m))
    hows = {i: data.draw(st.sampled_from(["delete", "flip", "truncate"])) for i in bad}
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, view)
        await client.put_block(volume, key, block)
        pg = view.placement(volume, key)
        for i, how in hows.items():
            _damage(cluster, volume, key, pg[i], i, how)
        assert await client.get_block(volume, key) == block
        if len(block) > 10:
            assert await client.get_block(volume, key, 5, len(block) - 7) == block[5:-2]


@pytest.mark.parametrize("policy", ["ec:4+2", "replica:3"])
async def test_m_plus_one_lost_is_unavailable(cluster: Datanodes, volume: str, policy: str) -> None:
    pol = VolumePolicy.parse(policy)
    view = cluster.view({volume: pol})
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, view)
        for how in ("delete", "flip"):
            key = new_key()
            data = os.urandom(300_000)
            await client.put_block(volume, key, data)
            pg = view.placement(volume, key)
            for i in random.sample(range(pol.n), pol.m + 1):
                _damage(cluster, volume, key, pg[i], i, how)
            if pol.kind == "replica" and how == "delete":
                # Every copy denies having it: indistinguishable from never written.
                with pytest.raises(NotFound):
                    await client.get_block(volume, key)
                continue
            for _ in range(2):  # corrupt shards stay "corrupt", never turn into "not found"
                with pytest.raises(Unavailable, match="needed shards"):
                    await client.get_block(volume, key)
            # A range whose own shard survived may still be served; never wrong bytes.
            for offset in range(0, len(data), 40_000):
                try:
                    got = await client.get_block(volume, key, offset, 1000)
                except Unavailable:
                    continue
                assert got == data[offset : offset + 1000]


async def test_dead_datanodes_and_quorum(cluster: Datanodes, volume: str) -> None:
    pol = VolumePolicy.parse("ec:4+2")
    view = cluster.view({volume: pol}, pg_count=4)
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, view, timeout=3.0)
        key = new_key()
        data = os.urandom(1 * MiB)
        await client.put_block(volume, key, data)
        pg = view.placement(volume, key)
        first, second = int(pg[0][2:]), int(pg[1][2:])
        cluster.kill(first)
        # One node down: K+1 = 5 shards still durable, so writes succeed.
        other = new_key()
        while view.placement(volume, other) != pg:
            other = new_key()
        await client.put_block(volume, other, data)
        assert [m.index for m in client.missing] == [0]
        assert await client.get_block(volume, key) == data
        assert await client.get_block(volume, other, 7, 100) == data[7:107]
        cluster.kill(second)
        # Two down: reads still work (any 4 of 6); writes hand the two shards
        # off to the other PG members (test_handoff.py covers that).
        assert await client.get_block(volume, other) == data
        # Four down: two nodes cannot hold a block so that losing one keeps 4 shards.
        third, fourth = int(pg[2][2:]), int(pg[3][2:])
        cluster.kill(third)
        cluster.kill(fourth)
        with pytest.raises(Unavailable, match="5 on distinct nodes needed"):
            await client.put_block(volume, other._replace(index=other.index + 1000), data)


async def test_hedged_read_beats_a_stopped_datanode(cluster: Datanodes, volume: str) -> None:
    pol = VolumePolicy.parse("ec:4+2")
    view = cluster.view({volume: pol})
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, view, timeout=20.0)
        key = new_key()
        data = os.urandom(2 * MiB)
        await client.put_block(volume, key, data)
        assert await client.get_block(volume, key) == data  # warm connections
        node = int(view.placement(volume, key)[1][2:])
        cluster.pause(node)  # alive but silent: only hedging helps
        try:
            with trio.fail_after(5):
                assert await client.get_block(volume, key) == data
            with trio.fail_after(5):  # a range inside the silent node's data shard
                assert await client.get_block(volume, key, 600_000, 1000) == data[600_000:601_000]
        finally:
            cluster.resume(node)
        assert client.stats["hedged"] >= 1


async def test_kill_9_during_writes(cluster: Datanodes, volume: str) -> None:
    pol = VolumePolicy.parse("ec:4+2")
    view = cluster.view({volume: pol})
    written: dict[BlockKey, bytes] = {}
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, view, timeout=5.0)

        some_written = trio.Event()

        async def writer(n: int) -> None:
            for _ in range(n):
                key, data = new_key(), os.urandom(random.randrange(1, 2 * MiB))
                await client.put_block(volume, key, data)
                written[key] = data
                if len(written) >= 8:
                    some_written.set()

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(writer, 10)
            # Kill mid-stream, by progress rather than by clock: on a quiet
            # machine all 40 puts can finish within a fixed sleep.
            await some_written.wait()
            cluster.kill(3)
        assert len(written) == 40
        for key, data in written.items():
            assert await client.get_block(volume, key) == data
        cluster.start(3)
        for key, data in written.items():
            assert await client.get_block(volume, key) == data
        # What the puts recorded as short is enough to restore full redundancy.
        assert client.missing and {m.node for m in client.missing} == {"dn3"}
        report = await Repairer(client).repair_missing(client.missing)
        # A shard whose write reached dn3's disk just before the kill but whose
        # answer did not come back is recorded, yet needs no rebuild.
        assert report.healthy and 0 < report.shards_rebuilt <= len(client.missing)
        for m in client.missing:
            shard = await client.read_shard("dn3", volume, m.key, m.index)
            assert shard.header.orig_len == len(written[m.key])


async def test_delete_block(cluster: Datanodes, volume: str) -> None:
    view = cluster.view({volume: VolumePolicy.parse("ec:2+1")})
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, view)
        key = new_key()
        await client.put_block(volume, key, b"hello")
        await client.delete_block(volume, key)
        with pytest.raises(NotFound):
            await client.get_block(volume, key)
        with pytest.raises(NotFound):
            await client.delete_block(volume, key)


async def test_datanode_rejects_bad_input_and_keeps_serving(cluster: Datanodes) -> None:
    from cachefs.errors import InvalidArgument

    addr = cluster.addr(0)
    good = BlockKey(5, 5).to_bytes()
    async with RpcPool(secret=SECRET) as pool:
        for args, fragment in [
            ({"volume": "../etc", "key": good, "index": 0}, "volume"),
            ({"volume": "v", "key": b"short", "index": 0}, "12 bytes"),
            ({"volume": "v", "key": good, "index": 999}, "index"),
            ({"volume": "v", "key": good, "index": 0, "offset": -5}, "range"),
            ({"volume": "v", "key": "text", "index": 0}, "bytes"),
        ]:
            with pytest.raises(InvalidArgument, match=fragment):
                await pool.call(addr, "get", args)
        with pytest.raises(InvalidArgument, match="meta"):
            await pool.call(addr, "put", {"volume": "v", "key": good, "index": 0, "meta": b"x" * 5000},
                            payload=b"data")
        assert (await pool.call(addr, "stats")).result["id"] == "dn0"


async def test_replicas_are_read_from_the_nearest_zone_first(cluster: Datanodes, volume: str) -> None:
    view = cluster.view({volume: VolumePolicy.parse("replica:3")})
    key, data = new_key(), os.urandom(300_000)
    async with RpcPool(secret=SECRET) as pool:
        await BackingClient(pool, view).put_block(volume, key, data)
        pg = view.placement(volume, key)
        zones = {view.datanodes[n].zone: n for n in pg}
        assert sorted(zones) == ["a", "b", "c"]  # one replica per zone
        client = BackingClient(pool, view, zone="c", hedge_min=5.0, hedge_max=5.0)
        for z in ("a", "b"):
            cluster.pause(int(zones[z][2:]))
        try:
            with trio.fail_after(4.5):  # before any hedge: only the zone-c replica was asked
                assert await client.get_block(volume, key) == data
                assert await client.get_block(volume, key, 1000, 10) == data[1000:1010]
        finally:
            for z in ("a", "b"):
                cluster.resume(int(zones[z][2:]))
        assert client.stats["hedged"] == 0


async def test_losing_a_whole_zone_loses_nothing(cluster: Datanodes, volume: str) -> None:
    """6 datanodes in 3 zones: every PG spreads its shards 2-2-2 (ec:4+2) or 1-1-1 (replica:3)."""
    volumes = {volume: VolumePolicy.parse("ec:4+2"), volume + "r": VolumePolicy.parse("replica:3")}
    view = cluster.view(volumes, pg_count=32)
    blocks = {name: {new_key(): os.urandom(random.randrange(200_000)) for _ in range(12)} for name in volumes}
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, view, timeout=3.0)
        for name, items in blocks.items():
            for key, data in items.items():
                await client.put_block(name, key, data)
        cluster.kill(2)
        cluster.kill(3)  # zone b is gone
        for name, items in blocks.items():
            for key, data in items.items():
                assert await client.get_block(name, key) == data


async def test_a_put_leaves_its_shards_to_reference_counting(cluster: Datanodes, volume: str, monkeypatch) -> None:
    """Nothing of a stored block waits for the cyclic collector: a mount
    makes and drops shards at hundreds of MB/s, and shards kept in a cycle
    (put_block's closures once formed one) held tens of MiB of its heap
    until a full collection ran."""
    import gc
    import sys

    from cachefs.backing.codec import Codec

    made: list[bytes] = []
    encode = Codec.encode

    def keep(self: Codec, data: bytes | bytearray | memoryview) -> tuple[object, list[bytes]]:
        header, shards = encode(self, data)
        made.extend(shards)
        return header, shards

    monkeypatch.setattr(Codec, "encode", keep)
    pol = VolumePolicy.parse("ec:2+1", block_size=4 * MiB)
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, cluster.view({volume: pol}))
        gc.disable()
        try:
            await client.put_block(volume, new_key(), os.urandom(MiB))
            assert len(made) == 3
            # Ours in ``made``, and getrefcount's argument: no one else's.
            assert [sys.getrefcount(made[i]) for i in range(3)] == [2, 2, 2]
        finally:
            gc.enable()
