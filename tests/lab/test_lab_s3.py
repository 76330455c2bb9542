"""``cachefs lab up --s3``: a SeaweedFS server beside the lab, a demo bucket
filled and linked at /demo, read through the mount byte for byte; the volume
lab-s3 keeps what is written to it as objects in the store and shows in
``lab status``; ``lab down`` stops the server too."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import boto3
import pytest

from cachefs.lab.cluster import Lab, LabConfig, _alive
from cachefs.lab.s3demo import (
    DEMO_BUCKET,
    DEMO_OBJECTS,
    S3_VOLUME,
    S3_VOLUME_BACKING,
    S3_VOLUME_BUCKET,
)
from cachefs.testing.ports import free_lab_base
from cachefs.testing.s3server import credentials_env

pytestmark = pytest.mark.needs_fuse


def test_lab_up_s3_links_a_demo_bucket_that_reads_back_through_the_mount(needs_fuse, tmp_path: Path) -> None:
    config = LabConfig(root=str(tmp_path / "lab"), metanodes=1, datanodes=3, cachenodes=1, zones=3,
                       policy="ec:2+1", data_capacity="2G", cache_capacity="256M", cache_memory="0",
                       mount_cache="64M", metrics=False, s3=True)  # fmt: skip
    config.base_port = free_lab_base(config)
    lab = Lab(config)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lab.up(timeout=120)
        state = json.loads((tmp_path / "lab" / "lab.json").read_text())
        assert state["s3"] and _alive(state["s3_pid"]) and state["s3_endpoint"].startswith("http://127.0.0.1:")
        env = credentials_env()
        s3 = boto3.client("s3", endpoint_url=state["s3_endpoint"], region_name=env["AWS_DEFAULT_REGION"],
                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
        listed = s3.list_objects_v2(Bucket=DEMO_BUCKET, Prefix="train/")["Contents"]
        assert len(listed) == DEMO_OBJECTS
        mnt = tmp_path / "mnt"
        lab.mount(str(mnt), l2=False)
        files = sorted(p for p in (mnt / "demo").rglob("*") if p.is_file())
        assert [str(p.relative_to(mnt / "demo")) for p in files] == sorted(o["Key"][6:] for o in listed)
        for p in files:  # every byte, read through the cache node from the bucket
            key = "train/" + str(p.relative_to(mnt / "demo"))
            assert p.read_bytes() == s3.get_object(Bucket=DEMO_BUCKET, Key=key)["Body"].read()
        lab.umount()

        assert lab.run(lab.status)["volumes"] == {"lab": "ec:2+1", S3_VOLUME: S3_VOLUME_BACKING}
        body = os.urandom(3 << 20)
        lab.mount(str(mnt), l2=False, volume=S3_VOLUME)
        with open(mnt / "written", "wb") as f:
            f.write(body)
            os.fsync(f.fileno())
        lab.umount()
        stored = s3.list_objects_v2(Bucket=S3_VOLUME_BUCKET, Prefix=f"{S3_VOLUME}/")["Contents"]
        assert len(stored) == 1 and stored[0]["Size"] == len(body)  # one 4 MiB block
        lab.mount(str(mnt), l2=False, volume=S3_VOLUME)
        assert (mnt / "written").read_bytes() == body
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lab.down()
    assert not _alive(state["s3_pid"])
    assert json.loads((tmp_path / "lab" / "lab.json").read_text())["s3_pid"] is None
