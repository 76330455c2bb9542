"""The cache tier's hit rate on a working set larger than one zone's capacity.

A lab with two zones of one cache node each (``--capacity`` each), every
client in zone z1: a file of ``--ratio`` times one zone's capacity (between
one zone's capacity and the whole tier's) is written (blocks only on backing
storage) and read twice through the native API with no L1 and no L2, so
every block is asked of the tier. The hit rate of the second pass is the
share of its block reads that no cache node had to fetch from backing
storage (``backing_fetches`` of every node, before and after).

With the zones cooperating (:mod:`cachefs.cachenode.peers`) the second pass
finds every block in the tier; with per-zone rings alone, z1's node cycles
through the working set with LRU and finds none.

    python -m bench.tier_bench [--json] [--capacity 64M] [--ratio 1.5]
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
BLOCK = 4 * MiB


async def _backing_fetches(lab: Any) -> dict[str, dict[str, Any]]:
    from cachefs.rpc import RpcPool

    async with RpcPool(secret=lab.credential("admin")) as pool:
        return {
            n.name: (await pool.call(n.addr, "stats", timeout=10)).result
            for n in lab.of_kind("cachenode")
        }


async def _passes(lab: Any, size: int) -> list[dict[str, Any]]:
    """Write the file, then read it twice; the tier's counters after each step."""
    from cachefs.client.api import open_volume
    from cachefs.client.volume import ClientOptions

    options = ClientOptions(l1_bytes=0, readahead_max=2 * BLOCK)
    with trio.fail_after(30):  # every node has seen the other zone in its map
        while any(s.get("peer_zones", 0) < 1 for s in (await _backing_fetches(lab)).values()):  # noqa: ASYNC110 - polling other processes
            await trio.sleep(0.2)
    steps = []
    async with open_volume(lab.meta_addrs, "lab", secret=lab.credential("client"), zone="z1", options=options) as fs:
        data = bytes(range(256)) * (size // 256)
        await fs.write_bytes("/ws", data)
        steps.append(await _backing_fetches(lab))
        for _ in range(2):
            before = fs.stats()["backing_reads"]
            if await fs.read_bytes("/ws") != data:
                raise RuntimeError("the working set read back wrong")
            steps.append(await _backing_fetches(lab))
            steps[-1]["client"] = {"backing_fetches": fs.stats()["backing_reads"] - before, "blocks": 0}
    return steps


def measure(capacity: int = 64 * MiB, ratio: float = 1.5, workdir: str | None = None) -> dict[str, Any]:
    from cachefs.lab.cluster import Lab, LabConfig
    from cachefs.testing.ports import free_lab_base

    root = Path(tempfile.mkdtemp(prefix="tier-bench-", dir=workdir))
    config = LabConfig(root=str(root), metanodes=1, datanodes=3, cachenodes=2, zones=2, policy="ec:2+1",
                       metrics=False, data_capacity="4G", cache_capacity=str(capacity), cache_memory="0")  # fmt: skip
    config.base_port = free_lab_base(config)
    lab = Lab(config)
    size = int(capacity * ratio) // BLOCK * BLOCK
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lab.up(timeout=120)
        written, first, second = trio.run(_passes, lab, size)
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lab.down()
    blocks = size // BLOCK

    def fetched(a: dict[str, Any], b: dict[str, Any]) -> int:
        """Backing reads between two steps: the cache nodes' fills and the
        client's own (a cache node that did not answer in time)."""
        nodes = sum(b[n]["backing_fetches"] - a[n]["backing_fetches"] for n in a if n != "client")
        return nodes + b["client"]["backing_fetches"]

    def held(s: dict[str, Any]) -> dict[str, int]:
        return {n: v["blocks"] for n, v in s.items() if n != "client"}

    return {
        "zone_capacity_bytes": capacity,
        "working_set_bytes": size,
        "blocks": blocks,
        "first_pass_backing_fetches": fetched({**written, "client": {}}, first),
        "second_pass_backing_fetches": fetched(first, second),
        "blocks_held_per_node": held(second),
        "client_backing_reads": [first["client"]["backing_fetches"], second["client"]["backing_fetches"]],
        "peer_counters": {k: sum(s.get(k, 0) for s in second.values())
                          for k in ("peer_hits", "peer_misses", "peer_errors", "peer_puts")},  # fmt: skip
        "tier_hit_rate_two_zone_working_set": round(1 - fetched(first, second) / blocks, 3),
    }


def main(argv: list[str] | None = None) -> None:
    from cachefs.config import parse_size

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacity", default="64M", help="flash capacity of each cache node (one per zone)")
    parser.add_argument("--ratio", type=float, default=1.5, help="working set / one zone's capacity (1-2)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(parse_size(args.capacity), args.ratio, args.workdir)

    def show() -> None:
        print_table("Cache tier, working set between one zone and the tier", ["measure", "value"],
                    [[k, v] for k, v in result.items()])  # fmt: skip

    emit(result, args.json, show)


if __name__ == "__main__":
    sys.exit(main())
