"""The benchmark's reference filesystem works through a real FUSE mount."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.needs_fuse


def mounted(path: Path) -> bool:
    real = os.path.realpath(path)
    return any(
        line.split()[4] == real for line in Path("/proc/self/mountinfo").read_text().splitlines()
    )


def _wait_mounted(path: Path, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not mounted(path):
        assert proc.poll() is None, "passthroughfs exited"
        assert time.monotonic() < deadline, "passthroughfs did not mount"
        time.sleep(0.05)


@pytest.mark.parametrize("keep_cache", [False, True])
def test_passthrough_round_trip(tmp_path: Path, keep_cache: bool) -> None:
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    args = [sys.executable, "-m", "bench.passthroughfs", str(src), str(mnt)] + (
        ["--keep-cache"] if keep_cache else []
    )
    log = (tmp_path / "log").open("wb")
    proc = subprocess.Popen(args, cwd=REPO, stderr=log)
    try:
        _wait_mounted(mnt, proc)
        data = os.urandom(3 << 20)
        (mnt / "d").mkdir()
        (mnt / "d" / "f").write_bytes(data)
        assert (src / "d" / "f").read_bytes() == data
        assert (
            hashlib.sha256((mnt / "d" / "f").read_bytes()).digest() == hashlib.sha256(data).digest()
        )
        os.rename(mnt / "d" / "f", mnt / "g")
        assert sorted(os.listdir(mnt)) == ["d", "g"]
        os.truncate(mnt / "g", 10)
        assert (mnt / "g").read_bytes() == data[:10]
        os.unlink(mnt / "g")
        os.rmdir(mnt / "d")
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        proc.wait(timeout=20)
        log.close()
    assert proc.returncode == 0, (tmp_path / "log").read_text()


def test_paths_changed_behind_its_back_are_forgotten(tmp_path: Path) -> None:
    """A file renamed in the source (not through the mount) and looked up
    under its new name is opened there, not at the stale old path (the
    benchmark removes its working sets in the source: the numbers come back
    for new files)."""
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    with (tmp_path / "log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.passthroughfs", str(src), str(mnt)], cwd=REPO, stderr=log
        )
    try:
        _wait_mounted(mnt, proc)
        for i in range(20):  # the old path wins a set's iteration order about half the time
            (mnt / f"f{i}").write_bytes(b"%d" % i)
        for i in range(20):
            os.rename(src / f"f{i}", src / f"g{i}")
        for i in range(20):
            assert (mnt / f"g{i}").read_bytes() == b"%d" % i
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        proc.wait(timeout=20)
