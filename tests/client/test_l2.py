"""L2, the mount's local flash cache: eviction, restart, damaged files, a
full disk, two mounts with their own L2s, and one L2 per mount."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import trio

from cachefs.client.inline_reads import InlineReads
from cachefs.client.l2 import INLINE_MAX, CachedBlocks, L2Cache
from cachefs.errors import InvalidArgument
from cachefs.ids import BlockKey
from cachefs.testing.pagecache import evict_from_page_cache
from tests.smallfs import small_fs

from .conftest import ClusterMount

MiB = 1 << 20
BLOCK = 4 * MiB  # the lab volume's block size


def _block_files(cache_dir: Path) -> list[Path]:
    return [p for p in (cache_dir / "blocks").glob("*/*") if p.is_file()]


def _wait_files(cache_dir: Path, count: int, timeout: float = 30.0, mount: ClusterMount | None = None) -> list[Path]:
    deadline = time.monotonic() + timeout
    while len(files := _block_files(cache_dir)) < count:
        if time.monotonic() >= deadline:
            said = [line for line in mount.log().splitlines() if "L2 " in line] if mount else []
            raise AssertionError(f"L2 holds {len(files)} blocks, expected {count}; the mount's L2 log: {said}")
        time.sleep(0.05)
    return files


# The mount tests below are not about the free-space floor (that is
# test_full_local_disk_reads_and_writes_go_on, on a filesystem of its own):
# they pin no floor, so that a shared disk fuller than the default floor of
# 10% free does not stop L2 from keeping their blocks.
NO_FLOOR = ("--free-space-ratio", "0")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for name, label, value in re.findall(r'^(cachefs_mount_\w+)\{\w+="(\w+)"\} (\S+)$', text, re.M):
        out[f"{name}:{label}"] = float(value)
    return out


def _own_dir(mount: ClusterMount, tmp_path: Path) -> Path:
    """A directory of this test's own in the shared cluster volume (others list its root)."""
    d = mount.path / f"l2-{tmp_path.name}"
    d.mkdir(exist_ok=True)
    return d


def _drop_caches() -> None:
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


# ---------------------------------------------------------------- the cache itself


class Source:
    """The chain below L2: blocks from memory, counting what it is asked."""

    block_size = BLOCK

    def __init__(self, blocks: dict[BlockKey, bytes]) -> None:
        self.blocks = blocks
        self.asked: list[tuple[BlockKey, int, int]] = []

    async def fetch(self, key: BlockKey, offset: int = 0, length: int = -1) -> bytes:
        self.asked.append((key, offset, length))
        data = self.blocks[key]
        return data[offset:] if length == -1 else data[offset : offset + length]


async def _settle(l2: L2Cache) -> None:
    while l2._queued:  # the fill worker is writing
        await trio.sleep(0.01)


async def test_lru_eviction_past_capacity_and_index_after_restart(tmp_path: Path) -> None:
    blocks = {BlockKey(500, i): os.urandom(BLOCK) for i in range(5)}
    keys = list(blocks)
    source = Source(blocks)
    async with trio.open_nursery() as nursery:
        l2 = L2Cache.open(tmp_path, 3 * BLOCK + 3 * 8192, "v", free_space_ratio=0.0, nursery=nursery)
        chain = CachedBlocks(source, l2)
        for key in keys:  # whole blocks: each is kept
            assert bytes(await chain.fetch(key)) == blocks[key]
            await _settle(l2)
        assert l2.store.used <= l2.store.capacity and len(l2.store) == 3
        assert len(_block_files(tmp_path)) == 3
        source.asked.clear()
        assert bytes(await chain.fetch(keys[4], 100, 4096)) == blocks[keys[4]][100:4196]
        assert bytes(await chain.fetch(keys[2])) == blocks[keys[2]]  # the LRU's hot end now
        assert source.asked == []  # both from L2
        assert bytes(await chain.fetch(keys[0], 8, 16)) == blocks[keys[0]][8:24]
        assert source.asked == [(keys[0], 8, 16)]  # evicted; a range is not kept
        await _settle(l2)
        assert keys[0] not in l2.store
        with pytest.raises(InvalidArgument, match="in use by another mount"):
            L2Cache.open(tmp_path, BLOCK, "v", free_space_ratio=0.0, nursery=nursery)
        nursery.cancel_scope.cancel()  # the mount ends: the lock goes
    async with trio.open_nursery() as nursery:
        again = L2Cache.open(tmp_path, 3 * BLOCK + 3 * 8192, "v", free_space_ratio=0.0, nursery=nursery)
        assert sorted(again.store.cached_keys()) == sorted(keys[2:])
        source.asked.clear()
        chain = CachedBlocks(source, again)
        for key in keys[2:]:
            assert bytes(await chain.fetch(key)) == blocks[key]
        assert source.asked == []
        nursery.cancel_scope.cancel()


