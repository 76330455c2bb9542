"""Datanodes registering with a real metanode; the client and repair reading the cluster map."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.backing.client import BackingClient
from cachefs.backing.cluster import MetaClusterView
from cachefs.ids import BlockKey
from cachefs.metanode.client import MetaClient
from cachefs.rpc import RpcPool
from cachefs.testing.datanodes import Datanodes
from cachefs.testing.metacluster import MetaCluster

from .conftest import ZONES


async def _wait(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await trio.sleep(0.2)


async def test_registration_heartbeats_and_cluster_map(tmp_path: Path) -> None:
    meta = MetaCluster(tmp_path, n=1)
    meta.start_all()
    nodes = Datanodes(tmp_path, ZONES, insecure=True,
                      extra=["--meta", meta.addrs[0], "--heartbeat", "0.3"])
    try:
        async with RpcPool(secret=None) as pool:
            await meta.wait_leader(pool)
            nodes.start()
            mc = MetaClient(pool, meta.addrs)
            await mc.mutate(C.CreateVolume("data", "ec:4+2", pg_count=16))

            async def placed() -> bool:
                cmap = await mc.query(Q.ClusterMap())
                up = [d for d in cmap["datanodes"] if d["state"] == "up"]
                return len(up) == 6 and len(cmap["pgs"].get("data", [])) == 16

            await _wait(placed)
            view = MetaClusterView(mc)  # not fetched yet: the client refreshes it
            client = BackingClient(pool, view, zone="a")
            blocks = {BlockKey(77, i): os.urandom(200_000 + i) for i in range(6)}
            for key, data in blocks.items():
                await client.put_block("data", key, data)
            assert {d.addr for d in view.datanodes.values()} == {nodes.addr(i) for i in range(6)}
            for key, data in blocks.items():
                assert await client.get_block("data", key) == data

            async def usage_reported() -> bool:
                cmap = await mc.query(Q.ClusterMap())
                return all(d["used"] > 0 for d in cmap["datanodes"])

            await _wait(usage_reported)

            # An operator removes a datanode that is still alive: it registers again.
            await mc.mutate(C.RemoveNode("datanode", "dn5"))

            async def back() -> bool:
                cmap = await mc.query(Q.ClusterMap())
                return any(d["id"] == "dn5" and d["state"] == "up" for d in cmap["datanodes"])

            await _wait(back)

            # Wipe one datanode; `cachefs repair --meta` rebuilds it from the cluster map.
            nodes.kill(4)
            nodes.wipe(4)
            nodes.start(4)
            result = await trio.run_process(
                [sys.executable, "-m", "cachefs.cli", "repair", "--meta", meta.addrs[0], "--insecure"],
                capture_stdout=True, capture_stderr=True, check=False)
            assert result.returncode == 0, result.stderr.decode()
            assert b"data: healthy" in result.stdout
            assert nodes.shard_files(4, "data")
    finally:
        nodes.stop_all()
        meta.stop_all()


async def test_datanode_serves_without_metanodes(tmp_path: Path) -> None:
    """An unreachable --meta only costs a logged warning, never service."""
    nodes = Datanodes(tmp_path, ["a"], insecure=True, extra=["--meta", "127.0.0.1:9", "--heartbeat", "0.2"])
    nodes.start()
    try:
        async with RpcPool(secret=None) as pool:
            stats = (await pool.call(nodes.addr(0), "stats")).result
            assert stats["id"] == "dn0" and stats["zone"] == "a"

        async def warned() -> bool:
            return b"metanodes not reachable" in (tmp_path / "dn0.log").read_bytes()

        await _wait(warned, timeout=20)
        async with RpcPool(secret=None) as pool:  # and still serving after the retries
            assert (await pool.call(nodes.addr(0), "stats")).result["shards"] == 0
    finally:
        nodes.stop_all()


def test_bad_options_are_named(tmp_path: Path) -> None:
    import subprocess

    base = [sys.executable, "-m", "cachefs.cli", "datanode", "--insecure", "--data-dir", str(tmp_path / "d")]
    for args, fragment in [
        (["--zone", "a", "--capacity", "lots"], b"--capacity"),
        (["--zone", "a/b", "--capacity", "1G"], b"--zone"),
        (["--zone", "a", "--capacity", "1G", "--listen", "nope"], b"--listen"),
        (["--capacity", "1G"], b"--zone"),
    ]:
        result = subprocess.run(base + args, capture_output=True, timeout=60)
        assert result.returncode == 2 and fragment in result.stderr, result.stderr
