"""Range reads remember block headers: short and compressed blocks cost one round of shard reads."""

from __future__ import annotations

import os
from typing import Any

from cachefs.backing.client import BackingClient
from cachefs.backing.policy import VolumePolicy
from cachefs.rpc import RpcPool
from cachefs.testing.datanodes import SECRET, Datanodes

from .test_backing import new_key


class CountingClient(BackingClient):
    """The real client, counting the shard reads it sends (never hedging, so
    a slow machine adds no reads to the count)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, hedge_min=60.0, hedge_max=60.0, **kwargs)
        self.shard_reads = 0

    async def read_shard(self, *args: Any, **kwargs: Any) -> Any:
        self.shard_reads += 1
        return await super().read_shard(*args, **kwargs)

    async def reads_for(self, volume: str, key: Any, offset: int, length: int) -> tuple[bytes, int]:
        before = self.shard_reads
        data = await self.get_block(volume, key, offset, length)
        return data, self.shard_reads - before


async def test_short_block_range_needs_one_round_once_its_header_is_known(cluster: Datanodes,
                                                                          volume: str) -> None:
    view = cluster.view({volume: VolumePolicy.parse("ec:4+2")})
    data = os.urandom(100_000)  # 25 KB per data shard, not the 1 MiB of a full block
    key = new_key()
    async with RpcPool(secret=SECRET) as pool:
        client = CountingClient(pool, view)
        await client.put_block(volume, key, data)
        client._headers.clear()  # as a reader that did not write the block
        got, first = await client.reads_for(volume, key, 60_000, 1000)  # in data shard 2
        assert got == data[60_000:61_000]
        assert first == 2  # guessed shard 0 (full-block layout), then the right one
        got, again = await client.reads_for(volume, key, 80_000, 1000)
        assert got == data[80_000:81_000] and again == 1
        assert client.stats["range_fallbacks"] == 0


async def test_compressed_block_range_goes_straight_to_the_whole_block(cluster: Datanodes,
                                                                       volume: str) -> None:
    view = cluster.view({volume: VolumePolicy.parse("ec:4+2", compression="zstd")})
    data = b"compressible " * 20_000
    key = new_key()
    async with RpcPool(secret=SECRET) as pool:
        client = CountingClient(pool, view)
        await client.put_block(volume, key, data)
        client._headers.clear()
        got, first = await client.reads_for(volume, key, 1000, 500)
        assert got == data[1000:1500] and first == 1 + 4  # a range guess, then the K data shards
        got, again = await client.reads_for(volume, key, 2000, 500)
        assert got == data[2000:2500] and again == 4
        assert client.stats["range_fallbacks"] == 2
