"""A volume whose blocks live in a real S3 server (SeaweedFS), through a real lab and FUSE mount.

``cachefs volume create NAME --backing s3://...``: every block is one
object under the volume's prefix and none is a shard on a datanode; every
byte written reads back, after a remount through the cache node, which
fills its misses from the bucket itself; what fsync acknowledged survives a
kill -9 of the mount mid-write; and a store that cannot be used (nothing
listening, wrong credentials, no such bucket) is refused at creation with
an error that names the volume. moto's server runs the same backing client
in tests/backing/test_object_blocks.py (with gc).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from cachefs.credentials import Credential
from cachefs.lab.chaos import mount_pids
from cachefs.rpc import RpcPool
from cachefs.testing.labs import running_lab
from cachefs.testing.ports import free_port
from cachefs.testing.s3server import SeaweedS3

MiB = 1 << 20
BUCKET = "blocks"
SIZES = {"empty": 0, "one": 1, "under": MiB - 1, "exact": MiB, "over": 3 * MiB + 5, "big": 9 * MiB + 123}


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    with SeaweedS3(tmp_path_factory.mktemp("weed")) as server:
        env = server.env()
        boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                     region_name="us-east-1").create_bucket(Bucket=BUCKET)  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def lab(needs_fuse, s3: SeaweedS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with running_lab(tmp_path_factory.mktemp("s3lab"), env=s3.env()) as lab:
        yield lab


def objects(s3: SeaweedS3, prefix: str) -> dict[str, int]:
    env = s3.env()
    c = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
    pages = c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", ())}


def cli(lab: Any, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "cachefs.cli", *args, "--meta", ",".join(lab.meta_addrs),
            "--secret-file", str(lab.credential_file("admin"))]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def create(lab: Any, s3: SeaweedS3, name: str, prefix: str) -> None:
    out = cli(lab, "volume", "create", name, "--backing", f"s3://{BUCKET}/{prefix}", "--endpoint", s3.endpoint,
              "--block-size", "1M", "--open")
    assert out.returncode == 0, out.stderr


def mount(lab: Any, mnt: Path, volume: str) -> None:
    """Mount ``volume`` with a client credential for it (the lab's is for its own volume only)."""
    cred = Path(lab.root) / f"client-{volume}.cred"
    cred.write_text(Credential.issue(lab.secret, "client", volume, [volume]).to_json())
    lab.mount(str(mnt), "--secret-file", str(cred), l2=False, volume=volume)


@pytest.fixture
def mnt(lab: Any) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cachefs-s3vol-mnt-"))
    try:
        yield path
    finally:
        lab.umount()
        if not os.path.ismount(path):
            path.rmdir()


async def datanode_shards(lab: Any, volume: str) -> int:
    async with RpcPool(secret=lab.credential("admin")) as pool:
        total = 0
        for node in lab.of_kind("datanode"):
            reply = await pool.call(node.addr, "list", {"volume": volume, "cursor": "", "limit": 1000}, timeout=10)
            total += len(reply.result["shards"])
        return total


async def cache_fetches(lab: Any) -> int:
    async with RpcPool(secret=lab.credential("admin")) as pool:
        node = lab.of_kind("cachenode")[0]
        return int((await pool.call(node.addr, "stats", {}, timeout=10)).result["backing_fetches"])


def test_every_block_is_an_object_and_reads_back_through_the_cache_tier(s3, lab, mnt) -> None:
    create(lab, s3, "s3vol", "vols/one")
    rng = random.Random(6)
    data = {name: rng.randbytes(size) for name, size in SIZES.items()}
    mount(lab, mnt, "s3vol")
    for name, body in data.items():
        with open(mnt / name, "wb") as f:
            f.write(body)
            os.fsync(f.fileno())
    lab.umount()
    blocks = sum(-(-len(b) // MiB) for b in data.values())
    stored = objects(s3, "vols/one/")
    assert len(stored) == blocks and sum(stored.values()) == sum(map(len, data.values()))
    assert lab.run(datanode_shards, lab, "s3vol") == 0

    before = lab.run(cache_fetches, lab)
    mount(lab, mnt, "s3vol")  # a fresh L1: every block comes through the cache node
    assert {p.name: p.read_bytes() for p in mnt.iterdir()} == data
    assert lab.run(cache_fetches, lab) - before == blocks  # each filled once, from the bucket


WRITER = """
import os, random, sys
rng = random.Random(1)
with open(sys.argv[1], "wb") as f:
    while True:
        f.write(rng.randbytes(256 << 10))
        f.flush()
"""


def test_what_fsync_acknowledged_survives_a_kill_9_of_the_mount_mid_write(s3, lab, mnt) -> None:
    create(lab, s3, "s3kill", "vols/kill")
    mount(lab, mnt, "s3kill")
    acked = os.urandom(2 * MiB + 4321)
    with open(mnt / "acked", "wb") as f:
        f.write(acked)
        os.fsync(f.fileno())
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(mnt / "busy")], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while len(objects(s3, "vols/kill/")) < 3 + 2:  # acked's three blocks, and some of the busy file's
            assert time.monotonic() < deadline, "the writer stored no blocks"
            time.sleep(0.1)
        (pid,) = mount_pids(mnt)
        os.kill(pid, signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait(timeout=10)
    subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
    lab.umount()
    mount(lab, mnt, "s3kill")
    assert (mnt / "acked").read_bytes() == acked
    (mnt / "busy").read_bytes()  # every block its commits name is in the bucket (else EIO)


def test_a_store_that_cannot_be_used_is_refused_naming_the_volume(s3, lab) -> None:
    cases = {  # name: (url, endpoint, environment, what the error says)
        "bad-endpoint": (f"s3://{BUCKET}/x", f"http://127.0.0.1:{free_port()}", {}, "listing failed"),
        "bad-credentials": (f"s3://{BUCKET}/y", s3.endpoint, {"AWS_SECRET_ACCESS_KEY": "not-the-secret"},
                            "check the AWS credentials"),
        "bad-bucket": ("s3://no-such-bucket/z", s3.endpoint, {}, "bucket 'no-such-bucket' does not exist"),
    }  # fmt: skip
    for name, (url, endpoint, env, want) in cases.items():
        out = cli(lab, "volume", "create", name, "--backing", url, "--endpoint", endpoint, env=env)
        assert out.returncode != 0
        assert f"volume {name!r}" in out.stderr and want in out.stderr, out.stderr
    listed = cli(lab, "volume", "list")
    assert listed.returncode == 0 and not any(name in listed.stdout for name in cases)
