"""``cachefs fsck VOLUME`` against real damage on a lab of its own: shard files
deleted and corrupted on the datanodes' disks, a datanode killed with SIGKILL,
then ``--repair`` (short blocks rebuilt, lost ranges detached as holes), and
the files read back through the mount."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

MiB = 1 << 20


@pytest.fixture(scope="module")
def lab(needs_fuse, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """1 metanode, 3 datanodes (ec:2+1), 1 cache node, and a mount without L2."""
    from cachefs.lab.cluster import Lab, LabConfig
    from cachefs.testing.ports import free_lab_base

    config = LabConfig(root=str(tmp_path_factory.mktemp("fscklab")), metanodes=1, datanodes=3, cachenodes=1,
                       zones=3, policy="ec:2+1", metrics=False, data_capacity="2G", cache_capacity="256M",
                       cache_memory="0")  # fmt: skip
    config.base_port = free_lab_base(config)
    lab = Lab(config)
    mnt = Path(tempfile.mkdtemp(prefix="cachefs-fsck-mnt-"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            lab.up(timeout=120)
            lab.mount(str(mnt), "--attr-timeout", "0", "--entry-timeout", "0", l2=False)
            lab.mnt = mnt
            yield lab
        finally:
            lab.down()
            if not os.path.ismount(mnt):
                mnt.rmdir()


def cachefs(lab, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "cachefs.cli", *args, "--meta", ",".join(lab.meta_addrs),
            "--secret-file", str(lab.credential_file("admin"))]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def fsck(lab, *extra: str) -> tuple[int, dict]:
    r = cachefs(lab, "fsck", "lab", "--json", *extra)
    assert r.returncode in (0, 1), r.stderr
    report = json.loads(r.stdout)
    assert report["healthy"] == (r.returncode == 0)
    return r.returncode, report


def blocks_of(lab, path: str) -> list[dict]:
    r = cachefs(lab, "info", path, "--volume", "lab", "--json")
    assert r.returncode == 0, r.stderr
    return [b for c in json.loads(r.stdout)["chunks"] for s in c["slices"] for b in s["blocks"]]


def shard_file(lab, block: dict, index: int) -> Path:
    (node,) = block["shards"][index]["held_by"]
    (found,) = (lab.root / node / "shards" / "lab").glob(f"*/{block['key']}.{index}")
    return found


def wait_datanodes_up(lab, n: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        r = subprocess.run([sys.executable, "-m", "cachefs.cli", "status", "--json", "--meta",
                            ",".join(lab.meta_addrs), "--secret-file", str(lab.credential_file("admin"))],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        if r.returncode == 0 and sum(d.get("state") == "up" for d in json.loads(r.stdout)["datanodes"]) == n:
            return
        assert time.monotonic() < deadline, r.stdout + r.stderr
        time.sleep(0.5)


def test_fsck_finds_short_and_lost_blocks_and_repair_rebuilds_and_detaches(lab) -> None:
    mnt = lab.mnt
    data = {"a.bin": os.urandom(9 * MiB), "sub/b.bin": os.urandom(5 * MiB), "sub/c.bin": os.urandom(MiB)}
    (mnt / "sub").mkdir()
    for name, content in data.items():
        (mnt / name).write_bytes(content)
    os.link(mnt / "sub" / "c.bin", mnt / "c-link")

    code, report = fsck(lab)
    assert code == 0, report
    assert report["metadata"] == [] and report["files"] == 3 and report["blocks"] == 3 + 2 + 1
    assert report["shards_checked"] >= 18 and report["shards_corrupt"] == 0

    # Short: one shard file deleted, another corrupted (a byte of its data flipped).
    a, b = blocks_of(lab, "/a.bin"), blocks_of(lab, "/sub/b.bin")
    shard_file(lab, a[0], 0).unlink()
    bad = shard_file(lab, b[1], 2)
    raw = bytearray(bad.read_bytes())
    raw[-100] ^= 0xFF
    bad.write_bytes(bytes(raw))
    code, report = fsck(lab)
    assert code == 1 and report["shards_corrupt"] == 1, report
    assert sorted(report["short"]) == sorted([a[0]["key"], b[1]["key"]]) and report["lost"] == [], report
    code, report = fsck(lab, "--repair")
    assert code == 1 and report["shards_rebuilt"] == 2 and report["detached"] == [], report
    assert shard_file(lab, a[0], 0).exists()
    code, report = fsck(lab)
    assert code == 0, report

    # Lost: two of block 1's three shards gone (ec:2+1 needs two).
    for index in (0, 1):
        shard_file(lab, a[1], index).unlink()
    code, report = fsck(lab)
    assert code == 1 and report["short"] == [] and report["unavailable"] == [], report
    assert [(f["paths"], f["blocks"], f["ranges"]) for f in report["lost"]] == [
        (["/a.bin"], [a[1]["key"]], [[4 * MiB, 4 * MiB]])]
    r = cachefs(lab, "fsck", "lab")
    assert r.returncode == 1 and "/a.bin (inode" in r.stdout and "bytes 4194304+4194304" in r.stdout, r.stdout

    # A datanode down: the loss may be on it, so it is unavailable, and --repair detaches nothing.
    (holder,) = a[1]["shards"][2]["held_by"]
    lab.kill(holder)
    try:
        code, report = fsck(lab, "--repair")
        assert code == 1 and report["lost"] == [] and report["detached"] == [], report
        assert holder in report["datanodes_down"]
        assert [f["paths"] for f in report["unavailable"]] == [["/a.bin"]]
    finally:
        lab.start(holder)
    wait_datanodes_up(lab, 3)

    code, report = fsck(lab, "--repair")
    assert code == 1 and [(f["paths"], f["ranges"]) for f in report["detached"]] == [
        (["/a.bin"], [[4 * MiB, 4 * MiB]])], report
    got = (mnt / "a.bin").read_bytes()
    want = data["a.bin"]
    assert len(got) == len(want)
    assert got[:4 * MiB] == want[:4 * MiB] and got[8 * MiB:] == want[8 * MiB:]
    assert got[4 * MiB:8 * MiB] == bytes(4 * MiB)  # detached: a hole, not EIO
    for name, want_name in (("sub/b.bin", "sub/b.bin"), ("sub/c.bin", "sub/c.bin"), ("c-link", "sub/c.bin")):
        assert hashlib.sha256((mnt / name).read_bytes()).digest() == hashlib.sha256(data[want_name]).digest()
    code, report = fsck(lab)
    assert code == 0, report


def test_fsck_refuses_what_is_not_there(lab) -> None:
    r = cachefs(lab, "fsck", "no-such-volume")
    assert r.returncode == 1 and "no-such-volume" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "cachefs.cli", "fsck", "lab", "--meta", ",".join(lab.meta_addrs),
                        "--secret-file", str(lab.credential_file("client"))],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 1 and "check_volume" in r.stderr, r.stderr  # the admin-only query, named
