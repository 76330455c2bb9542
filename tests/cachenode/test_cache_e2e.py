"""The whole cache tier with real processes: metanode, datanodes, cache nodes and `cachefs warmup`.

Cache nodes register in the cluster map and heartbeat; files are written the
way the client writes them (blocks to backing storage, then the slice to the
metanodes); `cachefs warmup` resolves a tree through the metanodes and fills
the owning cache node of every zone; afterwards every read of the tree is a hit.
"""

from __future__ import annotations

import random
import stat
import subprocess
import sys
import time
from pathlib import Path

import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.backing.client import BackingClient
from cachefs.backing.cluster import ClusterView
from cachefs.ids import BlockKey
from cachefs.metanode.client import MetaClient
from cachefs.ring import CacheRouter
from cachefs.rpc import RpcPool
from cachefs.testing.metacluster import MetaCluster
from cachefs.testing.ports import free_port

from .test_cache_daemon import Node

BS = 64 * 1024
VOLUME = "warm"


class Datanode:
    def __init__(self, root: Path, i: int, zone: str, meta: str) -> None:
        self.log = root / f"dn{i}.log"
        self.addr = f"127.0.0.1:{free_port()}"
        self.args = [
            sys.executable,
            "-m",
            "cachefs.cli",
            "datanode",
            "--zone",
            zone,
            "--data-dir",
            str(root / f"dn{i}"),
            "--capacity",
            "1G",
            "--listen",
            self.addr,
            "--meta",
            meta,
            "--node-id",
            f"dn{i}",
            "--heartbeat",
            "0.5",
            "--insecure",
            "--log-level",
            "WARNING",
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=log)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


async def _until(what: str, check, timeout: float = 120.0):  # type: ignore[no-untyped-def]
    """The first true value of ``check()``; ``timeout`` is a hang guard (under load the
    daemons alone can take 20 s and more to start and register)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await trio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


async def _write_file(
    mc: MetaClient, backing: BackingClient, parent: int, name: str, data: bytes
) -> list[BlockKey]:
    """What the client does on close(): blocks to backing storage, then the slice."""
    attr = await mc.mutate(C.Mknod(VOLUME, parent, name.encode(), stat.S_IFREG | 0o644))
    if not data:
        return []
    slice_id = await mc.mutate(C.AllocSlices(1))
    keys = []
    for i, start in enumerate(range(0, len(data), BS)):
        key = BlockKey(slice_id, i)
        await backing.put_block(VOLUME, key, data[start : start + BS])
        keys.append(key)
    await mc.mutate(C.WriteSlice(VOLUME, attr.ino, 0, slice_id, 0, len(data), 0, time.time_ns()))
    return keys


async def _warmup(meta_addr: str) -> str:
    result = await trio.run_process(
        [
            sys.executable,
            "-m",
            "cachefs.cli",
            "warmup",
            "/data",
            "--volume",
            VOLUME,
            "--meta",
            meta_addr,
            "--insecure",
            "--threads",
            "4",
        ],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    return out


async def test_registration_warmup_and_hits(tmp_path: Path) -> None:
    meta = MetaCluster(tmp_path, n=1)
    meta_addr = meta.addrs[0]
    datanodes = [Datanode(tmp_path, i, z, meta_addr) for i, z in enumerate("abc")]
    caches = [
        Node(
            tmp_path / f"cache-{z}",
            z,
            "32M",
            ("--meta", meta_addr, "--node-id", f"cn-{z}", "--heartbeat", "0.5"),
        )
        for z in "ab"
    ]
    rng = random.Random(8)
    try:
        meta.start_all()
        for dn in datanodes:
            dn.start()
        async with RpcPool(secret=None) as pool:
            await meta.wait_leader(pool)
            mc = MetaClient(pool, meta.addrs)

            async def datanodes_up():  # type: ignore[no-untyped-def]
                return len((await mc.query(Q.ClusterMap()))["datanodes"]) == 3

            await _until("datanodes to register", datanodes_up)
            await mc.mutate(C.CreateVolume(VOLUME, "ec:2+1", block_size=BS, pg_count=8))
            for node in caches:
                node.start()

            async def caches_up():  # type: ignore[no-untyped-def]
                cmap = await mc.query(Q.ClusterMap())
                used = {n["id"]: n for n in cmap["cachenodes"]}
                return cmap if set(used) == {"cn-a", "cn-b"} else None

            cmap = await _until("cache nodes to register", caches_up)
            assert {(n["id"], n["zone"], n["addr"], n["capacity"]) for n in cmap["cachenodes"]} == {
                ("cn-a", "a", caches[0].addr, 32 << 20),
                ("cn-b", "b", caches[1].addr, 32 << 20),
            }
            backing = BackingClient(pool, ClusterView.from_map(cmap))
            root = 1
            data_dir = (await mc.mutate(C.Mkdir(VOLUME, root, b"data", stat.S_IFDIR | 0o755))).ino
            sub = (await mc.mutate(C.Mkdir(VOLUME, data_dir, b"sub", stat.S_IFDIR | 0o755))).ino
            other = (await mc.mutate(C.Mkdir(VOLUME, root, b"other", stat.S_IFDIR | 0o755))).ino
            contents: dict[BlockKey, bytes] = {}
            for parent, name, size in [
                (data_dir, "a", 3 * BS + 123),
                (sub, "b", BS),
                (sub, "c", 10),
                (data_dir, "empty", 0),
            ]:
                data = rng.randbytes(size)
                for i, key in enumerate(await _write_file(mc, backing, parent, name, data)):
                    contents[key] = data[i * BS : (i + 1) * BS]
            cold = await _write_file(mc, backing, other, "cold", rng.randbytes(100))

            first = await _warmup(meta_addr)
            assert (
                "4 files, 12 block copies" in first and f"{2 * len(contents)} fetched" in first
            ), first
            second = await _warmup(meta_addr)
            assert "everything was already cached" in second, second
            missing = await trio.run_process(
                [
                    sys.executable,
                    "-m",
                    "cachefs.cli",
                    "warmup",
                    "/data/nope",
                    "--volume",
                    VOLUME,
                    "--meta",
                    meta_addr,
                    "--insecure",
                ],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            assert missing.returncode != 0
            assert "/data/nope: no such file or directory" in missing.stderr.decode()

            router = CacheRouter(cmap, "a")
            for key, data in contents.items():
                for addr in router.candidates(key):  # both zones hold every block
                    reply = await pool.call(addr, "get", {"volume": VOLUME, "key": key.to_bytes()})
                    assert reply.result["hit"] and bytes(reply.payload) == data
            reply = await pool.call(
                router.candidates(cold[0])[0], "get", {"volume": VOLUME, "key": cold[0].to_bytes()}
            )
            assert reply.result["hit"] is False  # not under /data: read through on demand

            async def usage_reported():  # type: ignore[no-untyped-def]
                nodes = (await mc.query(Q.ClusterMap()))["cachenodes"]
                return all(n["used"] > 0 for n in nodes)

            await _until("cache usage in heartbeats", usage_reported)
    finally:
        for node in caches:
            node.kill()
        for dn in datanodes:
            dn.kill()
        meta.stop_all()
