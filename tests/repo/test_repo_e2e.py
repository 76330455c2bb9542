"""A bucket of a real S3 server (SeaweedFS) linked into a real lab and read through a real FUSE mount.

Every byte read through the mount is compared with the object; the reads go
through the cache node (the mount has no L2), which fetches block ranges
from the bucket itself. A changed object is never served stale: after
``repo sync`` a file whose old bytes sit in the cache reads the new ones.
"""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from cachefs.client import dirahead
from cachefs.rpc import RpcPool
from cachefs.testing.labs import running_lab
from cachefs.testing.ports import free_port
from cachefs.testing.s3server import SeaweedS3

MiB = 1 << 20
BUCKET = "train"
# relative key -> size; block size is 4 MiB, chunk 64 MiB: edges of both
SIZES = {"empty.bin": 0, "one.bin": 1, "cls1/a.jpg": 4095, "cls1/b.jpg": 4 * MiB, "cls2/c.jpg": 4 * MiB + 1,
         "cls2/deep/d.bin": 9 * MiB + 123, "cls3/e.jpg": 70_000}


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    with SeaweedS3(tmp_path_factory.mktemp("weed")) as server:
        yield server


def client(s3: SeaweedS3) -> Any:
    env = s3.env()
    return boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")


@pytest.fixture(scope="module")
def objects(s3: SeaweedS3) -> dict[str, bytes]:
    c = client(s3)
    c.create_bucket(Bucket=BUCKET)
    rng = random.Random(15)
    out = {}
    for key, size in SIZES.items():
        out[key] = rng.randbytes(size)
        c.put_object(Bucket=BUCKET, Key="imgs/" + key, Body=out[key])
    c.put_object(Bucket=BUCKET, Key="imgs/marker/", Body=b"")  # a console's "folder": no file
    c.put_object(Bucket=BUCKET, Key="other/outside.bin", Body=b"not under the prefix")
    return out


