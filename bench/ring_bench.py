"""The cache tier's hit rate right after a cache node joins a warm zone.

A lab with one zone of three cache nodes: a file is written and read twice
through the native API (no L1, no L2: every block is asked of the tier), so
the zone is warm. A fourth cache node then joins the zone, and a new client
(which routes by the map that lists it) reads the file again. The hit rate of
that read is the share of its blocks that no cache node and no client had to
fetch from backing storage. Run once with the handoff (``cachefs cachenode
--handoff-window``, :mod:`cachefs.cachenode.peers`) and once without
(``--handoff-window 0``): without it about a quarter of the keys move to an
empty node and miss.

    python -m bench.ring_bench [--json] [--blocks 40]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import trio

from bench.common import emit, print_table

MiB = 1 << 20
BLOCK = 4 * MiB  # the lab volume's block size


async def _node_stats(lab: Any) -> dict[str, dict[str, Any]]:
    """Every started cache node's counters (none yet for one still starting)."""
    from cachefs.errors import CacheFSError
    from cachefs.rpc import RpcPool

    out = {}
    async with RpcPool(secret=lab.credential("admin")) as pool:
        for n in lab.of_kind("cachenode"):
            try:
                out[n.name] = (await pool.call(n.addr, "stats", timeout=10)).result
            except CacheFSError:
                if n.name != lab.of_kind("cachenode")[-1].name:  # only the joining one may not answer yet
                    raise
    return out


def _fetched(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> int:
    return sum(after[n]["backing_fetches"] - before.get(n, {}).get("backing_fetches", 0) for n in after)


async def _read(lab: Any, data: bytes) -> int:
    """One read of /ring by a new client: the blocks it read from backing storage itself."""
    from cachefs.client.api import open_volume
    from cachefs.client.volume import ClientOptions

    options = ClientOptions(l1_bytes=0, readahead_max=2 * BLOCK)
    async with open_volume(lab.meta_addrs, "lab", secret=lab.credential("client"), zone="z1", options=options) as fs:
        if await fs.read_bytes("/ring") != data:
            raise RuntimeError("the file read back wrong")
        return fs.stats()["backing_reads"]


async def _run(lab: Any, joining: Any, blocks: int) -> dict[str, Any]:
    from cachefs.client.api import open_volume

    data = bytes(range(256)) * (blocks * BLOCK // 256)
    async with open_volume(lab.meta_addrs, "lab", secret=lab.credential("client"), zone="z1") as fs:
        await fs.write_bytes("/ring", data)
    await _read(lab, data)  # cold: fills the three nodes
    warm_before = await _node_stats(lab)
    warm_client = await _read(lab, data)
    warm = 1 - (_fetched(warm_before, await _node_stats(lab)) + warm_client) / blocks
    with trio.fail_after(10):  # the heartbeats have told the map what each node holds
        await _wait_used(lab)
    lab.config.nodes.append(joining)
    lab.start(joining.name)
    with trio.fail_after(60):  # the new node is up in the map, and its own ring lists it
        while (await _node_stats(lab)).get(joining.name, {}).get("zone_nodes", 0) < 4:  # noqa: ASYNC110 - polling other processes
            await trio.sleep(0.2)
    before = await _node_stats(lab)
    client = await _read(lab, data)
    after = await _node_stats(lab)
    return {
        "blocks": blocks,
        "hit_rate_warm_three_nodes": round(warm, 3),
        "hit_rate_right_after_join": round(1 - (_fetched(before, after) + client) / blocks, 3),
        "blocks_on_joined_node": after[joining.name]["blocks"],
        "handoff_hits": sum(s.get("handoff_hits", 0) for s in after.values()),
    }


async def _wait_used(lab: Any) -> None:
    from cachefs import queries as Q
    from cachefs.rpc import RpcPool

    async with RpcPool(secret=lab.credential("admin")) as pool:
        meta = lab.meta_client(pool)
        while not all(n.get("used", 0) > 0 for n in (await meta.query(Q.ClusterMap()))["cachenodes"]):  # noqa: ASYNC110 - polling other processes
            await trio.sleep(0.2)


def measure(blocks: int = 40, handoff: bool = True, workdir: str | None = None) -> dict[str, Any]:
    from cachefs.lab.cluster import Lab, LabConfig
    from cachefs.testing.ports import free_lab_base

    root = Path(tempfile.mkdtemp(prefix="ring-bench-", dir=workdir))
    config = LabConfig(root=str(root), metanodes=1, datanodes=3, cachenodes=4, zones=1, policy="ec:2+1",
                       metrics=False, data_capacity="4G", cache_capacity="1G", cache_memory="0",
                       cachenode_options=[] if handoff else ["--handoff-window", "0"])  # fmt: skip
    config.base_port = free_lab_base(config)
    lab = Lab(config)
    joining = lab.config.nodes.pop()  # cache4 joins later
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lab.up(timeout=120)
        result = trio.run(_run, lab, joining, blocks)
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lab.down()
    return {"handoff": handoff, **result}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=40, help="blocks of 4 MiB in the file")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = [measure(args.blocks, handoff, args.workdir) for handoff in (False, True)]

    def show() -> None:
        keys = list(results[0])
        print_table("Hit rate right after a cache node joins a warm zone of three", ["measure", "no handoff", "handoff"],
                    [[k, results[0][k], results[1][k]] for k in keys])  # fmt: skip

    emit(results, args.json, show)


if __name__ == "__main__":
    sys.exit(main())
