"""A datanode times its shard reads and writes, reports used and capacity, counts
what scrub verified and the corrupt shards it found."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from cachefs.datanode.service import DatanodeService
from cachefs.datanode.shardstore import ShardStore
from cachefs.ids import BlockKey


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.allow_log("cachefs.datanode.shardstore", "corrupt shard")
async def test_shard_io_latency_capacity_scrub_progress_and_corrupt_shards(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, 1 << 30)
    service = DatanodeService(store, "d1", "z1")
    before = {op: _sample("cachefs_datanode_shard_io_seconds_count", op=op) for op in ("get", "put")}
    scrubbed, scrubbed_bytes = _sample("cachefs_datanode_scrubbed_shards_total"), \
        _sample("cachefs_datanode_scrubbed_bytes_total")
    corrupt = _sample("cachefs_datanode_corrupt_shards_found_total")
    keys = [BlockKey(7, i).to_bytes() for i in range(3)]
    for key in keys:
        await service.put("v", key, 0, b"m", payload=b"x" * 1000)
    reply = service.get("v", keys[0], 0)  # a plain method: a Reply when it read inline
    if inspect.isawaitable(reply):
        reply = await reply
    assert bytes(reply.payload) == b"x" * 1000
    assert _sample("cachefs_datanode_shard_io_seconds_count", op="put") == before["put"] + 3
    assert _sample("cachefs_datanode_shard_io_seconds_count", op="get") == before["get"] + 1
    assert _sample("cachefs_datanode_shard_io_seconds_sum", op="put") > 0
    assert _sample("cachefs_datanode_capacity_bytes") == 1 << 30
    assert _sample("cachefs_datanode_used_bytes") == store.used >= 3000 and _sample("cachefs_datanode_shards") == 3
    page = await service.scrub("v")
    assert page["checked"] == 3 and not page["corrupt"]
    assert _sample("cachefs_datanode_scrubbed_shards_total") == scrubbed + 3
    assert _sample("cachefs_datanode_scrubbed_bytes_total") == scrubbed_bytes + page["bytes"] > scrubbed_bytes
    shard = store._path("v", BlockKey(7, 2).hex(), 0)
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(raw)
    page = await service.scrub("v")
    assert page["corrupt"] and _sample("cachefs_datanode_corrupt_shards_found_total") == corrupt + 1
    assert _sample("cachefs_datanode_shards") == 2
