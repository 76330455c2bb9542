"""Scrub's read-rate limit (`cachefs repair --scrub --max-rate`) against real datanodes."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import trio

from cachefs.backing.client import BackingClient
from cachefs.backing.policy import VolumePolicy
from cachefs.rpc import RpcPool
from cachefs.testing.datanodes import SECRET, Datanodes

from .test_backing import new_key


async def _fill(cluster: Datanodes, volume: str, blocks: int, size: int) -> int:
    """Write ``blocks`` blocks under ec:2+1; returns the bytes of their shard files."""
    view = cluster.view({volume: VolumePolicy.parse("ec:2+1")}, pg_count=8)
    async with RpcPool(secret=SECRET) as pool:
        client = BackingClient(pool, view)
        for _ in range(blocks):
            await client.put_block(volume, new_key(), os.urandom(size))
    return sum(p.stat().st_size for i in range(len(cluster.zones)) for p in cluster.shard_files(i, volume))


async def test_scrub_pages_stop_at_max_bytes_and_resume(cluster: Datanodes, volume: str) -> None:
    """A page capped at one byte checks one shard; the cursor walks every shard exactly once."""
    await _fill(cluster, volume, 8, 50_000)
    async with RpcPool(secret=SECRET) as pool:
        for i in range(len(cluster.zones)):
            files = cluster.shard_files(i, volume)
            cursor, checked, read, pages = "", 0, 0, 0
            while True:
                reply = await pool.call(cluster.addr(i), "scrub",
                                        {"volume": volume, "cursor": cursor, "max_bytes": 1})
                assert reply.result["checked"] <= 1 and not reply.result["corrupt"]
                checked += reply.result["checked"]
                read += reply.result["bytes"]
                pages += 1
                cursor = reply.result["cursor"]
                if not cursor:
                    break
                assert pages <= len(files) + 1
            assert checked == len(files)
            assert read == sum(p.stat().st_size for p in files)


async def test_repair_max_rate_bounds_scrub_reads(cluster: Datanodes, volume: str, tmp_path: Path) -> None:
    """`--max-rate R` over B bytes takes at least B/R less the throttle's 0.5 s burst."""
    total = await _fill(cluster, volume, 12, 120_000)
    rate = 1 << 20
    assert total / rate >= 1.5  # the bound below is then well clear of zero
    view = cluster.view({volume: VolumePolicy.parse("ec:2+1")}, pg_count=8)
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps(view.to_map()))
    started = time.monotonic()
    result = await trio.run_process(
        [sys.executable, "-m", "cachefs.cli", "repair", "--cluster-file", str(cluster_file),
         "--secret-file", str(cluster.secret_file), "--volume", volume, "--scrub",
         "--max-rate", "1M", "--json"], capture_stdout=True, capture_stderr=True, check=False)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr.decode()
    (report,) = json.loads(result.stdout)["volumes"]
    assert report["healthy"] and report["shards_corrupt"] == 0
    assert report["bytes_scrubbed"] == total
    assert elapsed >= total / rate - 0.5, (elapsed, total)
