"""The FUSE handlers called in-process: lookup counting and error mapping.

No kernel and no mount: each test calls :class:`cachefs.client.fs.CacheFS`'s
handlers as pyfuse3 would, on the real engine (:mod:`cachefs.client.volume`)
over an in-process metanode (:mod:`cachefs.testing.metanode`: the real state
machine and service) and dict block storage. What a kernel cannot show a test
is checked here: how many lookups the handlers count per inode (the kernel
forgets exactly what it was told about), and which errno each failure
reaches the kernel as. Every test ends with the namespace's invariant check
(fsck).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pyfuse3
import pytest
import trio

from cachefs import commands as C
from cachefs.client.fs import CacheFS
from cachefs.client.volume import ClientOptions, Volume
from cachefs.layout import MAX_FILE_SIZE
from cachefs.rpc import RpcPool
from cachefs.testing.metanode import LocalMetanode, local_metanode

VOLUME = "vol"
ROOT = pyfuse3.ROOT_INODE
CTX = pyfuse3.RequestContext()  # what the kernel passes: uid 0, gid 0
OPTIONS = ClientOptions(l1_bytes=1 << 20, readahead_max=256 << 10, write_buffer=1 << 20)


@dataclass
class Mounted:
    ops: CacheFS
    metanode: LocalMetanode

    def lookups(self, ino: int) -> int:
        """The lookups the handlers counted for ``ino`` (0: not in the table)."""
        inode = self.ops.inodes.get(ino)
        return 0 if inode is None else inode.lookups

    def held(self) -> list[int]:
        """The inodes in the table besides the root (which never leaves)."""
        return [inode.ino for inode in self.ops.inodes.all() if inode.ino != ROOT]


async def _mounted(options: ClientOptions) -> AsyncIterator[Mounted]:
    async with local_metanode() as metanode, RpcPool(secret=None) as pool:
        await metanode.create_volume(VOLUME, block_size=64 << 10)
        session = await metanode.session(pool, VOLUME)
        async with trio.open_nursery() as nursery:
            mounted = Mounted(CacheFS(Volume(session, options, nursery=nursery)), metanode)
            yield mounted
            nursery.cancel_scope.cancel()
        await session.close()
        metanode.check()  # the namespace invariants hold after what the test did


@pytest.fixture
async def fs() -> AsyncIterator[Mounted]:
    async for mounted in _mounted(OPTIONS):
        yield mounted


@pytest.fixture
async def ro_fs() -> AsyncIterator[Mounted]:
    async for mounted in _mounted(ClientOptions(read_only=True)):
        yield mounted


def _errno(exc_info: pytest.ExceptionInfo[pyfuse3.FUSEError]) -> str:
    return errno.errorcode[exc_info.value.errno]


# ---------------------------------------------------------------------- lookup counts


async def test_every_reply_that_names_an_inode_counts_one_lookup_and_forget_drops_them(
    fs: Mounted,
) -> None:
    ops = fs.ops
    d = await ops.mkdir(ROOT, b"d", 0o755, CTX)
    assert fs.lookups(d.st_ino) == 1
    f = await ops.mknod(d.st_ino, b"f", stat.S_IFREG | 0o644, 0, CTX)
    s = await ops.symlink(d.st_ino, b"s", b"f", CTX)
    info, c = await ops.create(d.st_ino, b"c", 0o644, os.O_RDWR, CTX)
    assert (fs.lookups(f.st_ino), fs.lookups(s.st_ino), fs.lookups(c.st_ino)) == (1, 1, 1)

    for _ in range(3):
        assert (await ops.lookup(d.st_ino, b"f", CTX)).st_ino == f.st_ino
    linked = await ops.link(f.st_ino, ROOT, b"hard", CTX)
    assert linked.st_ino == f.st_ino
    assert fs.lookups(f.st_ino) == 5  # mknod, three lookups, link

    # Replies that name no new entry count nothing.
    await ops.getattr(f.st_ino, CTX)
    await ops.getattr(d.st_ino, CTX)
    with pytest.raises(pyfuse3.FUSEError):
        await ops.lookup(d.st_ino, b"missing", CTX)
    assert (fs.lookups(f.st_ino), fs.lookups(d.st_ino)) == (5, 1)

    # The kernel forgets in parts; the inode leaves the table at zero, not before.
    await ops.forget([(f.st_ino, 2)])
    assert fs.lookups(f.st_ino) == 3
    await ops.forget([(f.st_ino, 3), (s.st_ino, 1)])
    assert f.st_ino not in ops.inodes and s.st_ino not in ops.inodes

    # An open file stays in the table after its last forget, until released.
    await ops.forget([(c.st_ino, 1)])
    assert c.st_ino in ops.inodes
    await ops.release(info.fh)
    assert c.st_ino not in ops.inodes

    await ops.forget([(d.st_ino, 1)])
    assert fs.held() == []


async def test_unlinked_inode_forgotten_later_leaves_the_table(fs: Mounted) -> None:
    ops = fs.ops
    f = await ops.mknod(ROOT, b"f", stat.S_IFREG | 0o644, 0, CTX)
    await ops.unlink(ROOT, b"f", CTX)
    assert fs.lookups(f.st_ino) == 1  # the kernel has not forgotten it yet
    await ops.forget([(f.st_ino, 1)])
    assert fs.held() == []


# ---------------------------------------------------------------------- errno mapping


async def test_namespace_errors_reach_the_kernel_as_their_errno(fs: Mounted) -> None:
    ops = fs.ops
    d = await ops.mkdir(ROOT, b"d", 0o755, CTX)
    f = await ops.mknod(d.st_ino, b"f", stat.S_IFREG | 0o644, 0, CTX)
    await ops.mkdir(ROOT, b"e", 0o755, CTX)
    cases = [
        (ops.lookup(ROOT, b"missing", CTX), "ENOENT"),
        (ops.lookup(ROOT, b"x" * 256, CTX), "ENAMETOOLONG"),
        (ops.mkdir(ROOT, b"d", 0o755, CTX), "EEXIST"),
        (ops.mknod(f.st_ino, b"g", stat.S_IFREG | 0o644, 0, CTX), "ENOTDIR"),
        (ops.rmdir(ROOT, b"d", CTX), "ENOTEMPTY"),
        (ops.unlink(ROOT, b"d", CTX), "EISDIR"),
        (ops.rmdir(d.st_ino, b"f", CTX), "ENOTDIR"),
        (ops.rename(ROOT, b"d", d.st_ino, b"inside", 0, CTX), "EINVAL"),  # into itself
        (ops.rename(d.st_ino, b"f", ROOT, b"d", 0, CTX), "EISDIR"),
        (ops.rename(ROOT, b"e", d.st_ino, b"f", 0, CTX), "ENOTDIR"),
        (ops.readlink(f.st_ino, CTX), "EINVAL"),
        (ops.getxattr(f.st_ino, b"user.none", CTX), "ENODATA"),
        (ops.removexattr(f.st_ino, b"user.none", CTX), "ENODATA"),
        (ops.getattr(1 << 40, CTX), "ENOENT"),
        (ops.link(d.st_ino, ROOT, b"dirlink", CTX), "EPERM"),
    ]
    got = []
    for call, _expected in cases:
        with pytest.raises(pyfuse3.FUSEError) as exc_info:
            await call
        got.append(_errno(exc_info))
    assert got == [expected for _call, expected in cases]


async def test_a_write_past_the_largest_file_is_efbig_and_one_across_it_is_cut(
    fs: Mounted,
) -> None:
    ops = fs.ops
    info, attr = await ops.create(ROOT, b"big", 0o644, os.O_RDWR, CTX)
    with pytest.raises(pyfuse3.FUSEError) as exc_info:
        await ops.write(info.fh, MAX_FILE_SIZE, b"x")
    assert _errno(exc_info) == "EFBIG"
    assert await ops.write(info.fh, MAX_FILE_SIZE - 3, b"abcdef") == 3
    await ops.flush(info.fh)
    assert (await ops.getattr(attr.st_ino, CTX)).st_size == MAX_FILE_SIZE
    await ops.release(info.fh)
    await ops.forget([(attr.st_ino, 1)])


async def test_a_read_only_mount_refuses_every_change_with_erofs(ro_fs: Mounted) -> None:
    ops = ro_fs.ops
    root = await ops.getattr(ROOT, CTX)
    changes = [
        ops.mkdir(ROOT, b"d", 0o755, CTX),
        ops.mknod(ROOT, b"f", stat.S_IFREG | 0o644, 0, CTX),
        ops.create(ROOT, b"c", 0o644, os.O_WRONLY, CTX),
        ops.symlink(ROOT, b"s", b"t", CTX),
        ops.unlink(ROOT, b"f", CTX),
        ops.rename(ROOT, b"a", ROOT, b"b", 0, CTX),
        ops.setxattr(ROOT, b"user.a", b"1", CTX),
        ops.open(ROOT, os.O_WRONLY, CTX),
    ]
    for call in changes:
        with pytest.raises(pyfuse3.FUSEError) as exc_info:
            await call
        assert _errno(exc_info) == "EROFS"
    assert (await ops.getattr(ROOT, CTX)).st_mtime_ns == root.st_mtime_ns


async def test_bad_arguments_are_einval_and_the_metanode_never_sees_them(fs: Mounted) -> None:
    ops = fs.ops
    before = fs.metanode.state.applied_index
    for name in (b"a/b", b"a\0b", b".", b".."):
        with pytest.raises(pyfuse3.FUSEError) as exc_info:
            await ops.mkdir(ROOT, name, 0o755, CTX)
        assert _errno(exc_info) == "EINVAL"
    assert fs.metanode.state.applied_index == before


@pytest.mark.allow_log("cachefs.client.fs", "unexpected error in read")
async def test_an_unexpected_exception_is_eio_and_the_handler_survives(
    fs: Mounted, caplog: pytest.LogCaptureFixture
) -> None:
    ops = fs.ops
    with pytest.raises(pyfuse3.FUSEError) as exc_info:
        await ops.read(12345, 0, 10)  # a handle the kernel never got: a bug, not an errno
    assert _errno(exc_info) == "EIO"
    assert any(r.exc_info for r in caplog.records if "unexpected error in read" in r.message)
    # the same operations go on working
    info, attr = await ops.create(ROOT, b"f", 0o644, os.O_RDWR, CTX)
    assert await ops.write(info.fh, 0, b"hello") == 5
    await ops.flush(info.fh)
    assert await ops.read(info.fh, 0, 10) == b"hello"
    await ops.release(info.fh)
    await ops.forget([(attr.st_ino, 1)])


# ---------------------------------------------------------------------- round trips


async def test_writes_to_a_file_created_here_ask_no_getxattr_of_the_metanodes(fs: Mounted) -> None:
    """The kernel asks getxattr("security.capability") before every write.
    The create's answer says the new file has no extended attributes, and
    the mount answers from that for ``attr_timeout`` even without a lease on
    the file (the leader grants none while other changes are in flight);
    an xattr change here voids it, and a later open asks again."""
    ops = fs.ops
    calls = ops.session.meta.pool.time_calls()
    asked = lambda: sum(calls.counts.get("getxattr", ()))  # noqa: E731
    info, attr = await ops.create(ROOT, b"f", 0o644, os.O_WRONLY, CTX)
    ops.leases.lose(attr.st_ino)  # as if none had been granted
    for off in range(0, 40_000, 10_000):
        with pytest.raises(pyfuse3.FUSEError) as exc_info:
            await ops.getxattr(attr.st_ino, b"security.capability", CTX)
        assert _errno(exc_info) == "ENODATA"
        assert await ops.write(info.fh, off, b"x" * 10_000) == 10_000
    assert asked() == 0
    await ops.setxattr(attr.st_ino, b"security.capability", b"\x01", CTX)
    assert await ops.getxattr(attr.st_ino, b"security.capability", CTX) == b"\x01"
    assert asked() == 1
    await ops.release(info.fh)
    await ops.forget([(attr.st_ino, 1)])


async def test_a_file_written_here_reads_back_with_no_slice_list_asked(fs: Mounted) -> None:
    """A new file's slice lists start empty and each commit of ours adds its
    slice (the version moved by that commit alone), so reading back what was
    written here asks no read_chunk; a change by another client moves the
    version past ours, and the next read asks for the list."""
    ops = fs.ops
    calls = ops.session.meta.pool.time_calls()
    lists = lambda: sum(calls.counts.get("read_chunk", ()))  # noqa: E731
    first, second = os.urandom(100_000), os.urandom(30_000)
    info, attr = await ops.create(ROOT, b"f", 0o644, os.O_RDWR, CTX)
    await ops.write(info.fh, 0, first)
    await ops.flush(info.fh)
    await ops.write(info.fh, 50_000, second)  # over part of the first slice
    await ops.flush(info.fh)
    await ops.release(info.fh)
    want = first[:50_000] + second + first[80_000:]
    info = await ops.open(attr.st_ino, os.O_RDONLY, CTX)
    assert bytes(await ops.read(info.fh, 0, 200_000)) == want
    assert lists() == 0
    await ops.release(info.fh)
    other = await fs.metanode.session(ops.session.meta.pool, VOLUME)
    await other.meta.mutate(C.SetAttr(VOLUME, attr.st_ino, size=len(want) + 1))  # revokes our lease
    await other.close()
    info = await ops.open(attr.st_ino, os.O_RDONLY, CTX)
    assert bytes(await ops.read(info.fh, 0, 200_000)) == want + b"\0"
    assert lists() == 1
    await ops.release(info.fh)
    await ops.forget([(attr.st_ino, 1)])


async def test_data_and_xattrs_written_through_the_handlers_read_back_after_reopen(
    fs: Mounted,
) -> None:
    ops = fs.ops
    data = os.urandom(200_000)  # several 64 KiB blocks and a partial one
    info, attr = await ops.create(ROOT, b"f", 0o644, os.O_WRONLY, CTX)
    for off in range(0, len(data), 50_000):
        assert await ops.write(info.fh, off, data[off : off + 50_000]) == 50_000
    await ops.setxattr(attr.st_ino, b"user.k", b"v", CTX)
    await ops.release(info.fh)

    info = await ops.open(attr.st_ino, os.O_RDONLY, CTX)
    assert bytes(await ops.read(info.fh, 0, len(data) + 10)) == data
    assert await ops.getxattr(attr.st_ino, b"user.k", CTX) == b"v"
    assert await ops.listxattr(attr.st_ino, CTX) == [b"user.k"]
    assert (await ops.getattr(attr.st_ino, CTX)).st_size == len(data)
    await ops.release(info.fh)
    await ops.forget([(attr.st_ino, 1)])


# ---------------------------------------------------------------------- metrics


def _sample(fs: Mounted, name: str, **labels: str) -> float:
    """One sample of the mount's /metrics (its collector, as a scrape reads it)."""
    from cachefs.client.mount import MountCollector

    [value] = [s.value for family in MountCollector(fs.ops.engine, fs.ops.op_stats).collect()
               for s in family.samples if s.name == name and s.labels == labels]
    return value


