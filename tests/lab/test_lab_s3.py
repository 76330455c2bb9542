"""``cachefs lab up --s3``: a SeaweedFS server beside the lab, a demo bucket
filled and linked at /demo, read through the mount byte for byte; the volume
lab-s3 keeps what is written to it as objects in the store and shows in
``lab status``; ``lab down`` stops the server too.

Least privilege, for real: every daemon runs with only its own identity
(``s3demo.IDENTITIES``, docs/deploy.md's table), and lab-s3 works end to end
under them: the mount puts and gets blocks, the cache node fills its misses,
the metanode leader's gc lists the prefix and deletes the objects of an
overwritten file. An action outside a role is refused by the store, and the
error names the volume and the operation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import trio

from cachefs.backing.objects import ObjectBlocks, ObjectTarget
from cachefs.errors import PermissionDenied
from cachefs.ids import BlockKey
from cachefs.lab.cluster import Lab, LabConfig, _alive
from cachefs.lab.s3demo import (
    DEMO_BUCKET,
    DEMO_OBJECTS,
    S3_VOLUME,
    S3_VOLUME_BACKING,
    S3_VOLUME_BUCKET,
)
from cachefs.rpc import RpcPool
from cachefs.testing.ports import free_lab_base
from cachefs.testing.s3server import credentials_env

pytestmark = pytest.mark.needs_fuse


@pytest.fixture(scope="module")
def s3lab(needs_fuse, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Lab, Any, Path]]:
    """A lab with --s3 (the leader's gc every second, grace 1 s), its admin S3 client and a mount point."""
    root = tmp_path_factory.mktemp("s3lab")
    config = LabConfig(root=str(root / "lab"), metanodes=1, datanodes=3, cachenodes=1, zones=3,
                       policy="ec:2+1", data_capacity="2G", cache_capacity="256M", cache_memory="0",
                       mount_cache="64M", metrics=False, s3=True,
                       metanode_options=["--gc-interval", "1", "--gc-grace", "1"])  # fmt: skip
    config.base_port = free_lab_base(config)
    lab = Lab(config)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lab.up(timeout=120)
        state = json.loads((root / "lab" / "lab.json").read_text())
        assert state["s3"] and _alive(state["s3_pid"]) and state["s3_endpoint"].startswith("http://127.0.0.1:")
        env = credentials_env()
        s3 = boto3.client("s3", endpoint_url=state["s3_endpoint"], region_name=env["AWS_DEFAULT_REGION"],
                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
        yield lab, s3, root / "mnt"
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lab.down()
    assert not _alive(state["s3_pid"])
    assert json.loads((root / "lab" / "lab.json").read_text())["s3_pid"] is None
    assert state["s3_ports"] and not [p for port in state["s3_ports"]  # weed's sockets removed too
                                      for p in Path("/tmp").glob(f"seaweedfs-*-{port}.sock")]  # fmt: skip


def test_lab_up_s3_links_a_demo_bucket_that_reads_back_through_the_mount(s3lab) -> None:
    lab, s3, mnt = s3lab
    listed = s3.list_objects_v2(Bucket=DEMO_BUCKET, Prefix="train/")["Contents"]
    assert len(listed) == DEMO_OBJECTS
    lab.mount(str(mnt), l2=False)
    try:
        files = sorted(p for p in (mnt / "demo").rglob("*") if p.is_file())
        assert [str(p.relative_to(mnt / "demo")) for p in files] == sorted(o["Key"][6:] for o in listed)
        for p in files:  # every byte, read through the cache node from the bucket (its identity: Read)
            key = "train/" + str(p.relative_to(mnt / "demo"))
            assert p.read_bytes() == s3.get_object(Bucket=DEMO_BUCKET, Key=key)["Body"].read()
    finally:
        lab.umount()


def blocks_of_lab_s3(s3: Any) -> dict[str, int]:
    return {o["Key"]: o["Size"]
            for o in s3.list_objects_v2(Bucket=S3_VOLUME_BUCKET, Prefix=f"{S3_VOLUME}/").get("Contents", ())}


def test_lab_s3_works_with_each_daemon_s_own_identity_and_refuses_the_rest(s3lab) -> None:
    lab, s3, mnt = s3lab
    assert lab.run(lab.status)["volumes"] == {"lab": "ec:2+1", S3_VOLUME: S3_VOLUME_BACKING}
    first, second = os.urandom(3 << 20), os.urandom(5 << 20)
    lab.mount(str(mnt), l2=False, volume=S3_VOLUME)  # the mount's identity: Read+Write on the bucket
    try:
        (mnt / "written").write_bytes(first)
        old = blocks_of_lab_s3(s3)  # its blocks (and a copy, if the leader sealed its slice id meanwhile)
        assert old and sum(old.values()) % len(first) == 0
        with open(mnt / "written", "wb") as f:  # the old slice goes to the trash
            f.write(second)
            os.fsync(f.fileno())
    finally:
        lab.umount()
    deadline = time.monotonic() + 60  # the leader's gc (List+Write) deletes the trashed and leaked objects
    while old.keys() & (stored := blocks_of_lab_s3(s3)).keys() or sum(stored.values()) != len(second):
        assert time.monotonic() < deadline, f"gc left {stored} in the bucket (first write: {old})"
        time.sleep(0.5)
    before = lab.run(cache_fetches, lab)
    lab.mount(str(mnt), l2=False, volume=S3_VOLUME)  # a fresh L1: the cache node (Read) fills from the bucket
    try:
        assert (mnt / "written").read_bytes() == second
    finally:
        lab.umount()
    assert lab.run(cache_fetches, lab) - before == len(stored)
    for node in lab.nodes:  # each daemon did its part with its own identity, none was refused
        assert "AccessDenied" not in lab.log_path(node.name).read_text(errors="replace"), node.name

    # Outside its role, each identity is refused by the store, naming the volume and the operation.
    target = ObjectTarget(S3_VOLUME_BUCKET, f"{S3_VOLUME}/", lab.config.s3_endpoint, "us-east-1")
    key = BlockKey(1 << 40, 0)
    refused = {  # identity: (what it tries, the operation the error names)
        "cachenode": (lambda o: o.put(S3_VOLUME, target, key, b"x"), f"storing block {key.hex()}"),
        "mount": (lambda o: o.inventory(S3_VOLUME, target), "listing"),
        "metanode": (lambda o: o.get(S3_VOLUME, target, key), f"getting block {key.hex()}"),
    }
    for identity, (attempt, operation) in refused.items():
        with pytest.MonkeyPatch.context() as env:
            for name, value in credentials_env(identity).items():
                env.setenv(name, value)
            with pytest.raises(PermissionDenied) as denied:
                trio.run(attempt, ObjectBlocks())
        assert f"volume {S3_VOLUME!r} ({S3_VOLUME_BACKING}): {operation}: AccessDenied" in str(denied.value)
    # a daemon's CLI run with the wrong identity (the mount's has no List): a clear error, no traceback
    out = subprocess.run([sys.executable, "-m", "cachefs.cli", "fsck", S3_VOLUME, "--meta", ",".join(lab.meta_addrs),
                          "--secret-file", str(lab.credential_file("admin"))], capture_output=True, text=True,
                         timeout=120, env={**os.environ, **credentials_env("mount")})  # fmt: skip
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"error: listing {S3_VOLUME_BACKING}: [EACCES] volume {S3_VOLUME!r} ({S3_VOLUME_BACKING}): listing: " \
           "AccessDenied" in out.stderr, out.stderr


async def cache_fetches(lab: Lab) -> int:
    async with RpcPool(secret=lab.credential("admin")) as pool:
        node = lab.of_kind("cachenode")[0]
        return int((await pool.call(node.addr, "stats", {}, timeout=10)).result["backing_fetches"])
