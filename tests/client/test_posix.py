"""POSIX behaviour through a real FUSE mount of the cachefs client."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest


@pytest.fixture
def mnt(mnt_dir: Path) -> Path:
    """One mount for the module, a directory of its own for each test."""
    return mnt_dir


def test_create_write_read(mnt: Path) -> None:
    data = os.urandom(300_000)
    (mnt / "f").write_bytes(data)
    assert (mnt / "f").read_bytes() == data
    st = os.stat(mnt / "f")
    assert st.st_size == len(data) and stat.S_ISREG(st.st_mode)


def test_lookup_missing(mnt: Path) -> None:
    with pytest.raises(FileNotFoundError):
        os.stat(mnt / "nope")
    with pytest.raises(FileNotFoundError):
        os.stat(mnt / "nope" / "deeper")


def test_a_name_past_name_max_is_too_long(mnt: Path) -> None:
    """As on ext4 (pjdfstest chmod/02, chown/02, truncate/02, link/02 found
    it): a lookup of a 256-byte name is ENAMETOOLONG, not ENOENT."""
    long = "x" * 256
    for call in (os.stat, lambda p: os.chmod(p, 0o600), lambda p: os.truncate(p, 1)):
        with pytest.raises(OSError) as raised:
            call(mnt / long)
        assert raised.value.errno == errno.ENAMETOOLONG
    (mnt / ("y" * 255)).write_bytes(b"ok")  # NAME_MAX itself is fine
    assert (mnt / ("y" * 255)).read_bytes() == b"ok"


def test_overwrite_append_and_truncate_flags(mnt: Path) -> None:
    p = mnt / "f"
    p.write_bytes(b"a" * 10_000)
    with open(p, "r+b") as f:
        f.seek(5000)
        f.write(b"B" * 100)
    assert p.read_bytes() == b"a" * 5000 + b"B" * 100 + b"a" * 4900
    with open(p, "ab") as f:  # O_APPEND
        f.write(b"tail")
    assert p.read_bytes()[-6:] == b"aatail" and p.stat().st_size == 10_004
    fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
    os.write(fd, b"new")
    os.close(fd)
    assert p.read_bytes() == b"new"
    with pytest.raises(FileExistsError):
        os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    fd = os.open(mnt / "g", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640)
    os.close(fd)
    assert stat.S_IMODE(os.stat(mnt / "g").st_mode) == 0o640


def test_truncate_shrink_and_grow(mnt: Path) -> None:
    p = mnt / "t"
    data = os.urandom(200_000)
    p.write_bytes(data)
    os.truncate(p, 70_000)
    assert p.read_bytes() == data[:70_000]
    os.truncate(p, 150_000)
    assert p.read_bytes() == data[:70_000] + bytes(80_000)
    with open(p, "r+b") as f:
        f.write(b"x" * 10)
        f.truncate(5)  # ftruncate with pending data
        f.seek(0, 2)
        f.write(b"yz")
    assert p.read_bytes() == b"xxxxxyz"


def test_sparse_file_reads_zeros(mnt: Path) -> None:
    p = mnt / "sparse"
    with open(p, "wb") as f:
        f.seek(100 << 20)
        f.write(b"end")
    assert p.stat().st_size == (100 << 20) + 3
    with open(p, "rb") as f:
        f.seek(50 << 20)
        assert f.read(4096) == bytes(4096)
        f.seek(100 << 20)
        assert f.read() == b"end"


def test_random_writes_across_blocks_match_model(mnt: Path) -> None:
    import random

    rng = random.Random(7)
    model = bytearray(600_000)
    p = mnt / "r"
    p.write_bytes(model)
    with open(p, "r+b", buffering=0) as f:
        for _ in range(120):
            off = rng.randrange(0, 590_000)
            n = rng.randrange(1, 10_000)
            chunk = rng.randbytes(n)
            f.seek(off)
            f.write(chunk)
            model[off : off + n] = chunk
            if rng.random() < 0.2:
                f.seek(rng.randrange(0, 500_000))
                pos = f.tell()
                assert f.read(5000) == bytes(model[pos : pos + 5000])
    assert hashlib.sha256(p.read_bytes()).hexdigest() == hashlib.sha256(model).hexdigest()


def test_chmod_chown_utimens(mnt: Path) -> None:
    p = mnt / "m"
    p.write_bytes(b"x")
    os.chmod(p, 0o600)
    os.chown(p, 1234, 5678)
    os.utime(p, ns=(1_000_000_123, 2_000_000_456))
    st = os.stat(p)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_123, 2_000_000_456)


def test_directories(mnt: Path) -> None:
    os.mkdir(mnt / "d", 0o750)
    assert stat.S_ISDIR(os.stat(mnt / "d").st_mode)
    with pytest.raises(FileExistsError):
        os.mkdir(mnt / "d")
    (mnt / "d" / "f").write_bytes(b"1")
    with pytest.raises(OSError) as e:
        os.rmdir(mnt / "d")
    assert e.value.errno == errno.ENOTEMPTY
    with pytest.raises(NotADirectoryError):
        os.rmdir(mnt / "d" / "f")
    with pytest.raises(IsADirectoryError):
        os.unlink(mnt / "d")
    with pytest.raises(NotADirectoryError):
        os.mkdir(mnt / "d" / "f" / "sub")
    os.unlink(mnt / "d" / "f")
    os.rmdir(mnt / "d")
    assert os.listdir(mnt) == []


def test_a_refused_rmdir_leaves_the_next_rmdir_its_own_lease(mnt: Path) -> None:
    """ENOTEMPTY changed nothing, so the mount still knows the directory's
    inode under its parent's lease: the rmdir after the unlink keeps its own
    lease on it instead of having the leader revoke it while the kernel holds
    the directory's lock for that rmdir (which waited out a lease term)."""
    from cachefs.metanode.leases import DEFAULT_TERM

    os.mkdir(mnt / "full")
    (mnt / "full" / "f").write_bytes(b"1")
    with pytest.raises(OSError) as e:
        os.rmdir(mnt / "full")
    assert e.value.errno == errno.ENOTEMPTY
    os.unlink(mnt / "full" / "f")
    started = time.monotonic()
    os.rmdir(mnt / "full")
    assert time.monotonic() - started < DEFAULT_TERM / 2  # ~1 ms; a lapse is the whole term
    assert not (mnt / "full").exists()


