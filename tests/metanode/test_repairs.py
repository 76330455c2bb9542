"""The leader's repair service: blocks written while datanodes were down come back
to full redundancy on their own (issue 14, item 2)."""

from __future__ import annotations

import math
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from cachefs import queries as Q
from cachefs.backing.client import BackingClient
from cachefs.backing.cluster import MetaClusterView
from cachefs.backing.gc import record_block_keys
from cachefs.client.api import connect
from cachefs.ids import CHUNK_SIZE, BlockKey
from cachefs.lab.cluster import Lab
from cachefs.rpc import RpcPool
from cachefs.testing.labs import running_lab

pytestmark = [pytest.mark.slow]

BOUND = 60.0  # seconds from the datanode's return to full redundancy


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    with running_lab(tmp_path / "lab", datanodes=4, cachenodes=0, zones=2, policy="ec:2+2",
                     metrics=True) as lab:  # fmt: skip
        yield lab


def _under_replicated(lab: Lab) -> float | None:
    """The metanode's ``cachefs_blocks_under_replicated`` for the lab volume (None
    until the repair service's first pass exports it)."""
    node = lab.of_kind("metanode")[0]
    text = urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith('cachefs_blocks_under_replicated{volume="lab"}'):
            return float(line.split()[-1])
    return None


async def _queue(lab: Lab) -> list:
    async with RpcPool(secret=lab.secret) as pool:
        return await lab.meta_client(pool).query(Q.ListRepairs("lab", 100_000))


async def _blocks(lab: Lab, files: dict[str, bytes]) -> set[BlockKey]:
    """Every block the files' slice lists reference."""
    keys: set[BlockKey] = set()
    async with RpcPool(secret=lab.secret) as pool:
        meta = lab.meta_client(pool)
        for path, data in files.items():
            attr = await meta.query(Q.Lookup("lab", 1, path.strip("/").encode()))
            for chunk in range(math.ceil(len(data) / CHUNK_SIZE)):
                for piece in await meta.query(Q.ReadChunk("lab", attr.ino, chunk)):
                    keys |= record_block_keys(piece, 4 << 20)
    return keys


async def _check_full_redundancy(lab: Lab, keys: set[BlockKey]) -> None:
    """Each shard is on its PG member, intact, and any K of them decode to the same block."""
    async with RpcPool(secret=lab.secret) as pool:
        view = MetaClusterView(lab.meta_client(pool))
        await view.refresh()
        client = BackingClient(pool, view)
        policy = view.policy("lab")
        codec = client.codec(policy)
        for key in sorted(keys):
            pg = view.placement("lab", key)
            shards = {i: await client.read_shard(pg[i], "lab", key, i) for i in range(policy.n)}
            header = shards[0].header
            whole = codec.decode(header, {i: s.data for i, s in shards.items()})
            for left_out in range(policy.n):  # so parity is checked too
                subset = {i: s.data for i, s in shards.items() if i != left_out}
                assert codec.decode(header, subset) == whole, f"{key.hex()} without shard {left_out}"
        stored = 0  # and the handed-off copies are gone: N shards per block, no more
        for node in view.datanodes.values():
            reply = await pool.call(node.addr, "list", {"volume": "lab", "cursor": "", "limit": 100_000})
            stored += len(reply.result["shards"])
        assert stored == len(keys) * policy.n


def test_blocks_written_with_m_datanodes_down_are_repaired_without_an_operator(lab: Lab) -> None:
    """ec:2+2 on 4 datanodes, M = 2 of them down (one per zone): puts hand the
    missing shards off to the two left (two shards each: losing either still
    leaves K). Once they are back, the leader's repair service moves every
    shard home and the queue drains, within BOUND seconds."""
    for name in ("data3", "data4"):
        lab.kill(name)
    files = {"/big": os.urandom(9 << 20), "/small": os.urandom(100_000), "/two": os.urandom(5 << 20)}
    with connect(lab.meta_addrs, "lab", secret=lab.secret, zone="z1") as fs:
        for path, data in files.items():
            fs.write_bytes(path, data)
    keys = trio.run(_blocks, lab, files)
    queued = {BlockKey(e.slice_id, e.index) for e in trio.run(_queue, lab)}
    assert queued == keys  # every block was stored short, and the commits said so
    deadline = time.monotonic() + 10
    while _under_replicated(lab) != len(keys):  # the gauge follows the queue each pass
        assert time.monotonic() < deadline, _under_replicated(lab)
        time.sleep(0.2)

    lab.start("data3")
    lab.start("data4")
    started = time.monotonic()
    while trio.run(_queue, lab):
        assert time.monotonic() - started < BOUND, f"{len(trio.run(_queue, lab))} blocks still queued"
        time.sleep(0.2)
    took = time.monotonic() - started
    trio.run(_check_full_redundancy, lab, keys)
    print(f"{len(keys)} blocks back to full redundancy {took:.1f}s after the datanode returned")
    deadline = time.monotonic() + 10
    while _under_replicated(lab) != 0:
        assert time.monotonic() < deadline
        time.sleep(0.2)
