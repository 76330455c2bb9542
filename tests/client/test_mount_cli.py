"""`cachefs mount`/`umount` refuse clearly before any cluster is involved."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cachefs.client.mount import (
    check_mountpoint,
    fuse_options,
    mount_command,
    mount_entry,
    umount_command,
)

REPO = Path(__file__).resolve().parents[2]


def test_missing_mount_point(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        mount_command, ["127.0.0.1:1", "vol", str(tmp_path / "nope"), "--insecure"]
    )
    assert result.exit_code != 0
    assert f"mount point {tmp_path / 'nope'} does not exist" in result.output


def test_mount_point_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    result = CliRunner().invoke(
        mount_command, ["127.0.0.1:1", "vol", str(tmp_path / "f"), "--insecure"]
    )
    assert result.exit_code != 0 and "is a file" in result.output


def test_no_secret_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("CACHEFS_SECRET", raising=False)
    result = CliRunner().invoke(mount_command, ["127.0.0.1:1", "vol", str(tmp_path)])
    assert result.exit_code != 0 and "no cluster secret" in result.output


def test_bad_options(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(
        mount_command, ["127.0.0.1:1", "vol", str(tmp_path), "--insecure", "--transport", "ib"]
    )
    assert result.exit_code == 2 and "'ib' is not one of" in result.output
    result = runner.invoke(
        mount_command, ["127.0.0.1:1", "vol", str(tmp_path), "--insecure", "--l1-size", "lots"]
    )
    assert result.exit_code == 2 and "not a size" in result.output
    result = runner.invoke(mount_command, ["nohost", "vol", str(tmp_path), "--insecure"])
    assert result.exit_code == 2 and "host:port" in result.output


def test_mount_options_start_from_pyfuse3_defaults() -> None:
    opts = fuse_options("data", read_only=True)
    assert {"default_permissions", "fsname=cachefs:data", "subtype=cachefs", "ro"} <= opts
    assert "allow_other" not in opts  # only when asked for, and then with default_permissions
    opts = fuse_options("data", read_only=False, allow_other=True, flags=("noexec",))
    assert {"allow_other", "default_permissions", "noexec"} <= opts and "ro" not in opts


@pytest.mark.needs_fuse
def test_busy_mount_point_and_umount_of_foreign_mount(tmp_path: Path) -> None:
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    log = (tmp_path / "log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.passthroughfs", str(src), str(mnt)], cwd=REPO, stderr=log
    )
    try:
        for _ in range(400):
            if mount_entry(str(mnt)) is not None:
                break
            assert proc.poll() is None
            subprocess.run(["sleep", "0.05"], check=True)
        with pytest.raises(Exception, match="is busy"):
            check_mountpoint(str(mnt))
        # umount without a cachefs daemon falls back to fusermount3 -u.
        result = CliRunner().invoke(umount_command, [str(mnt)])
        assert result.exit_code == 0, result.output
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
            proc.wait(timeout=20)
        log.close()
    result = CliRunner().invoke(umount_command, [str(mnt)])
    assert result.exit_code != 0 and "is not mounted" in result.output
