"""Blocks of a volume kept in an object store, against moto's S3 server.

A second S3 implementation beside SeaweedFS (tests/repo/test_block_backing.py,
which runs the whole path through a mount). Here the real metanode service
over real RPC and the real backing client: every byte of every block back,
one object per block under the volume's prefix, the checksum caught, gc
deleting trashed and leaked blocks' objects and nothing else, and errors
that name the volume.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator

import boto3
import pytest
import trio

from cachefs import commands as C
from cachefs.backing.client import BackingClient
from cachefs.backing.cluster import MetaClusterView
from cachefs.backing.gc import GarbageCollector
from cachefs.backing.objects import CHECKSUM
from cachefs.errors import Corrupt, NotFound, Unavailable
from cachefs.ids import BlockKey
from cachefs.rpc import RpcPool
from cachefs.testing.metanode import local_metanode
from cachefs.testing.ports import free_port
from cachefs.testing.s3server import MOTO_ENV, moto_s3

BS = 64 * 1024
VOL = "objs"


@pytest.fixture
def moto(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for name, value in MOTO_ENV.items():
        monkeypatch.setenv(name, value)
    with moto_s3() as endpoint:
        yield endpoint


def stored_keys(s3, prefix: str) -> set[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket="blocks", Prefix=prefix)
    return {o["Key"] for page in pages for o in page.get("Contents", ())}


async def test_blocks_are_objects_and_gc_deletes_only_what_nothing_references(moto: str) -> None:
    s3 = boto3.client("s3", endpoint_url=moto)
    s3.create_bucket(Bucket="blocks")
    s3.put_object(Bucket="blocks", Key="vol/notes.txt", Body=b"not a block: gc leaves it")
    rng = random.Random(6)
    async with local_metanode() as meta, RpcPool(secret=None) as pool:
        await meta.service.mutate(C.CreateVolume(VOL, "replica:1", "none", BS, 8, backing="s3://blocks/vol/",
                                                 backing_endpoint=moto, now_ns=time.time_ns()))  # fmt: skip
        mc = meta.client(pool)
        view = MetaClusterView(mc)  # not refreshed: the client refreshes when it meets a volume it does not know
        backing = BackingClient(pool, view)
        files = {b"keep": 3 * BS + 17, b"gone": 2 * BS}
        blocks: dict[BlockKey, bytes] = {}
        of: dict[bytes, set[BlockKey]] = {}
        for name, size in files.items():
            attr = await mc.mutate(C.Mknod(VOL, 1, name, 0o100644))
            sid = await mc.mutate(C.AllocSlices(1))
            data = rng.randbytes(size)
            for i in range(0, size, BS):
                key = BlockKey(sid, i // BS)
                blocks[key] = data[i : i + BS]
                of.setdefault(name, set()).add(key)
                assert await backing.put_block(VOL, key, blocks[key]) == []  # nothing left for repair
            await mc.mutate(C.WriteSlice(VOL, attr.ino, 0, sid, 0, size, 0, time.time_ns()))
        assert stored_keys(s3, "vol/") == {"vol/" + k.hex() for k in blocks} | {"vol/notes.txt"}
        for key, data in blocks.items():
            assert await backing.get_block(VOL, key) == data
            assert await backing.get_block(VOL, key, 5, 1000) == data[5:1005]
            assert await backing.get_block(VOL, key, len(data) - 3) == data[-3:]
        with pytest.raises(NotFound, match=f"volume '{VOL}'"):
            await backing.get_block(VOL, BlockKey(999_999, 0))

        await mc.mutate(C.Unlink(VOL, 1, b"gone"))
        leaked = await mc.mutate(C.AllocSlices(1))  # a writer that died between its puts and its commit
        await backing.put_block(VOL, BlockKey(leaked, 0), os.urandom(BS))
        gc = GarbageCollector(mc, backing)
        report = await gc.collect(VOL, before_ns=time.time_ns())
        assert (report.slices_purged, report.blocks_deleted, report.errors) == (1, 2, [])
        check = await gc.check(VOL, [])
        assert check.missing == [] and check.unreferenced == [BlockKey(leaked, 0).hex()]
        assert (await gc.sweep(VOL, [])).leaked_blocks_deleted == 0  # not sealed yet: maybe still committing
        await meta.service.seal_slices(leaked + 1)
        swept = await gc.sweep(VOL, [])
        assert (swept.leaked_blocks_deleted, swept.errors) == (1, [])
        assert stored_keys(s3, "vol/") == {"vol/" + k.hex() for k in of[b"keep"]} | {"vol/notes.txt"}
        for key in of[b"keep"]:
            assert await backing.get_block(VOL, key) == blocks[key]
        assert (await gc.check(VOL, [])).unreferenced == []


async def test_a_block_that_fails_its_checksum_is_corrupt_and_store_errors_name_the_volume(moto: str) -> None:
    s3 = boto3.client("s3", endpoint_url=moto)
    s3.create_bucket(Bucket="blocks")
    async with local_metanode() as meta, RpcPool(secret=None) as pool:
        for name, url, endpoint in ((VOL, "s3://blocks/v/", moto), ("nobucket", "s3://missing-bucket/v/", moto),
                                    ("nostore", "s3://blocks/v/", f"http://127.0.0.1:{free_port()}")):
            await meta.service.mutate(C.CreateVolume(name, "replica:1", "none", BS, 8, backing=url,
                                                     backing_endpoint=endpoint, now_ns=time.time_ns()))  # fmt: skip
        backing = BackingClient(pool, MetaClusterView(meta.client(pool)))
        key = BlockKey(7, 0)
        await backing.put_block(VOL, key, b"x" * BS)
        good = s3.head_object(Bucket="blocks", Key="v/" + key.hex())["Metadata"][CHECKSUM]
        s3.put_object(Bucket="blocks", Key="v/" + key.hex(), Body=b"y" * BS, Metadata={CHECKSUM: good})
        with pytest.raises(Corrupt, match=f"volume '{VOL}'.*fails its checksum"):
            await backing.get_block(VOL, key)
        with pytest.raises(NotFound, match="volume 'nobucket'.*bucket 'missing-bucket' does not exist"):
            await backing.put_block("nobucket", key, b"z")
        with trio.fail_after(30), pytest.raises(Unavailable, match="volume 'nostore' .*storing block"):
            await backing.put_block("nostore", key, b"z")
