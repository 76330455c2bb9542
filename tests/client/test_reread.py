"""What a file read again, or stat'ed after it was made here, costs the mount:
only the requests the kernel must send, each answered without extra work.

Counted from a real mount's metrics (``tests.client.localfs``: the real FUSE
client over a real metanode service, which grants leases); the mount's entry
and attribute timeouts are 0.5 s, its leases last far longer.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from .conftest import grown, mount_metrics, mount_ops

TIMEOUT = 0.5  # localfs's --entry-timeout and --attr-timeout


def _early_reads(port: int) -> int:
    m = re.search(r"^cachefs_mount_early_reads_total (\S+)$", mount_metrics(port), re.M)
    assert m, "no cachefs_mount_early_reads_total"
    return int(float(m.group(1)))


def _evict(filler: Path) -> None:
    """Make L1 (4 MiB in localfs) let go of what it holds: read 6 MiB of
    another file, its pages dropped first (written blocks enter L1 at its
    cold end, read ones at the hot end)."""
    filler.write_bytes(os.urandom(6 << 20))
    with open(filler, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        while f.read(1 << 20):
            pass


def _make_and_stat(d: Path, port: int) -> dict[str, int]:
    """Make a file of each kind in ``d`` (a new directory made here), wait out
    the mount's timeouts, stat them all: the FUSE requests that took."""
    d.mkdir()  # made here: leased, known empty
    data = {f"f{i}": os.urandom(1000 * (i + 1)) for i in range(5)}
    for name, payload in data.items():
        with open(d / name, "wb") as f:
            f.write(payload)
    (d / "sub").mkdir()
    os.mkfifo(d / "fifo")
    (d / "link").symlink_to("f0")
    os.link(d / "f1", d / "hard")
    time.sleep(TIMEOUT + 0.3)  # the mount's own timeouts are over
    before = mount_ops(port)
    for name, payload in data.items():
        assert os.stat(d / name).st_size == len(payload)
    assert os.stat(d / "sub").st_nlink == 2
    assert os.lstat(d / "fifo").st_mode & 0o170000 == 0o010000
    assert os.readlink(d / "link") == "f0"
    assert os.stat(d / "hard").st_ino == os.stat(d / "f1").st_ino
    return grown(before, mount_ops(port))


def test_names_made_here_are_kept_by_the_kernel_while_the_directory_is_leased(metered) -> None:
    """A create, mkdir, mknod, symlink or link in a directory this mount
    holds a lease on tells the kernel to keep the name (and the inode's
    attributes, when leased) for the lease's time, not the mount's 0.5 s: a
    stat of everything made here, after those 0.5 s, sends no lookup (10
    before); only the getattrs the kernel owes itself after its own writes
    and link (the 5 files written, the file linked: 6) and the readlink.
    (Another process's ``drop_caches``, which the benchmarks on a shared
    machine run, empties the kernel's dentry cache whatever the timeouts:
    then every name is looked up again, and the test tries once more.)"""
    m, port = metered
    tries = [_make_and_stat(m.path / "d0", port)]
    while "lookup" in tries[-1] and len(tries) < 3:
        tries.append(_make_and_stat(m.path / f"d{len(tries)}", port))
    assert "lookup" not in tries[-1], tries
    assert tries[-1].get("getattr", 0) <= 6 and set(tries[-1]) <= {"getattr", "readlink"}, tries


def test_a_file_read_again_starts_no_early_read(metered) -> None:
    """An open for reading starts fetching the file's slice list and first
    block (its read joins them), unless L1 and the inode already hold both:
    a second read, whether the kernel's pages were kept or dropped, starts
    nothing."""
    m, port = metered
    payload = os.urandom(200_000)
    (m.path / "f").write_bytes(payload)
    _evict(m.path / "filler")
    started = _early_reads(port)
    with open(m.path / "f", "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        assert f.read() == payload
    assert _early_reads(port) == started + 1  # L1 did not hold it: fetched ahead of the read
    before = mount_ops(port)
    for drop in (False, True, False, True):
        with open(m.path / "f", "rb", buffering=0) as f:
            if drop:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            assert f.read() == payload
    assert _early_reads(port) == started + 1
    sent = grown(before, mount_ops(port))
    assert sent.get("open") == 4 and sent.get("read", 0) >= 2, sent  # the dropped pages were read from L1


def test_a_symlink_target_is_kept_by_the_kernel(metered) -> None:
    """The mount asks for FUSE_CACHE_SYMLINKS: a symlink's target, read once,
    is read again from the kernel's page cache, past the mount's timeouts (a
    target never changes; a new one is a new inode). Replacing the link, by
    a rename over it or by unlink and symlink, shows the new target at once."""
    m, port = metered
    (m.path / "target-a").write_bytes(b"a")
    (m.path / "target-b").write_bytes(b"b")
    link = m.path / "link"
    link.symlink_to("target-a")
    before = mount_ops(port)
    for _ in range(4):
        assert os.readlink(link) == "target-a"
        assert link.read_bytes() == b"a"
        time.sleep(TIMEOUT / 2)  # past the mount's own timeouts, by the end
    assert grown(before, mount_ops(port)).get("readlink", 0) <= 1
    (m.path / "new").symlink_to("target-b")
    os.rename(m.path / "new", link)
    assert os.readlink(link) == "target-b"
    assert link.read_bytes() == b"b"
    link.unlink()
    link.symlink_to("target-a")
    assert os.readlink(link) == "target-a"