@pytest.mark.allow_log("cachefs.client.l2", match=r"below the floor of 99% \(.*GiB\) .*--free-space-ratio")
async def test_a_disk_below_the_floor_is_reported_not_a_silent_empty_l2(tmp_path: Path, caplog) -> None:
    """A disk with less free space than the floor: L2 says so when it opens
    and at the first fill it refuses, naming the floor and the free space,
    and counts the fills refused for it; reads go on below L2."""
    key = BlockKey(502, 0)
    block = os.urandom(BLOCK)
    st = os.statvfs(tmp_path)
    if st.f_bavail >= 0.99 * st.f_blocks:
        pytest.skip("this filesystem has more than 99% free: no floor of 99% to fall below")
    async with trio.open_nursery() as nursery:
        l2 = L2Cache.open(tmp_path, 4 * BLOCK, "v", free_space_ratio=0.99, nursery=nursery)
        opened = [r.getMessage() for r in caplog.records if r.name == "cachefs.client.l2"]
        assert any(re.search(r"free space on .* is [\d.]+ GiB \([\d.]+% of [\d.]+ GiB\), below the floor of 99%", m)
                   for m in opened), opened  # fmt: skip
        caplog.clear()
        chain = CachedBlocks(Source({key: block}), l2)
        assert bytes(await chain.fetch(key)) == block
        await _settle(l2)
        assert l2.stats["l2_fills_failed"] == 1 and l2.stats["l2_fills_below_floor"] == 1
        assert len(l2.store) == 0 and l2.store.stats()["below_floor"] == 1
        refused = [r.getMessage() for r in caplog.records if r.name == "cachefs.client.l2"]
        assert any("blocks are not being cached" in m and "below the floor of 99%" in m for m in refused), refused
        nursery.cancel_scope.cancel()


def _evict_pages(path: Path) -> None:
    assert evict_from_page_cache(path), f"the kernel kept {path}'s pages"


async def test_a_small_range_on_a_fast_disk_is_read_inline(tmp_path: Path) -> None:
    """The default: a range that only the disk holds is read on the loop (a
    local disk answers faster than a hop to a thread), and so is the next."""
    key = BlockKey(500, 0)
    block = os.urandom(BLOCK)
    async with trio.open_nursery() as nursery:
        l2, _ = await _kept(tmp_path, nursery, {key: block}, 4 * BLOCK, 8, InlineReads(stall_max=1.0))
        (path,) = _block_files(tmp_path)
        _evict_pages(path)
        assert bytes(await l2.read(key, 20000, 4096)) == block[20000:24096]
        assert bytes(await l2.read(key, 3 * MiB, 4096)) == block[3 * MiB : 3 * MiB + 4096]
        assert l2.stats["l2_inline_reads"] == 2 and l2.stats["l2_disk_reads"] == 0
        assert l2.pace.inline and 0 < l2.pace.mean < 1.0
        assert l2.stats["l2_hit_bytes"] == 2 * 4096
        nursery.cancel_scope.cancel()


