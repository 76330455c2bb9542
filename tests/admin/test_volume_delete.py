"""``cachefs volume delete``: refused while mounted unless ``--force``; the files
go at once, the blocks through the garbage collector, and the name is free
again once no datanode holds a shard of the volume. On the session's small lab,
with a volume of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 1 << 20


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cachefs.cli", *argv], capture_output=True, text=True, timeout=180)


def admin(lab, *args: str) -> subprocess.CompletedProcess[str]:
    return run(*args, "--meta", ",".join(lab.meta_addrs), "--secret-file", str(lab.credential_file("admin")))


def shards(lab, volume: str) -> list[Path]:
    return [p for n in lab.of_kind("datanode") for p in (lab.root / n.name / "shards" / volume).glob("*/*")]


def mount(lab, volume: str) -> Path:
    mp = Path(tempfile.mkdtemp(prefix="cachefs-del-mnt-"))
    r = run("mount", ",".join(lab.meta_addrs), volume, str(mp), "-d", "--secret-file", str(lab.secret_file),
            "--log-file", str(lab.root / f"mount-{mp.name}.log"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    return mp


def umount(mp: Path) -> None:
    run("umount", str(mp))
    if os.path.ismount(mp):
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], check=False)
    mp.rmdir()


def test_delete_is_refused_while_mounted_and_the_collector_frees_blocks_and_name(small_lab) -> None:
    assert admin(small_lab, "volume", "create", "scratch", "--policy", "ec:2+1").returncode == 0
    mp = mount(small_lab, "scratch")
    try:
        (mp / "d").mkdir()
        (mp / "d" / "f").write_bytes(os.urandom(9 * MiB))
        (mp / "g").write_bytes(os.urandom(MiB))
        r = admin(small_lab, "volume", "delete", "scratch")
        assert r.returncode == 1 and "is mounted: 1 session(s) open" in r.stderr, r.stderr
        assert (mp / "g").stat().st_size == MiB  # nothing changed
    finally:
        umount(mp)
    stored = len(shards(small_lab, "scratch"))
    assert stored == 3 * (3 + 1)  # 4 blocks of ec:2+1

    r = admin(small_lab, "volume", "delete", "scratch")
    assert r.returncode == 0 and "2 slices to the garbage collector, 0 sessions closed" in r.stdout, r.stderr
    r = run("mount", ",".join(small_lab.meta_addrs), "scratch", tempfile.gettempdir(), "-d",
            "--secret-file", str(small_lab.secret_file))  # fmt: skip
    assert r.returncode != 0 and "deleted" in r.stderr, r.stderr
    r = admin(small_lab, "volume", "create", "scratch")
    assert r.returncode == 1 and "still being collected" in r.stderr, r.stderr
    listed = json.loads(admin(small_lab, "volume", "list", "--json").stdout)
    assert listed["scratch"]["deleted"] is True and "used_bytes" not in listed["scratch"]
    r = admin(small_lab, "fsck", "scratch")
    assert r.returncode == 1 and "deleted" in r.stderr, r.stderr
    assert len(shards(small_lab, "scratch")) == stored  # the blocks wait for the collector

    r = admin(small_lab, "gc", "--volume", "scratch", "--grace", "0")
    assert r.returncode == 0 and "would purge 2 slices, delete 4 blocks" in r.stdout, r.stdout
    r = admin(small_lab, "gc", "--volume", "scratch", "--grace", "0", "--delete")
    assert r.returncode == 0 and "scratch was deleted and has no blocks left: it is gone" in r.stdout, r.stdout
    assert shards(small_lab, "scratch") == []
    assert "scratch" not in json.loads(admin(small_lab, "volume", "list", "--json").stdout)
    assert admin(small_lab, "volume", "create", "scratch").returncode == 0  # the name is free again
    assert admin(small_lab, "volume", "delete", "scratch").returncode == 0
    assert admin(small_lab, "gc", "--volume", "scratch", "--grace", "0", "--delete").returncode == 0


def test_force_deletes_a_mounted_volume_and_closes_its_sessions(small_lab) -> None:
    assert admin(small_lab, "volume", "create", "forced", "--policy", "ec:2+1").returncode == 0
    mp = mount(small_lab, "forced")
    try:
        (mp / "f").write_bytes(os.urandom(MiB))
        r = admin(small_lab, "volume", "delete", "forced", "--force")
        assert r.returncode == 0 and "1 slices to the garbage collector, 1 sessions closed" in r.stdout, r.stderr
    finally:
        umount(mp)
    r = admin(small_lab, "gc", "--volume", "forced", "--grace", "0", "--delete")
    assert r.returncode == 0 and "it is gone" in r.stdout, r.stdout + r.stderr
    assert shards(small_lab, "forced") == []
