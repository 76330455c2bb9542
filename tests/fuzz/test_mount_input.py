"""Bad input through a real FUSE mount: each case gets the right errno and leaves the tree consistent.

The kernel checks some cases itself (names over 255 bytes, xattr values over
64 KiB, negative offsets, a directory renamed into itself, hard links to
directories); the others reach cachefs (offsets and sizes past its largest
file, quotas). Names with an embedded NUL or '/' cannot pass a path-based
syscall at all, so they are sent where they do arrive as bytes: the metanode
API the client uses. After every case the namespace is walked and checked.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
import trio

from cachefs.commands import SetQuota
from cachefs.errors import CacheFSError
from cachefs.queries import GetUsage
from cachefs.rpc import RpcPool

MAX_FILE_SIZE = (64 << 20) * ((1 << 32) - 1)  # cachefs/layout.py: CHUNK_SIZE * U32


def _errno(fn, *args) -> int:
    with pytest.raises(OSError) as info:
        fn(*args)
    return info.value.errno


def consistent(root: Path) -> int:
    """Walk the tree by directory fds (it may be deeper than PATH_MAX): every
    listed entry stats, every directory's link count adds up (fwalk lists a
    symlink to a directory among the directories; it adds no link)."""
    count = 0
    for _dirpath, dirnames, filenames, dirfd in os.fwalk(root):
        st = os.fstat(dirfd)
        modes = {name: os.lstat(name, dir_fd=dirfd).st_mode for name in filenames + dirnames}
        subdirs = [name for name in dirnames if stat.S_ISDIR(modes[name])]
        assert st.st_nlink == 2 + len(subdirs), (_dirpath[-80:], st.st_nlink, subdirs)
        count += len(modes)
    return count


@pytest.fixture
def d(small_mnt: Path, request) -> Path:
    path = small_mnt / request.node.name.replace("[", "_").replace("]", "")
    path.mkdir()
    yield path
    consistent(small_mnt)


def test_names_up_to_255_bytes_and_no_longer(d: Path) -> None:
    (d / ("a" * 255)).write_bytes(b"ok")
    assert (d / ("a" * 255)).read_bytes() == b"ok"
    assert _errno(os.open, d / ("b" * 256), os.O_CREAT | os.O_WRONLY) == errno.ENAMETOOLONG
    assert _errno(os.mkdir, d / ("c" * 300)) == errno.ENAMETOOLONG
    assert _errno(os.rename, d / ("a" * 255), d / ("d" * 256)) == errno.ENAMETOOLONG
    assert sorted(os.listdir(d)) == ["a" * 255]


def test_nul_and_slash_in_names_refused_by_the_metanode(small_lab, small_mnt: Path, d: Path) -> None:
    ino = os.stat(d).st_ino

    async def scenario():
        async with RpcPool(secret=small_lab.secret) as pool:
            meta = small_lab.meta_client(pool, deadline=10)
            # raw requests ([client_id, seq, volume, parent, name, mode]): the
            # client library would refuse them before they left
            for bad in (b"a\0b", b"a/b", b"/", b"\0", b".", b"..", b""):
                with pytest.raises(CacheFSError) as info:
                    await meta.call("mknod", {"a": ["fuzz", 0, "lab", ino, bad, 0o100644]})
                assert info.value.errno == errno.EINVAL and info.value.remote, bad
                with pytest.raises(CacheFSError) as info:
                    await meta.call("mkdir", {"a": ["fuzz", 0, "lab", ino, bad, 0o755]})
                assert info.value.remote, bad
            with pytest.raises(CacheFSError) as info:
                await meta.call("mknod", {"a": ["fuzz", 0, "lab", ino, b"x" * 256, 0o100644]})
            assert info.value.errno == errno.ENAMETOOLONG and info.value.remote

    trio.run(scenario)
    assert os.listdir(d) == []


def test_deep_paths(d: Path) -> None:
    """A tree deeper than PATH_MAX: reachable by relative steps, the full path is ENAMETOOLONG."""
    fd = os.open(d, os.O_RDONLY)
    fds = [fd]
    try:
        for _ in range(90):
            os.mkdir("x" * 50, dir_fd=fds[-1])
            fds.append(os.open("x" * 50, os.O_RDONLY, dir_fd=fds[-1]))
        leaf = os.open("leaf", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fds[-1])
        os.write(leaf, b"deep")
        os.close(leaf)
        full = d.joinpath(*["x" * 50] * 90, "leaf")
        assert _errno(os.stat, full) == errno.ENAMETOOLONG
        leaf = os.open("leaf", os.O_RDONLY, dir_fd=fds[-1])
        assert os.read(leaf, 10) == b"deep"
        os.close(leaf)
    finally:
        for f in fds:
            os.close(f)


def test_huge_xattrs(d: Path) -> None:
    f = d / "f"
    f.write_bytes(b"")
    assert _errno(os.setxattr, f, "user.big", b"v" * (64 * 1024 + 1)) == errno.E2BIG
    assert _errno(os.setxattr, f, "user." + "n" * 300, b"v") == errno.ERANGE
    os.setxattr(f, "user.max", b"m" * (64 * 1024))
    assert os.getxattr(f, "user.max") == b"m" * (64 * 1024)
    assert os.listxattr(f) == ["user.max"]
    assert _errno(os.getxattr, f, "user.missing") == errno.ENODATA


def test_negative_and_huge_offsets(d: Path) -> None:
    f = d / "f"
    fd = os.open(f, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.write(fd, b"hello")
        assert _errno(os.pwrite, fd, b"x", -1) == errno.EINVAL
        assert _errno(os.pread, fd, 1, -1) == errno.EINVAL
        assert _errno(os.lseek, fd, -10, os.SEEK_SET) == errno.EINVAL
        assert os.pread(fd, 10, 2**62) == b""  # reading past the end is EOF, not an error
        os.fsync(fd)
    finally:
        os.close(fd)
    assert f.read_bytes() == b"hello"
    assert f.stat().st_size == 5


def test_write_past_the_largest_file_is_efbig(d: Path) -> None:
    fd = os.open(d / "f", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        assert _errno(os.pwrite, fd, b"x", MAX_FILE_SIZE) == errno.EFBIG
        os.fsync(fd)
    finally:
        os.close(fd)


def test_truncate_past_the_largest_file_is_efbig(d: Path) -> None:
    f = d / "f"
    f.write_bytes(b"data")
    assert _errno(os.truncate, f, MAX_FILE_SIZE + 1) == errno.EFBIG


def test_truncate_within_limits(d: Path) -> None:
    f = d / "f"
    f.write_bytes(b"data")
    assert _errno(os.truncate, f, MAX_FILE_SIZE + 1) in (errno.EFBIG, errno.EINVAL)
    assert _errno(os.truncate, f, -1) == errno.EINVAL
    assert f.read_bytes() == b"data"
    os.truncate(f, 1 << 30)  # sparse, within the limit
    assert f.stat().st_size == 1 << 30
    os.truncate(f, 2)
    assert f.read_bytes() == b"da"


def test_rename_directory_into_itself_and_links_to_directories(d: Path) -> None:
    (d / "a" / "b").mkdir(parents=True)
    assert _errno(os.rename, d / "a", d / "a" / "b" / "c") == errno.EINVAL
    assert _errno(os.rename, d / "a", d / "a" / "c") == errno.EINVAL
    assert _errno(os.link, d / "a", d / "alink") == errno.EPERM
    assert _errno(os.rmdir, d / "a") == errno.ENOTEMPTY
    assert sorted(os.listdir(d)) == ["a"]
    assert os.listdir(d / "a") == ["b"]


def _set_quota(small_lab, ino: int, **kw) -> dict:
    """Set a directory quota; returns the usage before (``inodes``, ``bytes``)."""

    async def go():
        async with RpcPool(secret=small_lab.secret) as pool:
            meta = small_lab.meta_client(pool, deadline=10)
            usage = await meta.query(GetUsage("lab", ino))
            if "max_inodes" in kw:
                kw["max_inodes"] += usage.inodes
            await meta.mutate(SetQuota("lab", ino, **kw))
            return usage._asdict()

    return trio.run(go)


def test_inode_quota_exceeded_is_edquot(small_lab, d: Path) -> None:
    _set_quota(small_lab, os.stat(d).st_ino, max_inodes=2)  # two more than now
    (d / "ok").write_bytes(b"x" * 1000)
    (d / "s1").mkdir()
    assert _errno(os.mkdir, d / "s2") == errno.EDQUOT
    assert _errno(os.open, d / "f2", os.O_CREAT | os.O_WRONLY) == errno.EDQUOT
    assert (d / "ok").read_bytes() == b"x" * 1000
    assert sorted(os.listdir(d)) == ["ok", "s1"]


def test_byte_quota_exceeded_is_edquot(small_lab, d: Path) -> None:
    _set_quota(small_lab, os.stat(d).st_ino, max_bytes=1 << 20)
    with pytest.raises(OSError) as info, open(d / "big", "wb") as f:
        f.write(b"y" * (2 << 20))
        f.flush()
        os.fsync(f.fileno())
    assert info.value.errno == errno.EDQUOT
