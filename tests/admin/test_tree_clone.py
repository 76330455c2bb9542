"""``cachefs tree clone`` on the session's small lab, with a volume of its own:
the copy reads as the source, edits of either copy never show in the other,
and ``gc --delete`` after rewrites and deletes in both frees what neither
holds and nothing that one of them still reads (``fsck`` finds every block)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20
VOLUME = "clones"


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cachefs.cli", *argv], capture_output=True, text=True, timeout=180)


def admin(lab, *args: str) -> subprocess.CompletedProcess[str]:
    return run(*args, "--meta", ",".join(lab.meta_addrs), "--secret-file", str(lab.credential_file("admin")))


def contents(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def test_clone_shares_blocks_and_gc_frees_only_what_no_copy_holds(small_lab) -> None:
    assert admin(small_lab, "volume", "create", VOLUME, "--policy", "ec:2+1", "--block-size", "1M").returncode == 0
    mp = Path(tempfile.mkdtemp(prefix="cachefs-clone-mnt-"))
    r = run("mount", ",".join(small_lab.meta_addrs), VOLUME, str(mp), "-d", "--secret-file",
            str(small_lab.secret_file), "--attr-timeout", "0", "--entry-timeout", "0",
            "--log-file", str(small_lab.root / "mount-clones.log"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    try:
        src = mp / "v1"
        (src / "sub" / "deep").mkdir(parents=True)
        (src / "big").write_bytes(os.urandom(5 * MiB))  # 5 blocks
        with open(src / "big", "r+b") as f:  # a second slice over part of the first
            f.seek(MiB + 7)
            f.write(os.urandom(100_000))
        for i in range(20):
            (src / "sub" / f"s{i}").write_bytes(os.urandom(1000 + i))
        (src / "sub" / "deep" / "d").write_bytes(os.urandom(2 * MiB))
        os.symlink("../big", src / "sub" / "link")
        original = contents(src)

        r = admin(small_lab, "tree", "clone", "/v1", "/v2", "--volume", VOLUME, "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["entries"] == 26  # v1, big, sub, its 20 files, deep, deep/d, link
        assert out["bytes"] >= sum(len(v) for v in original.values())  # stored bytes, now held twice
        dst = mp / "v2"
        assert contents(dst) == original and os.readlink(dst / "sub" / "link") == "../big"
        assert not [n for n in os.listdir(mp) if "cachefs-clone" in n]  # the hidden copy was renamed
        r = run("tree", "clone", str(src / "sub"), str(mp / "sub-copy"), "-q", "--secret-file",
                str(small_lab.credential_file("admin")))  # fmt: skip  # paths in the mount
        assert r.returncode == 0, r.stderr
        assert contents(mp / "sub-copy") == contents(src / "sub")

        # edits of each copy: rewrites, a truncate, deletes
        expect_src, expect_dst = dict(original), dict(original)
        (src / "big").write_bytes(b"new" * 1000)
        expect_src["big"] = b"new" * 1000
        os.unlink(src / "sub" / "deep" / "d")
        del expect_src["sub/deep/d"]
        with open(dst / "sub" / "s3", "r+b") as f:
            f.truncate(10)
        expect_dst["sub/s3"] = original["sub/s3"][:10]
        os.unlink(dst / "sub" / "s4")
        del expect_dst["sub/s4"]
        with open(dst / "big", "r+b") as f:
            f.seek(3 * MiB)
            f.write(b"x" * MiB)
        expect_dst["big"] = original["big"][: 3 * MiB] + b"x" * MiB + original["big"][4 * MiB :]
        assert contents(src) == expect_src and contents(dst) == expect_dst
        (dst / "big").write_bytes(b"y" * MiB)  # big's first slices lose their last holder
        expect_dst["big"] = b"y" * MiB

        # tree delete: v1 goes at once, the leader frees it; an open file of it still reads
        with open(src / "sub" / "s5", "rb") as held:
            r = run("tree", "delete", str(src), "--background", "--json", "--secret-file",
                    str(small_lab.credential_file("admin")))  # fmt: skip
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["inodes"] == 25, r.stdout  # the 26 cloned less deep/d, unlinked since
            assert not src.exists()
            deadline = time.monotonic() + 60
            while (left := json.loads(admin(small_lab, "tree", "status", "--volume", VOLUME, "--json").stdout)):
                assert time.monotonic() < deadline, left  # the leader purges it in the background
            assert held.read() == original["sub/s5"]

        r = admin(small_lab, "gc", "--volume", VOLUME, "--grace", "0", "--delete")
        assert r.returncode == 0, r.stdout + r.stderr
        purged = int(re.search(r"purged (\d+) slices", r.stdout).group(1))
        assert purged >= 3, r.stdout  # big's first slices, v2's overwrite, v1's own; nothing v2 or sub-copy holds
        r = admin(small_lab, "fsck", VOLUME, "--json")
        report = json.loads(r.stdout)
        assert r.returncode == 0 and report["healthy"] and not report["lost"], r.stdout
        assert contents(dst) == expect_dst
        assert contents(mp / "sub-copy") == {k[4:]: v for k, v in original.items() if k.startswith("sub/")}
    finally:
        run("umount", str(mp))
        if os.path.ismount(mp):
            subprocess.run(["fusermount3", "-u", "-z", str(mp)], check=False)
        mp.rmdir()
    assert admin(small_lab, "volume", "delete", VOLUME).returncode == 0
    assert admin(small_lab, "gc", "--volume", VOLUME, "--grace", "0", "--delete").returncode == 0
