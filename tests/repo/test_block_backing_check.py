"""``cachefs fsck`` and ``cachefs info`` on a volume whose blocks are objects, on SeaweedFS.

The real metanode service over real RPC, the real backing client and a real
S3 server: a healthy volume checks healthy with every object read against
the checksum in its metadata; then one object is deleted, one overwritten
with other bytes, one stripped of its checksum and one leaked slice sealed,
and fsck names the three damaged files with their byte ranges and the orphan,
with a listing of several pages; ``--repair`` turns the lost ranges into
holes. ``info`` shows each block's object and names a missing one.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterator

import boto3
import pytest
import trio

from cachefs import commands as C
from cachefs.backing import objects
from cachefs.backing.client import BackingClient
from cachefs.backing.cluster import MetaClusterView
from cachefs.backing.fsck import Fsck
from cachefs.backing.objects import CHECKSUM
from cachefs.backing.repair import Repairer
from cachefs.cli.info import describe
from cachefs.ids import BlockKey
from cachefs.rpc import RpcPool
from cachefs.testing.metanode import local_metanode
from cachefs.testing.s3server import SeaweedS3

BS = 16 * 1024
VOL = "objfsck"
PREFIX = "fsck/"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    with SeaweedS3(tmp_path_factory.mktemp("weed")) as server:
        yield server


@pytest.fixture
def client(s3: SeaweedS3, monkeypatch: pytest.MonkeyPatch):
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(objects, "LIST_PAGE", 4)  # several pages for a dozen objects
    # a session of its own: boto3.client() would reuse the default session, whose
    # credentials an earlier test of this process resolved from other keys
    c = boto3.session.Session().client("s3", endpoint_url=s3.endpoint)
    c.create_bucket(Bucket="blocks")
    return c


async def fsck_cli(meta_addr: str, *args: str) -> tuple[int, str]:
    out = await trio.run_process([sys.executable, "-m", "cachefs.cli", "fsck", VOL, "--meta", meta_addr,
                                  "--insecure", *args], capture_stdout=True, check=False)  # fmt: skip
    return out.returncode, out.stdout.decode()


@pytest.mark.allow_log("cachefs.backing.fsck", match=r"lost 1 range\(s\) of bytes, now holes")
async def test_fsck_and_info_check_every_block_s_object(s3: SeaweedS3, client) -> None:
    rng = random.Random(3)
    async with local_metanode() as meta, RpcPool(secret=None) as pool:
        await meta.service.mutate(C.CreateVolume(VOL, "replica:1", "none", BS, 8, backing=f"s3://blocks/{PREFIX}",
                                                 backing_endpoint=s3.endpoint, now_ns=time.time_ns()))  # fmt: skip
        mc = meta.client(pool)
        view = MetaClusterView(mc)
        backing = BackingClient(pool, view)
        keys: dict[str, list[BlockKey]] = {}
        for name, size in {"a": 3 * BS + 5, "b": 2 * BS, "c": BS, "d": 4 * BS}.items():
            attr = await mc.mutate(C.Mknod(VOL, 1, name.encode(), 0o100644))
            sid = await mc.mutate(C.AllocSlices(1))
            data = rng.randbytes(size)
            keys[name] = [BlockKey(sid, i // BS) for i in range(0, size, BS)]
            for key in keys[name]:
                await backing.put_block(VOL, key, data[key.index * BS:(key.index + 1) * BS])
            await mc.mutate(C.WriteSlice(VOL, attr.ino, 0, sid, 0, size, 0, time.time_ns()))
        fsck = Fsck(mc, Repairer(backing))

        report = await fsck.run(VOL)
        assert report.healthy and (report.store, report.files, report.blocks) == (f"s3://blocks/{PREFIX}", 4, 11)
        assert (report.shards_checked, report.shards_corrupt, report.orphan_blocks) == (11, 0, 0)
        info = await describe(pool, [meta.addr], VOL, "/a")
        assert info["backing"] == f"s3://blocks/{PREFIX}" and info["errors"] == []
        [chunk] = info["chunks"]
        got = [b["object"] for s in chunk["slices"] for b in s["blocks"]]
        assert [o["key"] for o in got] == [PREFIX + k.hex() for k in keys["a"]]
        assert [o["size"] for o in got] == [BS, BS, BS, 5] and all(len(o["checksum"]) > 0 for o in got)

        def obj(key: BlockKey) -> str:
            return PREFIX + key.hex()

        client.delete_object(Bucket="blocks", Key=obj(keys["a"][1]))  # a's bytes [BS, 2 BS)
        meta_b = client.head_object(Bucket="blocks", Key=obj(keys["b"][0]))["Metadata"]
        client.put_object(Bucket="blocks", Key=obj(keys["b"][0]), Body=b"x" * BS, Metadata=meta_b)
        client.put_object(Bucket="blocks", Key=obj(keys["c"][0]), Body=b"y" * BS)  # no checksum
        leaked = await mc.mutate(C.AllocSlices(1))  # a writer that died between its put and its commit
        await backing.put_block(VOL, BlockKey(leaked, 0), b"z" * BS)
        await meta.service.seal_slices(leaked + 1)

        report = await fsck.run(VOL, verify=False)  # the listing alone: the deleted block
        assert [(f.paths, f.ranges) for f in report.lost] == [(["/a"], [[BS, BS]])]
        assert report.orphans == [BlockKey(leaked, 0).hex()] and report.shards_checked == 0
        code, text = await fsck_cli(meta.addr)
        assert code == 1 and f"10 objects in s3://blocks/{PREFIX} verified (2 corrupt)" in text, text
        assert "lost (no object, or one failing its checksum): 3 files" in text
        assert f"orphans (objects of leaked slices; cachefs gc --delete removes them): 1\n    {leaked:016x}" in text
        report = await fsck.run(VOL)
        assert [(f.paths, f.ranges) for f in report.lost] == [(["/a"], [[BS, BS]]), (["/b"], [[0, BS]]),
                                                              (["/c"], [[0, BS]])]  # fmt: skip
        assert any(f"{keys['c'][0].hex()} in s3://blocks/{PREFIX} has no {CHECKSUM} metadata" in e
                   for e in report.errors)  # fmt: skip
        info = await describe(pool, [meta.addr], VOL, "/a")
        assert info["errors"] == [f"block {keys['a'][1].hex()}: no object '{obj(keys['a'][1])}' in "
                                  f"s3://blocks/{PREFIX}"]  # fmt: skip

        repaired = await fsck.run(VOL, repair=True)
        assert [f.paths for f in repaired.detached] == [["/a"], ["/b"], ["/c"]]
        client.delete_object(Bucket="blocks", Key=obj(keys["b"][0]))  # corrupt: gone once detached (gc's job)
        client.delete_object(Bucket="blocks", Key=obj(keys["c"][0]))
        after = await fsck.run(VOL)
        assert after.lost == [] and after.blocks == 8 and (after.shards_checked, after.shards_corrupt) == (8, 0)
        assert after.orphan_blocks == 1 and not after.errors and after.healthy
