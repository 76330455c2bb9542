"""``cachefs quota set/get/list/unset VOLUME PATH``: limits by directory, enforced
with EDQUOT on the writes and creates of a real mount, usage as quota scopes."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

MiB = 1 << 20


def quota(lab, *args: str, role: str = "admin") -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "cachefs.cli", "quota", *args, "--meta", ",".join(lab.meta_addrs),
            "--secret-file", str(lab.credential_file(role))]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def scope(lab, path: str) -> dict:
    r = quota(lab, "get", "lab", path, "--json", role="client")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_directory_quota_refuses_writes_and_creates_past_it_with_edquot(small_lab, small_mnt) -> None:
    top = small_mnt / "quota-scope"
    (top / "deep").mkdir(parents=True)
    (top / "deep" / "one").write_bytes(os.urandom(MiB))
    r = quota(small_lab, "set", "lab", "/quota-scope", "--bytes", "2M", "--inodes", "4", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got == {"volume": "lab", "path": "/quota-scope", "inode": os.stat(top).st_ino, "used_bytes": MiB,
                   "limit_bytes": 2 * MiB, "used_inodes": 2, "limit_inodes": 4}  # fmt: skip
    try:
        # bytes: a second MiB fits, a third does not (at the write, the flush or the fsync)
        (top / "deep" / "two").write_bytes(os.urandom(MiB))
        with pytest.raises(OSError) as exc, open(top / "deep" / "three", "wb") as f:  # noqa: PT012
            f.write(os.urandom(MiB))
            f.flush()
            os.fsync(f.fileno())
        assert exc.value.errno == errno.EDQUOT
        os.unlink(top / "deep" / "three")
        # inodes: deep, one, two and a fourth; the fifth create is refused
        assert quota(small_lab, "set", "lab", "/quota-scope", "--capacity", "64M").returncode == 0
        assert scope(small_lab, "/quota-scope")["limit_inodes"] == 4  # a limit not given stays
        (top / "four").mkdir()
        with pytest.raises(OSError) as exc:
            (top / "deep" / "five").write_bytes(b"x")
        assert exc.value.errno == errno.EDQUOT
        with pytest.raises(OSError) as exc:
            (top / "five").mkdir()
        assert exc.value.errno == errno.EDQUOT
        outside = small_mnt / "quota-outside"
        outside.write_bytes(os.urandom(3 * MiB))  # no limit outside the scope
        outside.unlink()
        assert scope(small_lab, "/quota-scope")["used_inodes"] == 4

        r = quota(small_lab, "list", "lab", "--json")
        assert r.returncode == 0, r.stderr
        listed = [s for s in json.loads(r.stdout) if s["path"] == "/quota-scope"]
        assert listed == [scope(small_lab, "/quota-scope")]
        r = quota(small_lab, "list", "lab")
        assert f"lab:/quota-scope (inode {got['inode']}): bytes {2 * MiB} / {64 * MiB}, inodes 4 / 4" in r.stdout
        assert quota(small_lab, "list", "lab", role="client").returncode == 1  # listing a volume's quotas: admins
    finally:
        r = quota(small_lab, "unset", "lab", "/quota-scope")
        assert r.returncode == 0 and "unlimited" in r.stdout, r.stdout + r.stderr
    (top / "five").mkdir()  # no limit any more
    (top / "deep" / "big").write_bytes(os.urandom(3 * MiB))
    assert scope(small_lab, "/quota-scope")["used_bytes"] == 5 * MiB
    r = quota(small_lab, "get", "lab", "/quota-scope/deep/one")
    assert r.returncode == 1 and "not a directory" in r.stderr, r.stderr
    r = quota(small_lab, "set", "lab", "/quota-scope", "--inodes", "lots")
    assert r.returncode == 2 and "'lots' is not a count" in r.stderr, r.stderr
