"""``cachefs warmup`` on a linked directory, in a lab of three zones with a cache node each.

The first zone's cache nodes read each block from the bucket (SeaweedFS);
the other zones' copy it from them, so the whole cache group reads each
block from S3 once. ``--check`` says what each zone holds, fetching nothing.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from cachefs.rpc import RpcPool
from cachefs.testing.labs import running_lab
from cachefs.testing.s3server import SeaweedS3

from .test_repo_e2e import client, repo_cli

MiB = 1 << 20
SIZES = {"a/big.bin": 9 * MiB, "a/one-block.bin": 4 * MiB, "b/small.jpg": 100_000, "b/tiny": 1, "empty": 0}
BLOCKS = 3 + 1 + 1 + 1


@pytest.fixture(scope="module")
def lab(needs_fuse, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, SeaweedS3]]:
    with SeaweedS3(tmp_path_factory.mktemp("weed")) as s3, \
            running_lab(tmp_path_factory.mktemp("warmlab"), cachenodes=3, env=s3.env()) as lab:
        yield lab, s3


def warmup(lab: Any, *args: str) -> str:
    argv = [sys.executable, "-m", "cachefs.cli", "warmup", *args, "--volume", "lab", "--meta", ",".join(lab.meta_addrs),
            "--secret-file", str(lab.credential_file("admin")), "--quiet"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def zones(text: str) -> dict[str, tuple[int, int, int, int]]:
    """``--check``'s lines: zone -> (cached blocks, blocks, cached bytes, bytes)."""
    found = re.findall(r"zone (\S+): [\d.]+% cached \((\d+) of (\d+) blocks, (\d+) of (\d+) bytes\)", text)
    return {z: tuple(map(int, rest)) for z, *rest in found}


def summary(text: str) -> tuple[int, int, int, int, int]:
    """The warm-up's summary: (files, block copies, fetched, already cached, failed)."""
    files, copies = map(int, re.search(r"(\d+) files, (\d+) block copies", text).groups())
    if "everything was already cached" in text:
        return files, copies, 0, copies, 0
    fetched, cached, failed = map(int, re.search(r"(\d+) fetched .*?, (\d+) already cached, (\d+) failed",
                                                 text).groups())  # fmt: skip
    return files, copies, fetched, cached, failed


async def fetches(lab: Any) -> list[int]:
    async with RpcPool(secret=lab.credential("admin")) as pool:
        return [(await pool.call(n.addr, "stats", {}, timeout=10)).result["backing_fetches"]
                for n in lab.of_kind("cachenode")]  # fmt: skip


def test_warmup_of_a_linked_directory_reads_each_block_from_s3_once_for_every_zone(lab) -> None:
    lab, s3 = lab
    c = client(s3)
    c.create_bucket(Bucket="warm")
    rng = random.Random(4)
    for key, size in SIZES.items():
        c.put_object(Bucket="warm", Key="ds/" + key, Body=rng.randbytes(size))
    out = repo_cli(lab, "link", "lab", "/warm", "s3://warm/ds", "--endpoint", s3.endpoint, "--json")
    assert out.returncode == 0, out.stderr

    total = sum(SIZES.values())
    cold = zones(warmup(lab, "/warm", "--check"))
    assert len(cold) == 3 and all(z == (0, BLOCKS, 0, total) for z in cold.values())
    before = lab.run(fetches, lab)
    assert summary(warmup(lab, "/warm")) == (len(SIZES), 3 * BLOCKS, 3 * BLOCKS, 0, 0)
    after = lab.run(fetches, lab)
    assert sum(after) - sum(before) == BLOCKS  # the other zones copied from the first one
    warm = zones(warmup(lab, "/warm", "--check"))
    assert len(warm) == 3 and all(z == (BLOCKS, BLOCKS, total, total) for z in warm.values())
    assert summary(warmup(lab, "/warm/a")) == (2, 3 * 4, 0, 3 * 4, 0)  # a's 4 blocks, warm in every zone


def test_a_prefetch_source_that_is_no_cache_node_is_not_contacted(lab) -> None:
    """A client names the node to copy from; one that names any other address
    (here the metanode's) gets a fill from backing storage, and the cache node
    never sends it a request."""
    lab, s3 = lab
    client(s3).put_object(Bucket="warm", Key="ds/b/stray.bin", Body=random.Random(5).randbytes(1000))
    out = repo_cli(lab, "sync", "lab", "/warm")
    assert out.returncode == 0, out.stderr

    async def prefetch(lab: Any) -> tuple[dict, dict, dict]:
        from cachenode.warmup import resolve_paths
        from metanode.client import MetaClient

        async with RpcPool(secret=lab.credential("admin")) as pool:
            meta = MetaClient(pool, lab.meta_addrs, deadline=20.0)
            (warm,) = await resolve_paths(meta, "lab", ["/warm/b/stray.bin"], 4 * MiB)
            (key,) = list(warm.blocks)
            node = lab.of_kind("cachenode")[1]
            before = (await pool.call(node.addr, "stats", {}, timeout=10)).result
            answer = (await pool.call(node.addr, "prefetch", {"volume": "lab", "keys": [key.to_bytes()], "wait": True,
                                                              "source": lab.meta_addrs[0]}, timeout=60)).result  # fmt: skip
            after = (await pool.call(node.addr, "stats", {}, timeout=10)).result
            return answer, before, after

    answer, before, after = lab.run(prefetch, lab)
    assert answer["done"] == 1 and answer["failed"] == 0
    assert after["sources_refused"] - before["sources_refused"] == 1
    assert after["backing_fetches"] - before["backing_fetches"] == 1