async def test_a_small_files_whole_block_is_read_inline_and_a_big_one_in_a_thread(tmp_path: Path) -> None:
    """A whole block (``length=-1``) no larger than ``INLINE_MAX``, a small
    file's, follows the inline policy like a range of that size: sent to a
    thread it cost 1.0-1.3 ms of mount CPU per file, mostly GIL hand-offs
    (4 readers of 110 KiB files, ``bench.meta_fs_bench``'s cold read), and
    0.5 ms inline. A big block still goes to the threads."""
    small, big = BlockKey(503, 0), BlockKey(504, 0)
    blocks = {small: os.urandom(110 * 1024), big: os.urandom(INLINE_MAX + 1)}
    async with trio.open_nursery() as nursery:
        l2, _ = await _kept(tmp_path, nursery, blocks, 4 * BLOCK, 8, InlineReads(stall_max=1.0))
        for path in _block_files(tmp_path):
            _evict_pages(path)
        assert bytes(await l2.read(small)) == blocks[small]
        assert l2.stats["l2_inline_reads"] == 1 and l2.stats["l2_disk_reads"] == 0
        assert bytes(await l2.read(small, 1000)) == blocks[small][1000:]
        assert bytes(await l2.read(big)) == blocks[big]
        assert l2.stats["l2_inline_reads"] == 2 and l2.stats["l2_hits"] == 3
        misses = l2.stats["l2_misses"]
        assert await l2.read(BlockKey(505, 0)) is None and l2.stats["l2_misses"] == misses + 1
        nursery.cancel_scope.cancel()


async def test_small_reads_move_to_threads_when_the_disk_is_slow(tmp_path: Path) -> None:
    """Past the policy's limit (here 1 ns: any read from the disk is slower),
    small ranges on the disk go to L2's threads, and the move is counted."""
    key = BlockKey(502, 0)
    block = os.urandom(BLOCK)
    async with trio.open_nursery() as nursery:
        l2, _ = await _kept(tmp_path, nursery, {key: block}, 4 * BLOCK, 8, InlineReads(stall_max=1e-9))
        (path,) = _block_files(tmp_path)
        assert bytes(await l2.read(key, 0, 4096)) == block[:4096]  # inline, then too slow
        assert not l2.pace.inline and l2.stats["l2_inline_switches"] == 1
        for hits in range(2, 22):
            _evict_pages(path)
            assert bytes(await l2.read(key, 8192, 4096)) == block[8192:12288]
            assert l2.stats["l2_hits"] == hits
            if l2.stats["l2_disk_reads"]:
                break
        assert l2.stats["l2_disk_reads"] == 1 and l2.stats["l2_inline_reads"] == 1
        nursery.cancel_scope.cancel()


async def test_a_small_range_on_the_disk_is_read_off_the_event_loop(tmp_path: Path) -> None:
    """With small reads in threads (a slow disk), a range in the page cache
    is still read inline; one that only the disk holds goes to a worker
    thread, so that it does not stall every request of the mount.

    The inline try is a RWF_NOWAIT read, which on a fast disk this kernel
    may complete after all (about 1 try in 10 here): the pages are then
    evicted again until a read goes to the thread."""
    key = BlockKey(501, 0)
    block = os.urandom(BLOCK)
    want = block[8192:12288]
    async with trio.open_nursery() as nursery:
        l2, _ = await _kept(tmp_path, nursery, {key: block}, 4 * BLOCK, 8, InlineReads(stall_max=0.0))
        (path,) = _block_files(tmp_path)
        for hits in range(1, 21):
            _evict_pages(path)
            assert bytes(await l2.read(key, 8192, 4096)) == want
            assert l2.stats["l2_hits"] == hits
            if l2.stats["l2_disk_reads"]:
                break
        assert l2.stats["l2_disk_reads"] == 1
        assert bytes(await l2.read(key, 8192, 4096)) == want  # now in the page cache
        assert l2.stats["l2_disk_reads"] == 1 and l2.stats["l2_hits"] == hits + 1
        nursery.cancel_scope.cancel()


def _open_block_files(cache_dir: Path) -> list[str]:
    """Block files of ``cache_dir`` this process has open (" (deleted)" when unlinked)."""
    prefix = f"{cache_dir.resolve() / 'blocks'}/"
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(prefix):
                out.append(target)
    return out


