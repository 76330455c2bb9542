"""Small files fetched ahead, pushed into the kernel's page cache (client/pagepush.py).

The rules first, over real inodes and a real L1 with the kernel call
recorded: what is pushed (the whole file of the version its slice list was
read at, holes as zeros), and every case that must not be (open here, being
written, unknown to the kernel, pages of another version, a stale list, a
block not in L1). Then on real mounts: a fresh mount lists a directory,
opens one file, and the files fetched ahead are read without a read
request reaching it; another mount's change after the push is seen by the
next open, in content and size.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import time
from pathlib import Path

import pytest

from cachefs.client.inodes import Inode, InodeTable
from cachefs.client.l1 import L1Cache
from cachefs.client.pagepush import PagePush
from cachefs.ids import BlockKey
from cachefs.layout import Slice
from cachefs.messages import Attr
from cachefs.testing.ports import free_port

from .conftest import ClusterMount, grown, mount_metrics, mount_ops

BS = 1 << 20


class Kernel:
    """Records what would be stored in the page cache; ``fail``: the errno to raise."""

    def __init__(self) -> None:
        self.stored: list[tuple[int, int, bytes]] = []
        self.fail = 0

    def __call__(self, ino: int, offset: int, data: bytes | bytearray | memoryview) -> None:
        if self.fail:
            raise OSError(self.fail, os.strerror(self.fail))
        self.stored.append((ino, offset, bytes(data)))


def _inode(table: InodeTable, ino: int, size: int, slices: list[Slice], version: int = 3) -> Inode:
    attr = Attr(ino, stat.S_IFREG | 0o644, 0, 0, 1, size, 0, 0, 0, version=version)
    inode = table.learn(attr)
    inode.chunks[0] = ((version, inode.layout), slices)
    return inode


def _setup() -> tuple[InodeTable, L1Cache, Kernel, PagePush]:
    table, l1, kernel = InodeTable(), L1Cache(64 * BS), Kernel()
    return table, l1, kernel, PagePush(table, l1, BS, kernel)


def test_a_small_file_whose_block_is_in_l1_is_pushed_whole_at_its_version() -> None:
    table, l1, kernel, push = _setup()
    block = os.urandom(BS)
    l1.put(BlockKey(7, 0), block)
    inode = _inode(table, 10, 5000, [Slice(7, 0, 5000, 100)])  # bytes 100.. of slice 7
    assert push.offer(10)
    assert kernel.stored == [(10, 0, block[100:5100])]
    assert inode.cached_version == 3 and inode.pushed
    assert push.stats == {"page_pushes": 1, "page_push_bytes": 5000, "page_push_failures": 0}
    assert l1.stats.hits == 0  # peeked, not read


def test_several_slices_and_a_hole_are_assembled() -> None:
    table, l1, kernel, push = _setup()
    a, b = os.urandom(BS), os.urandom(BS)
    l1.put(BlockKey(7, 0), a)
    l1.put(BlockKey(8, 0), b)
    # slice 7 over [0, 3000), slice 8 over [5000, 6000): a hole between
    _inode(table, 11, 6000, [Slice(7, 0, 3000), Slice(8, 5000, 1000, 10)])
    assert push.offer(11)
    want = a[:3000] + bytes(2000) + b[10:1010]
    assert kernel.stored == [(11, 0, want)]


@pytest.mark.parametrize(
    "why",
    ["open here", "being written", "unknown to the kernel", "pages of another version",
     "stale list", "not in L1", "empty", "larger than a block", "not a regular file", "unknown inode",
     "pushed already", "opened twice"],
)  # fmt: skip
def test_nothing_is_pushed_where_the_pages_could_mix_or_race(why: str) -> None:
    table, l1, kernel, push = _setup()
    l1.put(BlockKey(7, 0), os.urandom(BS))
    size = {"empty": 0, "larger than a block": BS + 1}.get(why, 4096)
    inode = _inode(table, 12, size, [Slice(7, 0, min(size, BS))])
    opening = False
    if why == "open here":
        inode.opens = 1
    elif why == "opened twice":  # another handle of it may have reads in flight
        inode.opens, opening = 2, True
    elif why == "being written":
        inode.writer = object()  # type: ignore[assignment]
    elif why == "unknown to the kernel":
        inode.lookups = 0
    elif why == "pages of another version":
        inode.cached_version = 2
    elif why == "stale list":
        inode.layout += 1  # a compaction or our own commit since the list was read
    elif why == "not in L1":
        l1.discard(BlockKey(7, 0))
    elif why == "not a regular file":
        inode.attr = inode.attr._replace(mode=stat.S_IFDIR | 0o755)
    ino = 99 if why == "unknown inode" else 12
    if why == "pushed already":  # since its last open: a block fetched again brings the same bytes
        assert push.offer(ino) and kernel.stored
        kernel.stored.clear()
        assert not push.offer(ino)
        assert kernel.stored == []
        return
    assert not push.offer(ino, opening=opening)
    assert kernel.stored == [] and not inode.pushed
    assert inode.cached_version == (2 if why == "pages of another version" else None)


def test_a_file_is_pushed_inside_its_only_open_but_not_as_it_lands_while_open() -> None:
    table, l1, kernel, push = _setup()
    l1.put(BlockKey(7, 0), os.urandom(BS))
    inode = _inode(table, 15, 4096, [Slice(7, 0, 4096)])
    inode.opens = 1  # the open being handled: its handle is not the kernel's yet
    assert not push.offer(15)
    assert push.offer(15, opening=True) and inode.pushed


def test_pages_of_the_same_version_are_pushed_again() -> None:
    table, l1, kernel, push = _setup()
    l1.put(BlockKey(7, 0), os.urandom(BS))
    inode = _inode(table, 13, 4096, [Slice(7, 0, 4096)])
    inode.cached_version = 3  # read here before at this version: the same bytes
    assert push.offer(13) and len(kernel.stored) == 1


def test_a_refused_push_leaves_the_version_unset_and_enosys_turns_pushing_off() -> None:
    table, l1, kernel, push = _setup()
    l1.put(BlockKey(7, 0), os.urandom(BS))
    inode = _inode(table, 14, 4096, [Slice(7, 0, 4096)])
    kernel.fail = errno.ENOENT  # the kernel forgot the inode meanwhile
    assert not push.offer(14)
    assert inode.cached_version is None and not inode.pushed and push.enabled
    kernel.fail = errno.ENOSYS
    assert not push.offer(14) and not push.enabled
    kernel.fail = 0
    assert not push.offer(14)  # off for good
    assert push.stats["page_push_failures"] == 2


# ---------------------------------------------------------------- real mounts

FILES = 24
SIZE = 60_000


def _counter(port: int, name: str) -> float:
    for line in mount_metrics(port).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def test_files_fetched_ahead_are_read_from_the_page_cache_and_changes_are_seen(cluster, tmp_path: Path) -> None:
    """Mount B changes two files after A listed the directory and before A's
    readahead fetches them: A fetches and pushes their old bytes (its slice
    lists are the listing's), the lease revocations having come first. Its
    opens then carry the new versions, so the kernel drops those pages and
    A reads the new bytes and size (one of them keeps its size and mtime);
    every other file is read without a read request reaching A."""
    writer = ClusterMount(cluster, tmp_path)
    port = free_port()
    reader = ClusterMount(cluster, tmp_path, "--metrics-addr", str(port))
    d = writer.path / f"push-{tmp_path.name}"
    try:
        d.mkdir()
        data = {i: os.urandom(SIZE) for i in range(FILES)}
        for i, blob in data.items():
            (d / f"f{i:02}").write_bytes(blob)
        there = reader.path / d.name
        names = sorted(os.listdir(there))  # readdirplus: the kernel knows every inode
        assert names == [f"f{i:02}" for i in range(FILES)]
        last = FILES - 1
        new_same, new_short = os.urandom(SIZE), os.urandom(SIZE // 3)
        was = os.stat(d / names[last])
        (d / names[last]).write_bytes(new_same)
        # Its old mtime back: the kernel, which drops a file's pages when it
        # sees a new size or mtime, cannot tell; only the content version can.
        os.utime(d / names[last], ns=(was.st_atime_ns, was.st_mtime_ns))
        (d / names[last - 1]).write_bytes(new_short)

        assert (there / names[0]).read_bytes() == data[0]  # a miss: the next files come ahead
        deadline = time.monotonic() + 30
        while _counter(port, "cachefs_mount_page_pushes_total") < FILES - 1:  # all the others
            assert time.monotonic() < deadline, mount_metrics(port)
            time.sleep(0.05)
        before = mount_ops(port)
        for i in range(1, last - 1):
            assert (there / names[i]).read_bytes() == data[i]
        ops = grown(before, mount_ops(port))
        assert ops.get("read", 0) == 0, ops  # every byte from the page cache
        assert ops.get("open", 0) == last - 2

        assert (there / names[last]).read_bytes() == new_same
        assert (there / names[last - 1]).read_bytes() == new_short
        assert os.stat(there / names[last - 1]).st_size == len(new_short)
    finally:
        reader.stop()
        shutil.rmtree(d, ignore_errors=True)  # others list the volume's root
        writer.stop()
    reader.check_log()
    writer.check_log()


def test_files_that_landed_while_the_kernel_forgot_them_are_pushed_at_their_open(cluster, tmp_path: Path) -> None:
    """A data loader lists its dataset long before the epoch, and the kernel
    forgets the inodes meanwhile (here: dentries and inodes dropped), so the
    blocks fetched ahead land with nothing to push into. Each file is then
    pushed inside its own open, and read with no read request."""
    port = free_port()
    mount = ClusterMount(cluster, tmp_path, "--metrics-addr", str(port))
    d = mount.path / f"pushopen-{tmp_path.name}"
    try:
        d.mkdir()
        data = {f"f{i:02}": os.urandom(SIZE) for i in range(FILES)}
        for name, blob in data.items():
            (d / name).write_bytes(blob)
        mount.stop()
        mount = ClusterMount(cluster, tmp_path, "--metrics-addr", str(port))  # L1 and page cache empty
        there = mount.path / d.name
        names = sorted(os.listdir(there))
        forgotten = mount_ops(port).get("forget", 0)
        Path("/proc/sys/vm/drop_caches").write_text("2\n")  # the kernel forgets the inodes
        assert mount_ops(port).get("forget", 0) > forgotten

        assert (there / names[0]).read_bytes() == data[names[0]]  # a miss: the next files come ahead
        deadline = time.monotonic() + 30
        while _counter(port, "cachefs_mount_l1_used_bytes") < FILES * SIZE:  # every block landed
            assert time.monotonic() < deadline, mount_metrics(port)
            time.sleep(0.05)
        pushed = _counter(port, "cachefs_mount_page_pushes_total")
        before = mount_ops(port)
        for name in names[1:]:
            assert (there / name).read_bytes() == data[name]
        ops = grown(before, mount_ops(port))
        assert ops.get("read", 0) == 0, ops  # every byte pushed inside its open
        assert _counter(port, "cachefs_mount_page_pushes_total") - pushed == FILES - 1
    finally:
        shutil.rmtree(mount.path / d.name, ignore_errors=True)  # others list the volume's root (this mount's)
        mount.stop()
    mount.check_log()
