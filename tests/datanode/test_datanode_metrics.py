"""A datanode times its shard reads and writes and counts what scrub verified."""

from __future__ import annotations

import inspect
from pathlib import Path

from prometheus_client import REGISTRY

from cachefs.datanode.service import DatanodeService
from cachefs.datanode.shardstore import ShardStore
from cachefs.ids import BlockKey


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_shard_io_latency_and_scrub_progress(tmp_path: Path) -> None:
    service = DatanodeService(ShardStore(tmp_path, 1 << 30), "d1", "z1")
    before = {op: _sample("cachefs_datanode_shard_io_seconds_count", op=op) for op in ("get", "put")}
    scrubbed, scrubbed_bytes = _sample("cachefs_datanode_scrubbed_shards_total"), \
        _sample("cachefs_datanode_scrubbed_bytes_total")
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
    page = await service.scrub("v")
    assert page["checked"] == 3 and not page["corrupt"]
    assert _sample("cachefs_datanode_scrubbed_shards_total") == scrubbed + 3
    assert _sample("cachefs_datanode_scrubbed_bytes_total") == scrubbed_bytes + page["bytes"] > scrubbed_bytes
