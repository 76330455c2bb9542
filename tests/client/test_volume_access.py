"""Per-volume mount tokens through the real CLI and a real mount (issue 9):
a volume created with a token refuses mounts without it or with another one
(EACCES, naming the volume); the right token mounts; an open volume needs none."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.client.conftest import REPO, mounted


def _cli(lab, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "cachefs.cli", *args]
    if args[0] == "volume":
        argv += ["--meta", ",".join(lab.meta_addrs), "--secret-file", str(lab.secret_file)]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)


def _mount(
    lab, volume: str, where: Path, log: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    return _cli(lab, "mount", ",".join(lab.meta_addrs), volume, str(where), "-d", "--secret-file",
                str(lab.secret_file), "--log-file", str(log), "--zone", "z1", *extra)  # fmt: skip


def test_mount_needs_the_volume_token(cluster, tmp_path: Path) -> None:
    token, other = tmp_path / "token", tmp_path / "other"
    token.write_text(os.urandom(16).hex() + "\n")
    other.write_text("not-the-token\n")
    made = _cli(
        cluster, "volume", "create", "tenant-a", "--policy", "ec:2+1", "--token-file", str(token)
    )
    assert made.returncode == 0, made.stderr
    where = Path(tempfile.mkdtemp(prefix="cachefs-mnt-"))
    try:
        for extra in ((), ("--token-file", str(other))):
            p = _mount(cluster, "tenant-a", where, tmp_path / "refused.log", *extra)
            assert p.returncode != 0 and not mounted(where)
            assert "tenant-a" in p.stderr and "token" in p.stderr, p.stderr
        p = _mount(cluster, "tenant-a", where, tmp_path / "ok.log", "--token-file", str(token))
        assert p.returncode == 0, p.stderr
        (where / "f").write_bytes(b"tenant a")
        assert (where / "f").read_bytes() == b"tenant a"
        assert _cli(cluster, "umount", str(where)).returncode == 0
        # Opened: no token needed any more.
        opened = _cli(cluster, "volume", "set", "tenant-a", "--open")
        assert opened.returncode == 0, opened.stderr
        p = _mount(cluster, "tenant-a", where, tmp_path / "open.log")
        assert p.returncode == 0, p.stderr
        assert (where / "f").read_bytes() == b"tenant a"
        assert _cli(cluster, "umount", str(where)).returncode == 0
    finally:
        if mounted(where):
            subprocess.run(["fusermount3", "-u", "-z", str(where)], check=False)
        if not mounted(where):
            where.rmdir()


def test_library_connect_needs_the_volume_token(cluster, tmp_path: Path) -> None:
    from cachefs.client.api import connect

    token = tmp_path / "token"
    token.write_text("tenant-b-token\n")
    made = _cli(
        cluster, "volume", "create", "tenant-b", "--policy", "ec:2+1", "--token-file", str(token)
    )
    assert made.returncode == 0, made.stderr
    secret = Path(cluster.secret_file).read_bytes().strip()
    for bad in (None, "wrong"):
        with pytest.raises(OSError) as info:
            connect(cluster.meta_addrs, "tenant-b", secret=secret, token=bad)
        assert info.value.errno == errno.EACCES and "tenant-b" in str(info.value)
    fs = connect(cluster.meta_addrs, "tenant-b", secret=secret, token="tenant-b-token")
    try:
        fs.write_bytes("/x", b"1")
        assert fs.read_bytes("/x") == b"1"
    finally:
        fs.close()