async def _kept(tmp_path: Path, nursery: trio.Nursery, blocks: dict[BlockKey, bytes], capacity: int,
                open_files: int, pace: InlineReads | None = None) -> tuple[L2Cache, CachedBlocks]:  # fmt: skip
    l2 = L2Cache.open(tmp_path, capacity, "v", free_space_ratio=0.0, nursery=nursery, open_files=open_files,
                      pace=pace)  # fmt: skip
    chain = CachedBlocks(Source(blocks), l2)
    for key in blocks:
        await chain.fetch(key)
        await _settle(l2)
    return l2, chain


async def test_block_files_read_stay_open_until_evicted(tmp_path: Path) -> None:
    """A 4 KiB hit does not open the file again; eviction closes it (no
    descriptor left on an unlinked file), and so does the mount's end."""
    blocks = {BlockKey(510, i): os.urandom(BLOCK) for i in range(4)}
    keys = list(blocks)
    async with trio.open_nursery() as nursery:
        l2, chain = await _kept(tmp_path, nursery, dict(list(blocks.items())[:3]), 3 * BLOCK + 3 * 8192, 8)
        assert _open_block_files(tmp_path) == []  # fills keep nothing open
        for key in keys[:3]:
            assert bytes(await l2.read(key, 4096, 4096)) == blocks[key][4096:8192]
        assert sorted(_open_block_files(tmp_path)) == sorted(str(l2.store.path(k)) for k in keys[:3])
        assert bytes(await l2.read(keys[1], 0, 4096)) == blocks[keys[1]][:4096]
        assert len(_open_block_files(tmp_path)) == 3  # the same descriptors
        chain.source.blocks[keys[3]] = blocks[keys[3]]
        await chain.fetch(keys[3])  # a fourth block evicts the least recently used, keys[0]
        await _settle(l2)
        assert keys[0] not in l2.store
        opened = _open_block_files(tmp_path)
        assert not [p for p in opened if keys[0].hex() in p]
        assert sorted(opened) == sorted(str(l2.store.path(k)) for k in keys[1:3])
        nursery.cancel_scope.cancel()
    assert _open_block_files(tmp_path) == []


@pytest.mark.allow_log("cachefs.blockstore", match="failed its checksum")
async def test_a_block_corrupted_while_its_file_is_open_is_a_miss(tmp_path: Path) -> None:
    key = BlockKey(511, 0)
    block = os.urandom(BLOCK)
    async with trio.open_nursery() as nursery:
        l2, chain = await _kept(tmp_path, nursery, {key: block}, 4 * BLOCK, 8)
        assert bytes(await chain.fetch(key, 100, 4096)) == block[100:4196]
        (path,) = _open_block_files(tmp_path)  # the kept file
        fd = os.open(path, os.O_WRONLY)  # bytes flipped in place, in the range read next
        try:
            os.pwrite(fd, bytes(b ^ 0xFF for b in block[200:210]), os.fstat(fd).st_size - BLOCK + 200)
        finally:
            os.close(fd)
        chain.source.asked.clear()
        assert bytes(await chain.fetch(key, 100, 4096)) == block[100:4196]
        assert chain.source.asked == [(key, 100, 4096)]  # a miss, read below L2
        assert l2.stats["l2_corrupt"] == 1 and key not in l2.store
        assert _open_block_files(tmp_path) == []  # dropped with the block
        nursery.cancel_scope.cancel()