async def test_dirty_bytes_are_what_was_written_and_not_yet_committed(fs: Mounted) -> None:
    ops = fs.ops
    info, attr = await ops.create(ROOT, b"f", 0o644, os.O_RDWR, CTX)
    assert _sample(fs, "cachefs_mount_dirty_bytes") == 0
    await ops.write(info.fh, 0, b"x" * 60_000)
    await ops.write(info.fh, 60_000, b"y" * 40_000)
    assert _sample(fs, "cachefs_mount_dirty_bytes") == 100_000
    await ops.flush(info.fh)
    assert _sample(fs, "cachefs_mount_dirty_bytes") == 0
    assert _sample(fs, "cachefs_mount_committed_bytes_total") == 100_000
    assert _sample(fs, "cachefs_mount_commit_latency_seconds_count") >= 1
    await ops.release(info.fh)
    await ops.forget([(attr.st_ino, 1)])


async def test_readahead_efficiency_is_prefetched_blocks_a_read_then_used(fs: Mounted) -> None:
    ops = fs.ops
    data = os.urandom(4 << 20)  # 64 blocks, four times the L1: the first ones are gone from it when read
    info, attr = await ops.create(ROOT, b"f", 0o644, os.O_WRONLY, CTX)
    for off in range(0, len(data), 1 << 20):
        await ops.write(info.fh, off, data[off : off + (1 << 20)])
    await ops.release(info.fh)
    info = await ops.open(attr.st_ino, os.O_RDONLY, CTX)
    for off in range(0, len(data), 128 << 10):
        assert bytes(await ops.read(info.fh, off, 128 << 10)) == data[off : off + (128 << 10)]
    await ops.release(info.fh)
    await ops.forget([(attr.st_ino, 1)])
    prefetched = _sample(fs, "cachefs_mount_read_fetches_total", kind="prefetch")
    used = _sample(fs, "cachefs_mount_readahead_used_blocks_total")
    # Most of them: the reads that reached a block still in flight used it too (they were
    # counted as wasted when only an L1 hit counted, and these reads found none in L1).
    assert prefetched // 2 < used <= prefetched
