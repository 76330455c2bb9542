"""The power-cut layer through a real FUSE mount: ordinary syscalls, then kill -9 of the layer."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefs.testing.powercut import PowerCutDisk

pytestmark = pytest.mark.needs_fuse


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[PowerCutDisk]:
    d = PowerCutDisk(tmp_path / "disk", tmp_path / "mnt")
    d.mount()
    try:
        yield d
    finally:
        d.cut()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def reboot(disk: PowerCutDisk) -> None:
    disk.cut()
    disk.mount()


def test_fsync_keeps_data_and_a_cut_drops_the_rest(disk: PowerCutDisk) -> None:
    m = disk.mountpoint
    with open(m / "wal", "wb", buffering=0) as f:
        f.write(b"record1;")
        os.fsync(f.fileno())
    fsync_dir(m)
    with open(m / "wal", "ab", buffering=0) as f:  # O_APPEND: written where the file ends
        f.write(b"record2;")
        os.fdatasync(f.fileno())
        f.write(b"torn")
    (m / "new").write_bytes(b"never synced")
    assert (m / "wal").read_bytes() == b"record1;record2;torn"
    assert sorted(os.listdir(m)) == ["new", "wal"]
    reboot(disk)
    assert os.listdir(m) == ["wal"]
    assert (m / "wal").read_bytes() == b"record1;record2;"
    assert sorted(os.listdir(disk.tree)) == ["wal"]


def test_rename_without_directory_fsync_rolls_back(disk: PowerCutDisk) -> None:
    m = disk.mountpoint
    (m / "state").write_bytes(b"v1")
    os.sync()  # reaches no FUSE filesystem: not a way to make anything durable here
    with open(m / "state", "rb+") as f:
        os.fsync(f.fileno())
    fsync_dir(m)
    with open(m / "state.tmp", "wb", buffering=0) as f:
        f.write(b"v2")
        os.fsync(f.fileno())
    os.replace(m / "state.tmp", m / "state")
    assert (m / "state").read_bytes() == b"v2"
    reboot(disk)
    assert os.listdir(m) == ["state"]
    assert (m / "state").read_bytes() == b"v1"


def test_a_directory_not_fsynced_into_its_parent_loses_its_files(disk: PowerCutDisk) -> None:
    m = disk.mountpoint
    (m / "a" / "b").mkdir(parents=True)
    with open(m / "a" / "b" / "f", "wb", buffering=0) as f:
        f.write(b"x" * 100_000)
        os.fsync(f.fileno())
    fsync_dir(m / "a" / "b")
    fsync_dir(m / "a")
    reboot(disk)
    assert os.listdir(m) == []
    (m / "a" / "b").mkdir(parents=True)
    (m / "a" / "b" / "f").write_bytes(b"x" * 100_000)
    with open(m / "a" / "b" / "f", "rb+") as f:
        os.fsync(f.fileno())
    for d in (m / "a" / "b", m / "a", m):
        fsync_dir(d)
    reboot(disk)
    assert (m / "a" / "b" / "f").read_bytes() == b"x" * 100_000


def test_behaves_like_a_local_filesystem(disk: PowerCutDisk) -> None:
    m = disk.mountpoint
    names = {f"file-{i:04d}" for i in range(600)}  # more than one readdir reply
    (m / "d").mkdir()
    for name in names:
        (m / "d" / name).write_bytes(name.encode())
    assert set(os.listdir(m / "d")) == names
    assert os.stat(m / "d").st_nlink == 2 and os.stat(m).st_nlink == 3
    big = os.urandom(3 << 20)
    (m / "big").write_bytes(big)
    assert os.stat(m / "big").st_size == len(big)
    with open(m / "big", "rb") as f:
        f.seek(1 << 20)
        assert f.read(4096) == big[1 << 20 : (1 << 20) + 4096]
    os.truncate(m / "big", 10)
    assert (m / "big").read_bytes() == big[:10]
    os.link(m / "big", m / "d" / "hard")
    assert os.stat(m / "big").st_nlink == 2
    with open(m / "d" / "file-0001", "rb") as f:
        os.unlink(m / "d" / "file-0001")
        assert f.read() == b"file-0001"  # an unlinked open file keeps answering
    os.rename(m / "d", m / "e")
    assert (m / "e" / "hard").read_bytes() == big[:10]
    with pytest.raises(OSError):
        os.rmdir(m / "e")
    os.chmod(m / "big", 0o600)
    assert os.stat(m / "big").st_mode & 0o777 == 0o600
    assert os.statvfs(m).f_bsize > 0


def test_a_clean_unmount_syncs_everything(tmp_path: Path) -> None:
    disk = PowerCutDisk(tmp_path / "disk", tmp_path / "mnt")
    disk.mount()
    m = disk.mountpoint
    (m / "a").mkdir()
    (m / "a" / "f").write_bytes(b"kept")
    disk.unmount()
    assert (disk.tree / "a" / "f").read_bytes() == b"kept"
    disk.mount()
    try:
        assert (m / "a" / "f").read_bytes() == b"kept"
    finally:
        disk.cut()