async def test_open_block_files_stay_bounded(tmp_path: Path) -> None:
    blocks = {BlockKey(512, i): os.urandom(BLOCK // 8) for i in range(12)}
    async with trio.open_nursery() as nursery:
        l2, _ = await _kept(tmp_path, nursery, blocks, 16 * BLOCK, 4)
        for _ in range(2):
            for key, data in blocks.items():
                assert bytes(await l2.read(key, 0, 4096)) == data[:4096]
                assert len(_open_block_files(tmp_path)) <= 4
        assert sorted(_open_block_files(tmp_path)) == sorted(str(l2.store.path(k)) for k in list(blocks)[-4:])
        nursery.cancel_scope.cancel()


@pytest.mark.allow_log("cachefs.blockstore", match="failed its checksum")
async def test_reads_on_the_disk_use_l2s_threads_and_corruption_there_is_a_miss(tmp_path: Path) -> None:
    """Ranges on a slow disk are read by L2's own threads (not trio's):
    results and errors come back to the reading task, and the threads end
    with the mount."""
    blocks = {BlockKey(513, i): os.urandom(BLOCK) for i in range(2)}
    good, bad = blocks
    async with trio.open_nursery() as nursery:
        l2, chain = await _kept(tmp_path, nursery, blocks, 4 * BLOCK, 8, InlineReads(stall_max=0.0))
        assert [t for t in threading.enumerate() if t.name.startswith("l2-read-")]
        path = l2.store.path(bad)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\xff" * 10, os.fstat(fd).st_size - BLOCK + 200)
        finally:
            os.close(fd)
        for p in (path, l2.store.path(good)):
            _evict_pages(p)
        async with trio.open_nursery() as readers:  # concurrent hops
            for i in range(8):
                readers.start_soon(l2.read, good, i * 65536, 4096)
        assert l2.stats["l2_disk_reads"] >= 1
        assert bytes(await l2.read(good, 65536, 4096)) == blocks[good][65536 : 65536 + 4096]
        assert await l2.read(bad, 0, 4096) is None  # Corrupt raised in a read thread: a miss
        assert l2.stats["l2_corrupt"] == 1 and bad not in l2.store
        nursery.cancel_scope.cancel()
    with trio.fail_after(10):
        while [t for t in threading.enumerate() if t.name.startswith("l2-read-")]:
            await trio.sleep(0.01)


# ---------------------------------------------------------------- under a real mount


def test_restart_serves_from_l2_without_any_block_rpc(cluster, tmp_path: Path) -> None:
    """Written blocks go to L2; after a remount the index is rebuilt and a
    cold read (page cache dropped, L1 off) is served from it with no fetch
    from the cache tier or backing storage."""
    cache_dir = tmp_path / "l2"
    data = os.urandom(4 * BLOCK)
    m = ClusterMount(cluster, tmp_path, "--cache-dir", str(cache_dir), "--l1-size", "0", *NO_FLOOR)
    try:
        (_own_dir(m, tmp_path) / "f").write_bytes(data)
        _wait_files(cache_dir, 4, mount=m)
    finally:
        m.stop()
    m.check_log()
    port = _free_port()
    m = ClusterMount(cluster, tmp_path, "--cache-dir", str(cache_dir), "--l1-size", "0", *NO_FLOOR,
                     "--metrics-addr", str(port))  # fmt: skip
    try:
        assert "L2 " in m.log() and ": 4 blocks" in m.log()
        _drop_caches()
        assert (_own_dir(m, tmp_path) / "f").read_bytes() == data
        stats = _metrics(port)
        assert stats["cachefs_mount_l2_events_total:hits"] >= 4
        assert stats["cachefs_mount_blocks_total:cache_reads"] == 0
        assert stats["cachefs_mount_blocks_total:backing_reads"] == 0
        # One L2 per mount: a second mount of the same directory is refused, clearly.
        with pytest.raises(RuntimeError, match="in use by another mount"):
            ClusterMount(cluster, tmp_path, "--cache-dir", str(cache_dir))
    finally:
        shutil.rmtree(_own_dir(m, tmp_path), ignore_errors=True)
        m.stop()
    m.check_log()


def test_damaged_and_deleted_l2_files_under_a_running_mount(cluster, tmp_path: Path) -> None:
    cache_dir = tmp_path / "l2"
    data = os.urandom(4 * BLOCK)
    port = _free_port()
    m = ClusterMount(cluster, tmp_path, "--cache-dir", str(cache_dir), "--l1-size", "0", *NO_FLOOR,
                     "--metrics-addr", str(port))  # fmt: skip
    try:
        d = _own_dir(m, tmp_path)
        (d / "f").write_bytes(data)
        files = sorted(_wait_files(cache_dir, 4, mount=m))
        with open(files[0], "r+b") as f:  # bytes flipped in the data, past the header
            f.seek(os.path.getsize(files[0]) - 1000)
            f.write(b"\xff" * 10)
        os.truncate(files[1], os.path.getsize(files[1]) // 2)
        files[2].unlink()
        _drop_caches()
        assert (d / "f").read_bytes() == data
        stats = _metrics(port)
        assert stats["cachefs_mount_l2_events_total:corrupt"] >= 2
        fetched = stats["cachefs_mount_blocks_total:cache_reads"] + stats["cachefs_mount_blocks_total:backing_reads"]
        assert fetched >= 3
        _wait_files(cache_dir, 4, mount=m)  # the blocks fetched again are kept again
        _drop_caches()
        assert (d / "f").read_bytes() == data
        assert _metrics(port)["cachefs_mount_l2_events_total:hits"] >= stats["cachefs_mount_l2_events_total:hits"] + 4
    finally:
        shutil.rmtree(_own_dir(m, tmp_path), ignore_errors=True)
        m.stop()
    m.check_log()


def test_full_local_disk_reads_and_writes_go_on(cluster, tmp_path: Path) -> None:
    with small_fs(tmp_path / "disk", 24 * MiB) as disk:
        cache_dir = disk / "l2"
        m = ClusterMount(cluster, tmp_path, "--cache-dir", str(cache_dir), "--l1-size", "0",
                         "--free-space-ratio", "0.2")  # fmt: skip
        try:
            d = _own_dir(m, tmp_path)
            first = os.urandom(8 * BLOCK)
            (d / "a").write_bytes(first)
            time.sleep(1)
            used = sum(p.stat().st_size for p in _block_files(cache_dir))
            st = os.statvfs(disk)
            assert used > 0 and st.f_bavail * st.f_frsize >= 0.2 * st.f_blocks * st.f_frsize - BLOCK
            # Someone else fills the disk to the last byte.
            subprocess.run(["dd", "if=/dev/zero", f"of={disk / 'filler'}", "bs=1M"],
                           capture_output=True, check=False)  # fmt: skip
            assert os.statvfs(disk).f_bavail < 64
            second = os.urandom(3 * BLOCK)
            (d / "b").write_bytes(second)
            _drop_caches()
            assert (d / "a").read_bytes() == first
            assert (d / "b").read_bytes() == second
        finally:
            shutil.rmtree(_own_dir(m, tmp_path), ignore_errors=True)
            m.stop()
        m.check_log()


def test_two_mounts_with_their_own_l2_keep_close_to_open(cluster, tmp_path: Path) -> None:
    """Blocks are immutable, so neither L2 can serve stale bytes; the slice
    lists still come fresh from the metanodes at every open."""
    a = ClusterMount(cluster, tmp_path, "--cache-dir", str(tmp_path / "l2a"), "--l1-size", "0", *NO_FLOOR)
    b = ClusterMount(cluster, tmp_path, "--cache-dir", str(tmp_path / "l2b"), "--l1-size", "0", *NO_FLOOR)
    try:
        da = _own_dir(a, tmp_path)
        db = b.path / da.name
        first = os.urandom(2 * BLOCK)
        (da / "shared").write_bytes(first)
        assert (db / "shared").read_bytes() == first
        _wait_files(tmp_path / "l2b", 2, mount=b)  # b keeps what it fetched
        second = os.urandom(BLOCK + 5)
        with open(da / "shared", "r+b") as f:
            f.write(second)
        _drop_caches()
        assert (db / "shared").read_bytes() == second + first[len(second) :]
        with open(db / "shared", "ab") as f:
            f.write(b"tail")
        assert (da / "shared").read_bytes() == second + first[len(second) :] + b"tail"
    finally:
        shutil.rmtree(_own_dir(a, tmp_path), ignore_errors=True)
        a.stop()
        b.stop()
    a.check_log()
    b.check_log()
