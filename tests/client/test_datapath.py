"""The data path's shortcuts keep their guarantees: O_DIRECT handles, the
attribute cache, written blocks in L1, the FUSE connection's background limit."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cachefs.client.l1 import L1Cache
from cachefs.client.mount import FUSECTL
from cachefs.ids import BlockKey

FIO_DIR = Path(__file__).resolve().parents[2] / "bench" / "fio"


@pytest.fixture
def mnt(mnt_dir: Path) -> Path:
    """One mount for the module, a directory of its own for each test."""
    return mnt_dir


def test_l1_cold_blocks_are_evicted_first() -> None:
    cache = L1Cache(3 * 10)
    a, b, w, c = (BlockKey(i, 0) for i in range(4))
    cache.put(a, b"a" * 10)
    cache.put(b, b"b" * 10)
    cache.put(w, b"w" * 10, cold=True)
    assert cache.get(w) == b"w" * 10  # kept while there is room
    cache.put(c, b"c" * 10)  # full: the least recently used goes (a: w was just read)
    assert a not in cache and w in cache
    cache.put(BlockKey(9, 0), b"x" * 10, cold=True)  # evicts b, goes in at the cold end
    cache.put(BlockKey(8, 0), b"y" * 10)  # the cold block goes before any read one
    assert BlockKey(9, 0) not in cache
    assert w in cache and c in cache and BlockKey(8, 0) in cache
    assert cache.used == 30


def _aligned(data: bytes) -> mmap.mmap:
    buf = mmap.mmap(-1, len(data))  # page aligned, as O_DIRECT wants
    buf.write(data)
    return buf


def test_direct_write_then_buffered_open_sees_it(mnt: Path) -> None:
    p = mnt / "f"
    p.write_bytes(b"a" * 8192)
    assert p.read_bytes() == b"a" * 8192  # now in the page cache
    with open(p, "rb") as cached:  # a buffered opener while O_DIRECT writes
        assert cached.read(8192) == b"a" * 8192
        fd = os.open(p, os.O_RDWR | os.O_DIRECT)
        try:
            assert os.pwrite(fd, _aligned(b"b" * 4096), 4096) == 4096
            back = _aligned(bytes(4096))
            assert os.preadv(fd, [back], 4096) == 4096
            assert bytes(back) == b"b" * 4096
        finally:
            os.close(fd)
    assert p.read_bytes() == b"a" * 4096 + b"b" * 4096


def test_direct_write_past_eof_grows_the_file(mnt: Path) -> None:
    p = mnt / "g"
    fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    try:
        for i in range(4):
            assert os.pwrite(fd, _aligned(bytes([i]) * 65536), i * 65536) == 65536
    finally:
        os.close(fd)
    assert p.stat().st_size == 4 * 65536
    assert p.read_bytes() == b"".join(bytes([i]) * 65536 for i in range(4))


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_fio_direct_libaio_randrw_verify_crc32c(mnt: Path, tmp_path: Path) -> None:
    """The tutorial job's shape (O_DIRECT, libaio, deep queue, 1 MiB random
    mixed), smaller, with every block verified."""
    job = [
        "fio", "--name=direct", f"--directory={mnt}", "--filename=dio", "--ioengine=libaio",
        "--direct=1", "--bs=1M", "--iodepth=16", "--size=16M", "--rw=randwrite",
        "--verify=crc32c", "--verify_fatal=1", "--do_verify=1", "--randrepeat=1",
        "--fallocate=none",
    ]  # fmt: skip
    proc = subprocess.run(job, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert "err= 0" in proc.stdout, proc.stdout


def test_namespace_change_here_refreshes_cached_attributes(mnt: Path) -> None:
    """nlink (and ctime) of an inode change under a name we unlink: the
    attribute cache must not answer with the old ones."""
    (mnt / "f").write_bytes(b"x")
    os.link(mnt / "f", mnt / "g")
    assert os.stat(mnt / "f").st_nlink == 2
    os.unlink(mnt / "g")
    assert os.stat(mnt / "f").st_nlink == 1


def test_xattr_changes_here_are_seen_at_once(mnt: Path) -> None:
    p = mnt / "x"
    p.write_bytes(b"")
    with pytest.raises(OSError):
        os.getxattr(p, "user.k")  # a cached "no such attribute"...
    os.setxattr(p, "user.k", b"1")
    assert os.getxattr(p, "user.k") == b"1"  # ...voided by the change
    os.setxattr(p, "user.k", b"2")
    assert os.getxattr(p, "user.k") == b"2"
    os.removexattr(p, "user.k")
    with pytest.raises(OSError):
        os.getxattr(p, "user.k")


def test_max_background_raised(mnt: Path) -> None:
    conn = FUSECTL / str(os.minor(os.stat(mnt).st_dev))
    if not (conn / "max_background").exists():
        pytest.skip("fusectl is not available here")
    assert int((conn / "max_background").read_text()) == 64
    assert int((conn / "congestion_threshold").read_text()) == 48


def test_slice_lists_outlive_a_forgotten_inode_at_the_same_version() -> None:
    from cachefs.client.inodes import InodeTable
    from cachefs.layout import Slice
    from cachefs.messages import Attr

    def attr(version: int) -> Attr:
        return Attr(ino=7, mode=0o100644, uid=0, gid=0, nlink=1, size=10,
                    atime_ns=0, mtime_ns=0, ctime_ns=0, version=version)  # fmt: skip

    table = InodeTable()
    node = table.learn(attr(3))
    lists = [Slice(5, 0, 10)]
    node.chunks[0] = ((3, node.layout), lists)
    node.chunks[1] = ((2, node.layout), [Slice(4, 0, 10)])  # stale: not kept
    table.forget(7, 1)
    assert table.get(7) is None
    back = table.update(attr(3))
    assert back is not node
    assert back.chunks == {0: ((3, back.layout), lists)}
    table.forget(7, 0)  # idle again (no lookups): leaves with its list
    assert table.update(attr(4)).chunks == {}  # the content changed meanwhile