def _renameat2(old: Path, new: Path, flags: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(-100, bytes(old), -100, bytes(new), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def test_rename_variants(mnt: Path) -> None:
    (mnt / "a").write_bytes(b"A")
    (mnt / "b").write_bytes(b"B")
    os.mkdir(mnt / "dir")
    os.rename(mnt / "a", mnt / "dir" / "a2")
    assert (mnt / "dir" / "a2").read_bytes() == b"A" and not (mnt / "a").exists()
    os.rename(mnt / "b", mnt / "dir" / "a2")  # replaces the target
    assert (mnt / "dir" / "a2").read_bytes() == b"B"
    (mnt / "c").write_bytes(b"C")
    with pytest.raises(FileExistsError):
        _renameat2(mnt / "c", mnt / "dir" / "a2", 1)  # RENAME_NOREPLACE
    _renameat2(mnt / "c", mnt / "dir" / "a2", 2)  # RENAME_EXCHANGE
    assert (mnt / "c").read_bytes() == b"B" and (mnt / "dir" / "a2").read_bytes() == b"C"
    os.mkdir(mnt / "dir" / "sub")
    with pytest.raises(OSError) as e:
        os.rename(mnt / "dir", mnt / "dir" / "sub" / "inside")
    assert e.value.errno == errno.EINVAL
    os.mkdir(mnt / "full")
    (mnt / "full" / "x").write_bytes(b"")
    with pytest.raises(OSError) as e:
        os.rename(mnt / "dir" / "sub", mnt / "full")
    assert e.value.errno in (errno.ENOTEMPTY, errno.EEXIST)


def test_hard_links(mnt: Path) -> None:
    (mnt / "one").write_bytes(b"data")
    os.link(mnt / "one", mnt / "two")
    assert os.stat(mnt / "one").st_nlink == 2
    assert os.stat(mnt / "one").st_ino == os.stat(mnt / "two").st_ino
    os.unlink(mnt / "one")
    assert (mnt / "two").read_bytes() == b"data" and os.stat(mnt / "two").st_nlink == 1
    os.mkdir(mnt / "d")
    with pytest.raises(PermissionError):
        os.link(mnt / "d", mnt / "d2")


def test_symlinks(mnt: Path) -> None:
    (mnt / "target").write_bytes(b"T")
    os.symlink("target", mnt / "link")
    assert os.readlink(mnt / "link") == "target"
    assert (mnt / "link").read_bytes() == b"T"
    assert stat.S_ISLNK(os.lstat(mnt / "link").st_mode)
    os.symlink("/nowhere/at/all", mnt / "dangling")
    assert not (mnt / "dangling").exists() and os.readlink(mnt / "dangling") == "/nowhere/at/all"
    with pytest.raises(FileExistsError):
        os.symlink("x", mnt / "link")


def test_mknod_fifo(mnt: Path) -> None:
    os.mkfifo(mnt / "fifo", 0o600)
    assert stat.S_ISFIFO(os.stat(mnt / "fifo").st_mode)


def test_large_directory_listing(mnt: Path) -> None:
    os.mkdir(mnt / "big")
    names = {f"file-{i:05d}" for i in range(1500)}
    for name in names:
        os.close(os.open(mnt / "big" / name, os.O_CREAT | os.O_WRONLY, 0o644))
    assert set(os.listdir(mnt / "big")) == names


def test_entries_changing_during_listing(mnt: Path) -> None:
    """Entries present for the whole listing are returned exactly once."""
    d = mnt / "churn"
    os.mkdir(d)
    stable = {f"s{i:04d}" for i in range(600)}
    for name in stable:
        (d / name).write_bytes(b"")
    seen: list[str] = []
    with os.scandir(d) as it:
        for i, entry in enumerate(it):
            seen.append(entry.name)
            if i % 50 == 0:
                (d / f"new{i}").write_bytes(b"")
                victim = f"new{i - 50}"
                if (d / victim).exists():
                    os.unlink(d / victim)
    got = [n for n in seen if n in stable]
    assert sorted(got) == sorted(stable) and len(got) == len(set(got))


def test_statfs(mnt: Path) -> None:
    st = os.statvfs(mnt)
    assert st.f_bsize > 0 and st.f_namemax == 255 and st.f_blocks > 0


def test_xattrs(mnt: Path) -> None:
    p = mnt / "x"
    p.write_bytes(b"")
    os.setxattr(p, "user.color", b"blue")
    os.setxattr(p, "user.size", b"L")
    assert os.getxattr(p, "user.color") == b"blue"
    assert sorted(os.listxattr(p)) == ["user.color", "user.size"]
    os.removexattr(p, "user.color")
    assert os.listxattr(p) == ["user.size"]
    with pytest.raises(OSError) as e:
        os.getxattr(p, "user.color")
    assert e.value.errno == errno.ENODATA


def test_unlinked_open_file_stays_readable(mnt: Path) -> None:
    data = os.urandom(500_000)
    (mnt / "gone").write_bytes(data)
    fd = os.open(mnt / "gone", os.O_RDWR)
    try:
        os.unlink(mnt / "gone")
        assert not (mnt / "gone").exists()
        assert os.fstat(fd).st_size == len(data)
        assert os.pread(fd, len(data), 0) == data
        os.pwrite(fd, b"more", len(data))
        os.fsync(fd)
        assert os.pread(fd, 10, len(data) - 6) == data[-6:] + b"more"
        assert os.fstat(fd).st_nlink == 0
    finally:
        os.close(fd)


def test_fsync_and_second_open_see_data(mnt: Path) -> None:
    p = mnt / "s"
    with open(p, "wb") as f:
        f.write(b"x" * 100_000)
        f.flush()
        os.fsync(f.fileno())
        with open(p, "rb") as g:
            assert g.read() == b"x" * 100_000


def test_forgotten_inodes_are_looked_up_again(mnt: Path) -> None:
    for i in range(100):
        (mnt / f"f{i}").write_bytes(str(i).encode())
    Path("/proc/sys/vm/drop_caches").write_text("2\n")  # the kernel forgets dentries/inodes
    for i in range(100):
        assert (mnt / f"f{i}").read_bytes() == str(i).encode()


def test_many_small_writes_are_compacted(localmount) -> None:
    """On a mount of its own: its log must show this file's compaction."""
    import time

    p = localmount.path / "c"
    model = bytearray(100_000)
    p.write_bytes(model)
    with open(p, "r+b", buffering=0) as f:
        for i in range(40):
            off = (i * 7919) % 99_000
            f.seek(off)
            f.write(bytes([i + 1]) * 700)
            model[off : off + 700] = bytes([i + 1]) * 700
            os.fsync(f.fileno())  # one slice each
    deadline = time.monotonic() + 10
    while "compacted chunk 0" not in localmount.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "compacted chunk 0" in localmount.log()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")
    assert p.read_bytes() == bytes(model)


NOBODY = 65534

PERM_SCRIPT = r"""
import errno, os, sys
root = sys.argv[1]
def expect(err, fn, *args):
    try:
        fn(*args)
    except OSError as e:
        assert e.errno == err, (fn, args, e)
    else:
        raise AssertionError(f"{fn.__name__}{args} succeeded")
expect(errno.EACCES, os.open, root + "/private", os.O_RDONLY)
expect(errno.EACCES, os.open, root + "/readonly", os.O_WRONLY)
assert open(root + "/readonly", "rb").read() == b"public"
expect(errno.EACCES, os.mkdir, root + "/closed/sub")
expect(errno.EACCES, os.open, root + "/closed/new", os.O_CREAT | os.O_WRONLY, 0o644)
expect(errno.EPERM, os.chmod, root + "/readonly", 0o777)
expect(errno.EPERM, os.chown, root + "/open/mine", 0, 0)
with open(root + "/open/mine", "wb") as f:
    f.write(b"nobody")
st = os.stat(root + "/open/mine")
assert (st.st_uid, st.st_gid) == (65534, 65534), st
os.chmod(root + "/open/mine", 0o600)
expect(errno.EPERM, os.unlink, root + "/sticky/roots")
os.unlink(root + "/open/mine")
print("ok")
"""


def test_permissions_for_a_non_root_user(mnt: Path) -> None:
    (mnt / "private").write_bytes(b"secret")
    os.chmod(mnt / "private", 0o600)
    (mnt / "readonly").write_bytes(b"public")
    os.chmod(mnt / "readonly", 0o644)
    os.mkdir(mnt / "closed", 0o755)
    os.mkdir(mnt / "open")
    os.chmod(mnt / "open", 0o777)
    os.mkdir(mnt / "sticky")
    os.chmod(mnt / "sticky", 0o1777)
    (mnt / "sticky" / "roots").write_bytes(b"")
    (mnt / "open" / "mine").write_bytes(b"")
    os.chown(mnt / "open" / "mine", NOBODY, NOBODY)
    proc = subprocess.run(
        ["/usr/bin/python3", "-c", PERM_SCRIPT, str(mnt)], user=NOBODY, group=NOBODY, capture_output=True, text=True,
        timeout=60, cwd="/",
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert not (mnt / "open" / "mine").exists()


def test_setgid_directory_passes_its_group(mnt: Path) -> None:
    os.mkdir(mnt / "g")
    os.chown(mnt / "g", 0, 4321)
    os.chmod(mnt / "g", 0o2775)
    (mnt / "g" / "f").write_bytes(b"")
    os.mkdir(mnt / "g" / "sub")
    assert os.stat(mnt / "g" / "f").st_gid == 4321
    st = os.stat(mnt / "g" / "sub")
    assert st.st_gid == 4321 and st.st_mode & stat.S_ISGID
