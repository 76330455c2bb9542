"""Ranged GETs of imported blocks (``S3Store.get_range``) against SeaweedFS: bytes, errors, CPU.

``get_range`` is the cache node's miss path, once per block of every cold
imported file; it goes through obstore, with boto3's credential chain. What
runs here: ranges of many small objects read back byte for byte, 8 at a
time (its CPU per GET against boto3's is ``ranged_get_cpu_ms`` in
``bench/repo_bench.py``: a timed assertion here failed on a slower CI
machine); a changed
and a deleted object are ESTALE, wrong keys are EACCES, each naming the
link and the key; credentials come from a shared credentials file when the
environment has none.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
import trio

from cachefs.errors import PermissionDenied, Stale
from cachefs.repo.s3 import S3Store
from cachefs.testing.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3

BUCKET = "ranged"
SIZE = 110 * 1024  # a JPEG of the data loader benchmarks
NAME = f"repository link 3 (s3://{BUCKET}/)"


@pytest.fixture(scope="module")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    with SeaweedS3(tmp_path_factory.mktemp("weed")) as server:
        yield server


@pytest.fixture
def env(weed: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for name, value in weed.env().items():
        monkeypatch.setenv(name, value)
    return weed.env()


def s3(weed: SeaweedS3) -> object:
    return boto3.client("s3", endpoint_url=weed.endpoint, aws_access_key_id=ACCESS_KEY,
                        aws_secret_access_key=SECRET_KEY, region_name="us-east-1")  # fmt: skip


async def test_many_small_ranges_read_back_byte_for_byte(weed: SeaweedS3, env: dict[str, str]) -> None:
    c = s3(weed)
    c.create_bucket(Bucket=BUCKET)  # type: ignore[attr-defined]
    bodies = {f"img/{i:03d}.jpg": os.urandom(SIZE) for i in range(60)}
    etags = {k: c.put_object(Bucket=BUCKET, Key=k, Body=b)["ETag"] for k, b in bodies.items()}  # type: ignore[attr-defined]
    store = S3Store(BUCKET, name=NAME, endpoint=weed.endpoint)
    keys = sorted(bodies)
    got: dict[tuple[str, int], bytes] = {}
    limit = trio.Semaphore(8)

    async def one(key: str, start: int, end: int) -> None:
        async with limit:
            got[(key, start)] = await store.get_range(key, start, end, etags[key])

    async with trio.open_nursery() as n:
        for key in keys:
            n.start_soon(one, key, 0, SIZE)  # a whole small object: one block
            n.start_soon(one, key, 1000, 5096)  # a range inside one
    for key in keys:
        assert got[(key, 0)] == bodies[key]
        assert got[(key, 1000)] == bodies[key][1000:5096]


async def test_changed_deleted_and_refused_reads_name_the_link_and_key(weed: SeaweedS3, env: dict[str, str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    c = s3(weed)
    etag = c.put_object(Bucket=BUCKET, Key="img/changed.jpg", Body=b"old bytes")["ETag"]  # type: ignore[attr-defined]
    gone = c.put_object(Bucket=BUCKET, Key="img/gone.jpg", Body=b"deleted")["ETag"]  # type: ignore[attr-defined]
    store = S3Store(BUCKET, name=NAME, endpoint=weed.endpoint)
    assert await store.get_range("img/changed.jpg", 4, 9, etag) == b"bytes"
    c.put_object(Bucket=BUCKET, Key="img/changed.jpg", Body=b"new bytes")  # type: ignore[attr-defined]
    with pytest.raises(Stale, match=r"repository link 3 \(s3://ranged/\): reading 'img/changed.jpg'.*changed since"):
        await store.get_range("img/changed.jpg", 4, 9, etag)  # never the new bytes under the old version
    c.delete_object(Bucket=BUCKET, Key="img/gone.jpg")  # type: ignore[attr-defined]
    with pytest.raises(Stale, match=r"repository link 3 .*reading 'img/gone.jpg'.*deleted from the bucket"):
        await store.get_range("img/gone.jpg", 0, 7, gone)

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    wrong = S3Store(BUCKET, name=NAME, endpoint=weed.endpoint, attempts=1)
    with pytest.raises(PermissionDenied, match=r"repository link 3 .*reading 'img/changed.jpg'.*credentials"):
        await wrong.get_range("img/changed.jpg", 0, 3, "")


async def test_credentials_come_from_a_shared_credentials_file(weed: SeaweedS3, env: dict[str, str],
                                                               monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # fmt: skip
    c = s3(weed)
    etag = c.put_object(Bucket=BUCKET, Key="img/file.jpg", Body=b"from the file")["ETag"]  # type: ignore[attr-defined]
    creds = tmp_path / "credentials"
    creds.write_text(f"[train]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_PROFILE", "train")
    store = S3Store(BUCKET, name=NAME, endpoint=weed.endpoint)
    assert await store.get_range("img/file.jpg", 5, 13, etag) == b"the file"