@pytest.fixture(scope="module")
def lab(needs_fuse, s3: SeaweedS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The nodes and the mount inherit the S3 credentials from the environment, as on a real host."""
    with running_lab(tmp_path_factory.mktemp("repolab"), env=s3.env()) as lab:
        yield lab


@pytest.fixture(scope="module")
def mnt(lab: Any) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cachefs-repo-mnt-"))
    lab.mount(str(path), "--attr-timeout", "0", "--entry-timeout", "0", l2=False)
    try:
        yield path
    finally:
        lab.umount()
        if not os.path.ismount(path):
            path.rmdir()


def repo_cli(lab: Any, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "cachefs.cli", "repo", *args, "--meta", ",".join(lab.meta_addrs),
            "--secret-file", str(lab.credential_file("admin"))]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


async def cache_stats(lab: Any) -> dict[str, Any]:
    async with RpcPool(secret=lab.credential("admin")) as pool:
        node = lab.of_kind("cachenode")[0]
        return (await pool.call(node.addr, "stats", {}, timeout=10)).result


def test_a_linked_bucket_reads_byte_for_byte_through_the_cache_tier(s3, objects, lab, mnt) -> None:
    out = repo_cli(lab, "link", "lab", "/datasets/train", f"s3://{BUCKET}/imgs", "--endpoint", s3.endpoint, "--json")
    assert out.returncode == 0, out.stderr
    link = json.loads(out.stdout)
    assert link["url"] == f"s3://{BUCKET}/imgs/" and link["import"]["created"] == len(SIZES)

    root = mnt / "datasets" / "train"
    before = lab.run(cache_stats, lab)["backing_fetches"]
    assert files_under(root) == objects  # every byte, nothing outside the prefix, no "folder" file
    listed = {o["Key"]: o for o in client(s3).list_objects_v2(Bucket=BUCKET, Prefix="imgs/")["Contents"]}
    for key, data in objects.items():
        st = (root / key).stat()
        assert st.st_size == len(data)
        assert abs(st.st_mtime - listed["imgs/" + key]["LastModified"].timestamp()) < 1.0
    blocks = sum(-(-len(d) // (4 * MiB)) for d in objects.values())
    assert lab.run(cache_stats, lab)["backing_fetches"] - before == blocks  # one fill per block, from S3

    again = repo_cli(lab, "link", "lab", "/datasets/train", f"s3://{BUCKET}/imgs", "--endpoint", s3.endpoint, "--json")
    assert again.returncode == 0, again.stderr  # linking again resumes: nothing new, nothing twice
    assert json.loads(again.stdout)["import"]["created"] == 0
    assert files_under(root) == objects

    listing = json.loads(repo_cli(lab, "list", "--json").stdout)
    assert [(lk["id"], lk["volume"], lk["url"], lk["objects"]) for lk in listing] == [
        (link["id"], "lab", f"s3://{BUCKET}/imgs/", len(SIZES))]
    status = json.loads(repo_cli(lab, "status", "lab", "/datasets/train", "--json").stdout)
    assert status["imported_ns"] > 0 and status["endpoint"] == s3.endpoint


def test_a_changed_object_is_never_served_stale(s3, objects, lab, mnt) -> None:
    root = mnt / "datasets" / "train"
    c = client(s3)
    cached = "cls1/b.jpg"  # read (so cached) by the test before, or now
    assert (root / cached).read_bytes() == objects[cached]
    unread = "cls3/late.bin"
    c.put_object(Bucket=BUCKET, Key="imgs/" + unread, Body=os.urandom(5000))
    first = repo_cli(lab, "sync", "lab", "/datasets/train", "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["created"] == 1
    assert (root / unread).stat().st_size == 5000  # imported, never read

    new_cached = bytes(b ^ 0xFF for b in objects[cached])  # same size, every byte different
    new_unread = os.urandom(6000)
    c.put_object(Bucket=BUCKET, Key="imgs/" + cached, Body=new_cached)
    c.put_object(Bucket=BUCKET, Key="imgs/" + unread, Body=new_unread)

    # Before a sync the namespace still says the old version: the cached
    # blocks are that version's; a block not cached cannot be fetched any
    # more (the GET is conditioned on the old ETag), so the read fails
    # instead of serving other bytes under the old version's keys.
    assert (root / cached).read_bytes() == objects[cached]
    with pytest.raises(OSError):
        (root / unread).read_bytes()

    out = repo_cli(lab, "sync", "lab", "/datasets/train", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"created": 0, "updated": 2, "unchanged": len(SIZES) - 1, "skipped": 0,
                                      "deleted": 0, "listed": len(SIZES) + 2,  # with the folder marker
                                      "dirs": 6}  # the link's, cls1, cls2, cls2/deep, cls3 and the marker's
    assert (root / cached).read_bytes() == new_cached
    assert (root / unread).read_bytes() == new_unread


def test_a_deleted_object_goes_and_an_open_file_reads_what_is_cached(s3, objects, lab, mnt) -> None:
    root = mnt / "datasets" / "train"
    c = client(s3)
    cached, uncached = "cls3/e.jpg", "cls2/deep/d.bin"  # read before, so cached; three blocks, one read now
    assert (root / cached).read_bytes() == objects[cached]
    c.put_object(Bucket=BUCKET, Key="imgs/cls4/big.bin", Body=os.urandom(9 * MiB))
    c.put_object(Bucket=BUCKET, Key="imgs/cls4/small.bin", Body=b"x")
    assert json.loads(repo_cli(lab, "sync", "lab", "/datasets/train", "--json").stdout)["created"] == 2
    big = root / "cls4" / "big.bin"
    held_cached = os.open(root / cached, os.O_RDONLY)
    held_big = os.open(big, os.O_RDONLY)
    try:
        first = os.pread(held_big, 4096, 0)  # its first block is cached now; the other two are not
        for key in (cached, "cls4/big.bin", "cls4/small.bin"):
            c.delete_object(Bucket=BUCKET, Key="imgs/" + key)
        out = repo_cli(lab, "sync", "lab", "/datasets/train", "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["deleted"] == 3
        assert not (root / cached).exists() and not big.exists()
        # SeaweedFS still lists the emptied prefix (its filer keeps the folder): it stays a directory, empty
        assert not (root / "cls4").exists() or os.listdir(root / "cls4") == []
        assert (root / uncached).read_bytes() == objects[uncached]  # the rest stays
        assert os.pread(held_cached, len(objects[cached]) + 1, 0) == objects[cached]  # open: as it was
        assert os.pread(held_big, 4096, 0) == first
        with pytest.raises(OSError) as info:
            os.pread(held_big, 4096, 8 * MiB)  # not cached, and its object is gone
        assert info.value.errno == errno.ESTALE
    finally:
        os.close(held_cached)
        os.close(held_big)
    log = (Path(lab.config.root) / "logs" / "mount.log").read_text(errors="replace")
    assert "imgs/cls4/big.bin" in log  # the mount's error names the object


def test_a_lazy_link_lists_directories_as_the_mount_reads_them(s3, objects, lab, mnt) -> None:
    c = client(s3)
    rng = random.Random(2)
    lazy = {f"k{i % 4}/{j}/img{i}.jpg": rng.randbytes(rng.randrange(1, 50_000)) for i in range(40) for j in "ab"}
    for key, body in lazy.items():
        c.put_object(Bucket=BUCKET, Key="lazy/" + key, Body=body)
    out = repo_cli(lab, "link", "lab", "/lazy", f"s3://{BUCKET}/lazy", "--endpoint", s3.endpoint, "--import",
                   "lazy", "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    link = json.loads(out.stdout)
    assert (link["import_mode"], link["objects"], link["pending"]) == ("lazy", 0, 1)
    root = mnt / "lazy"
    assert sorted(os.listdir(root)) == ["k0", "k1", "k2", "k3"]  # the first readdir listed the link's directory
    status = json.loads(repo_cli(lab, "status", "lab", "/lazy", "--json").stdout)
    assert (status["objects"], status["pending"]) == (0, 4)
    assert (root / "k2" / "b" / "img2.jpg").read_bytes() == lazy["k2/b/img2.jpg"]  # lookups list on the way
    status = json.loads(repo_cli(lab, "status", "lab", "/lazy", "--json").stdout)
    assert (status["objects"], status["pending"]) == (10, 4)  # k2/b listed; k2/a, k0, k1, k3 not yet
    c.put_object(Bucket=BUCKET, Key="lazy/k2/b/late.jpg", Body=b"late")
    c.delete_object(Bucket=BUCKET, Key="lazy/k2/b/img6.jpg")
    synced = json.loads(repo_cli(lab, "sync", "lab", "/lazy", "--json").stdout)
    assert (synced["created"], synced["deleted"], synced["dirs"]) == (1, 1, 3)  # the listed ones: /, k2, k2/b
    del lazy["k2/b/img6.jpg"]
    lazy["k2/b/late.jpg"] = b"late"
    assert files_under(root) == lazy  # the rest listed as the walk reads it
    status = json.loads(repo_cli(lab, "status", "lab", "/lazy", "--json").stdout)
    assert (status["objects"], status["pending"]) == (len(lazy), 0) and status["imported_ns"] > 0
    assert repo_cli(lab, "unlink", "lab", "/lazy").returncode == 0


def test_bad_links_fail_with_an_error_naming_them_and_record_nothing(s3, objects, lab) -> None:
    url = f"s3://{BUCKET}/imgs"
    wrong = repo_cli(lab, "link", "lab", "/bad1", url, "--endpoint", s3.endpoint,
                     env={"AWS_ACCESS_KEY_ID": "nobody", "AWS_SECRET_ACCESS_KEY": "wrong"})
    assert wrong.returncode != 0
    assert f"repository link to s3://{BUCKET}/imgs/" in wrong.stderr and "InvalidAccessKeyId" in wrong.stderr
    missing = repo_cli(lab, "link", "lab", "/bad2", "s3://no-such-bucket/x", "--endpoint", s3.endpoint)
    assert missing.returncode != 0 and "bucket 'no-such-bucket' does not exist" in missing.stderr
    dead = repo_cli(lab, "link", "lab", "/bad3", url, "--endpoint", f"http://127.0.0.1:{free_port()}")
    assert dead.returncode != 0 and f"repository link to s3://{BUCKET}/imgs/" in dead.stderr
    assert "Could not connect" in dead.stderr
    links = json.loads(repo_cli(lab, "list", "--json").stdout)
    assert [lk["url"] for lk in links] == [f"s3://{BUCKET}/imgs/"]  # none of the three was recorded


def mount_counter(mnt: Path, name: str) -> float:
    """A counter of the mount's own metrics (``.cachefs/stats``, Prometheus text)."""
    for line in (mnt / ".cachefs" / "stats").read_text().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "_total "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not in the mount's stats")


def test_an_open_that_misses_fetches_its_directorys_next_imported_files_ahead(s3, objects, lab, mnt) -> None:
    c = client(s3)
    rng = random.Random(3)
    window = dirahead.PER_MISS  # the mount's default --dir-readahead
    files = {f"img{i:02d}.jpg": rng.randbytes(rng.randrange(20_000, 90_000)) for i in range(window + 4)}
    for name, body in files.items():
        c.put_object(Bucket=BUCKET, Key="ahead/d/" + name, Body=body)
    out = repo_cli(lab, "link", "lab", "/ahead", f"s3://{BUCKET}/ahead", "--endpoint", s3.endpoint, "--json")
    assert out.returncode == 0, out.stderr
    root = mnt / "ahead" / "d"
    try:
        assert sorted(os.listdir(root)) == sorted(files)  # the listing brings every file's slice list
        fetched = lab.run(cache_stats, lab)["backing_fetches"]
        ahead = mount_counter(mnt, "cachefs_mount_dir_readahead_blocks")
        assert (root / "img05.jpg").read_bytes() == files["img05.jpg"]
        # One open missed: it fetched the directory's next `window` files too
        # (in listing order after the cursor, itself skipped), each from S3
        # once by the cache node, into the mount's L1.
        for _ in range(100):
            if lab.run(cache_stats, lab)["backing_fetches"] - fetched >= window + 1:
                break
            time.sleep(0.1)
        assert lab.run(cache_stats, lab)["backing_fetches"] - fetched == window + 1
        assert mount_counter(mnt, "cachefs_mount_dir_readahead_blocks") - ahead == window
        used = mount_counter(mnt, "cachefs_mount_dir_readahead_used_blocks")
        assert files_under(root) == files  # every byte; the rest fetched on demand or ahead
        assert mount_counter(mnt, "cachefs_mount_dir_readahead_used_blocks") - used >= window
        assert lab.run(cache_stats, lab)["backing_fetches"] - fetched == len(files)  # nothing twice
    finally:
        assert repo_cli(lab, "unlink", "lab", "/ahead").returncode == 0


async def all_cache_stats(lab: Any) -> list[dict[str, Any]]:
    async with RpcPool(secret=lab.credential("admin")) as pool:
        return [(await pool.call(node.addr, "stats", {}, timeout=10)).result for node in lab.of_kind("cachenode")]


def test_a_warm_epoch_of_small_files_comes_from_the_cache_tier_in_batches(s3, objects, lab, mnt) -> None:
    """Warmed into the cache tier, a directory's small files read in shuffled
    order come to the mount in get_many batches (dirahead.py), not one get each."""
    c = client(s3)
    rng = random.Random(13)
    files = {f"f{i:03d}.jpg": rng.randbytes(110 * 1024 + rng.randrange(100)) for i in range(48)}
    for name, body in files.items():
        c.put_object(Bucket=BUCKET, Key="warm/d/" + name, Body=body)
    out = repo_cli(lab, "link", "lab", "/warm", f"s3://{BUCKET}/warm", "--endpoint", s3.endpoint, "--json")
    assert out.returncode == 0, out.stderr
    root = mnt / "warm" / "d"
    try:
        warm = subprocess.run([sys.executable, "-m", "cachefs.cli", "warmup", "--volume", "lab", "--meta",
                               ",".join(lab.meta_addrs), "--secret-file", str(lab.credential_file("client")),
                               "--quiet", "/warm"], capture_output=True, text=True, timeout=120)  # fmt: skip
        assert warm.returncode == 0, warm.stdout + warm.stderr
        before = lab.run(all_cache_stats, lab)
        batches = mount_counter(mnt, "cachefs_mount_batch_fetches")
        blocks = mount_counter(mnt, "cachefs_mount_batch_blocks")
        names = os.listdir(root)
        assert sorted(names) == sorted(files)
        rng.shuffle(names)
        for name in names:
            assert (root / name).read_bytes() == files[name], name
        after = lab.run(all_cache_stats, lab)
        batches = mount_counter(mnt, "cachefs_mount_batch_fetches") - batches
        blocks = mount_counter(mnt, "cachefs_mount_batch_blocks") - blocks
        calls = sum(a["get_many"] - b["get_many"] for a, b in zip(after, before, strict=True))
        served = sum(a["get_many_blocks"] - b["get_many_blocks"] for a, b in zip(after, before, strict=True))
        assert served == blocks and calls == batches
        assert blocks >= len(files) // 2, (batches, blocks)  # most files came in batches
        assert blocks >= 2 * batches, (batches, blocks)  # several blocks a call, not one RPC each
        assert sum(a["backing_fetches"] - b["backing_fetches"] for a, b in zip(after, before, strict=True)) == 0
    finally:
        assert repo_cli(lab, "unlink", "lab", "/warm").returncode == 0


def test_unlink_forgets_the_link(s3, objects, lab, mnt) -> None:
    out = repo_cli(lab, "unlink", "lab", "/datasets/train")
    assert out.returncode == 0, out.stderr
    assert json.loads(repo_cli(lab, "list", "--json").stdout) == []
    missing = repo_cli(lab, "status", "lab", "/datasets/train")
    assert missing.returncode != 0 and "no repository link" in missing.stderr
