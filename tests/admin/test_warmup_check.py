"""``cachefs warmup --check / --evict / -f LIST`` against the small lab's cache node:
the fraction cached per zone follows what was warmed and what was evicted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

MiB = 1 << 20


def warmup(lab, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "cachefs.cli", "warmup", "--volume", "lab", "--meta", ",".join(lab.meta_addrs),
            "--secret-file", str(lab.credential_file("client")), "--quiet", *args]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_check_reports_the_cached_fraction_and_evict_drops_it(small_lab, small_mnt, tmp_path: Path) -> None:
    top = small_mnt / "warm-check"
    top.mkdir()
    (top / "a").write_bytes(os.urandom(8 * MiB))  # 2 blocks
    (top / "b").write_bytes(os.urandom(4 * MiB))  # 1 block
    listing = tmp_path / "paths"
    listing.write_text("# the training set\n/warm-check/a\n\n/warm-check/b\n")

    r = warmup(small_lab, "--evict", "-f", str(listing))  # whatever the writes put there
    assert r.returncode == 0 and "zone z1: evicted" in r.stdout, r.stdout + r.stderr
    r = warmup(small_lab, "--check", "-f", str(listing))
    assert r.returncode == 0, r.stderr
    assert f"zone z1: 0.0% cached (0 of 3 blocks, 0 of {12 * MiB} bytes)" in r.stdout, r.stdout

    assert warmup(small_lab, "/warm-check/a").returncode == 0
    r = warmup(small_lab, "--check", "-f", str(listing))
    assert f"zone z1: 66.7% cached (2 of 3 blocks, {8 * MiB} of {12 * MiB} bytes)" in r.stdout, r.stdout
    r = warmup(small_lab, "--check", "/warm-check")  # a directory: everything under it
    assert "zone z1: 66.7% cached (2 of 3 blocks" in r.stdout, r.stdout

    assert warmup(small_lab, "-f", str(listing)).returncode == 0
    r = warmup(small_lab, "--check", "/warm-check/b", "-f", str(listing))
    assert f"zone z1: 100.0% cached (3 of 3 blocks, {12 * MiB} of {12 * MiB} bytes)" in r.stdout, r.stdout  # b once

    r = warmup(small_lab, "--evict", "/warm-check/a")
    assert r.returncode == 0 and "zone z1: evicted 2 of 2 blocks" in r.stdout, r.stdout
    r = warmup(small_lab, "--check", "-f", str(listing))
    assert f"zone z1: 33.3% cached (1 of 3 blocks, {4 * MiB} of {12 * MiB} bytes)" in r.stdout, r.stdout
    assert (top / "a").stat().st_size == 8 * MiB  # evicting changes no file

    r = warmup(small_lab, "--check")
    assert r.returncode == 2 and "no paths" in r.stderr, r.stderr
    r = warmup(small_lab, "--check", "--evict", "/warm-check")
    assert r.returncode == 2 and "exclude each other" in r.stderr, r.stderr
    r = warmup(small_lab, "-f", str(tmp_path / "absent"))
    assert r.returncode == 2 and "cannot read" in r.stderr, r.stderr
