"""The datanode's shard store on a real filesystem."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefs.datanode.shardstore import CHUNK_SIZE, ShardStore, encode_shard_file
from cachefs.errors import Corrupt, InvalidArgument, NoSpace, NotFound
from cachefs.ids import BlockKey
from cachefs.pagecache import NOWAIT_READS, WouldBlock
from cachefs.testing.pagecache import evict_from_page_cache
from cachefs.testing.powercut import PowerCutDisk

KEY = BlockKey(42, 7).hex()


def test_put_get_stat_delete(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, 1 << 30)
    data = os.urandom(3 * CHUNK_SIZE + 123)
    store.put("vol", KEY, 2, b"meta!", data)
    assert store.get("vol", KEY, 2) == (b"meta!", data, len(data))
    assert store.stat("vol", KEY, 2) == (b"meta!", len(data))
    assert store.usage()["shards"] == 1 and store.usage()["used"] > len(data)
    with pytest.raises(NotFound):
        store.get("vol", KEY, 3)
    store.put("vol", KEY, 3, b"", b"")
    assert store.get("vol", KEY, 3) == (b"", b"", 0)
    assert store.delete("vol", KEY) == 2
    assert store.usage() == {"capacity": 1 << 30, "used": 0, "shards": 0}
    with pytest.raises(NotFound):
        store.stat("vol", KEY, 2)


@pytest.mark.skipif(not NOWAIT_READS, reason="no RWF_NOWAIT reads on this platform")
def test_nowait_reads_answer_from_the_page_cache_or_say_they_would_block(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, 1 << 30)
    data = os.urandom(3 * CHUNK_SIZE + 123)
    store.put("vol", KEY, 1, b"meta", data)
    assert store.get("vol", KEY, 1, nowait=True) == (b"meta", data, len(data))
    meta, got, _ = store.get("vol", KEY, 1, CHUNK_SIZE + 5, 100, nowait=True)
    assert bytes(got) == data[CHUNK_SIZE + 5 : CHUNK_SIZE + 105]
    (path,) = [p for p in (tmp_path / "shards" / "vol").rglob(f"{KEY}.1")]
    if not evict_from_page_cache(path):
        pytest.skip("this filesystem keeps the file in the page cache")
    with pytest.raises(WouldBlock):
        store.get("vol", KEY, 1, nowait=True)
    assert store.get("vol", KEY, 1) == (b"meta", data, len(data))  # read from the disk
    with pytest.raises(NotFound):
        store.get("vol", KEY, 2, nowait=True)


@settings(max_examples=40, deadline=None)
@given(size=st.integers(0, 3 * CHUNK_SIZE), offset=st.integers(0, 3 * CHUNK_SIZE + 10),
       length=st.integers(-1, 3 * CHUNK_SIZE))
def test_ranges(tmp_path_factory, size, offset, length) -> None:
    store = ShardStore(tmp_path_factory.mktemp("s"), 1 << 30, durable=False)
    data = os.urandom(size)
    store.put("v", KEY, 0, b"m", data)
    meta, got, total = store.get("v", KEY, 0, offset, length)
    assert total == size and meta == b"m"
    assert got == (data[offset:] if length == -1 else data[offset : offset + length])


@pytest.mark.allow_log("cachefs.datanode.shardstore", match=r"corrupt shard .*; removing it")
@pytest.mark.parametrize("damage", ["flip-data", "flip-header", "truncate", "zero", "extend"])
def test_corruption_is_detected_and_the_shard_dropped(tmp_path: Path, damage: str) -> None:
    store = ShardStore(tmp_path, 1 << 30)
    data = os.urandom(2 * CHUNK_SIZE)
    store.put("vol", KEY, 0, b"meta", data)
    (path,) = (tmp_path / "shards" / "vol").rglob(f"{KEY}.0")
    raw = bytearray(path.read_bytes())
    if damage == "flip-data":
        raw[-5] ^= 0x10
    elif damage == "flip-header":
        raw[30] ^= 0x01
    elif damage == "truncate":
        raw = raw[: len(raw) - 100]
    elif damage == "zero":
        raw = bytearray(len(raw))
    else:
        raw += b"junk"
    path.write_bytes(raw)
    with pytest.raises(Corrupt):
        store.get("vol", KEY, 0)
    assert not path.exists()
    assert store.usage()["shards"] == 0
    assert store.list("vol")[0] == []  # repair sees it missing
    with pytest.raises(Corrupt, match="awaits repair"):  # data loss is not "never written"
        store.get("vol", KEY, 0)
    store.put("vol", KEY, 0, b"meta", data)  # repair clears the marker
    assert store.get("vol", KEY, 0)[1] == data
    assert store.delete("vol", KEY, 0) == 1
    with pytest.raises(NotFound):
        store.get("vol", KEY, 0)


@pytest.mark.allow_log("cachefs.datanode.shardstore", match=r"corrupt shard .*; removing it")
def test_range_reads_check_only_their_chunks(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, 1 << 30)
    data = os.urandom(4 * CHUNK_SIZE)
    store.put("vol", KEY, 0, b"", data)
    (path,) = (tmp_path / "shards").rglob(f"{KEY}.0")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # last chunk bad
    path.write_bytes(raw)
    assert store.get("vol", KEY, 0, 0, CHUNK_SIZE)[1] == data[:CHUNK_SIZE]
    with pytest.raises(Corrupt):
        store.get("vol", KEY, 0, 3 * CHUNK_SIZE, 10)


def test_capacity_no_space_leaves_nothing(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, 300_000)
    store.put("vol", KEY, 0, b"", os.urandom(200_000))
    with pytest.raises(NoSpace):
        store.put("vol", KEY, 1, b"", os.urandom(200_000))
    assert list((tmp_path / "tmp").iterdir()) == []
    assert store.usage()["shards"] == 1
    with pytest.raises(NotFound):
        store.get("vol", KEY, 1)
    # Replacing a shard accounts for the old one.
    store.put("vol", KEY, 0, b"", os.urandom(100_000))
    assert store.usage()["used"] < 150_000


def test_real_disk_full(tmp_path: Path) -> None:
    """A tiny tmpfs: the OS says ENOSPC before our capacity does."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount tmpfs here")
    try:
        store = ShardStore(mnt, 1 << 30)
        with pytest.raises(NoSpace):
            for i in range(20):
                store.put("vol", BlockKey(1, i).hex(), 0, b"", os.urandom(60_000))
        assert list((mnt / "tmp").iterdir()) == []
        for info in store.list("vol")[0]:
            assert store.verify("vol", info.key, info.index)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_paged_list(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, 1 << 30, durable=False)
    want = set()
    for s in range(40):
        for idx in (0, 3):
            store.put("vol", BlockKey(s, 1).hex(), idx, b"", b"x")
            want.add((BlockKey(s, 1).hex(), idx))
    store.put("other", KEY, 0, b"", b"y")
    seen, cursor, pages = [], "", 0
    while True:
        page, cursor = store.list("vol", cursor, limit=7)
        seen += [(i.key, i.index) for i in page]
        pages += 1
        if not cursor:
            break
    assert len(seen) == len(want) and set(seen) == want and pages == 12
    assert store.volumes() == ["other", "vol"]


def test_bad_names(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, 1 << 20)
    for volume, key, index in [("../x", KEY, 0), ("vol", "../../etc", 0), ("vol", KEY, 999)]:
        with pytest.raises(InvalidArgument):
            store.put(volume, key, index, b"", b"")


def test_kill_9_mid_write_leaves_only_whole_shards(tmp_path: Path) -> None:
    writer = textwrap.dedent(f"""
        import os, sys
        from cachefs.ids import BlockKey
        from cachefs.datanode.shardstore import ShardStore
        store = ShardStore({str(tmp_path)!r}, 1 << 34)
        data = os.urandom(3 << 20)
        for i in range(100_000):
            store.put("vol", BlockKey(i, 0).hex(), 0, b"m", data)
            if i == 2:
                print("going", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"going\n"
        time.sleep(0.3)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    store = ShardStore(tmp_path, 1 << 34)
    assert list((tmp_path / "tmp").iterdir()) == []  # leftovers cleaned at start-up
    shards, _ = store.list("vol", limit=100_000)
    assert len(shards) >= 3
    for info in shards:
        meta, data, total = store.get("vol", info.key, info.index)
        assert meta == b"m" and total == len(data) == 3 << 20


def test_concurrent_puts_and_deletes_keep_exact_accounting(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    store = ShardStore(tmp_path, 1 << 30, durable=False)

    def work(n: int) -> None:
        for i in range(30):
            key = BlockKey(i % 3, 0).hex()
            store.put("vol", key, n % 2, b"m", os.urandom(1000 + 37 * n + i))
            if i % 7 == 0:
                store.delete("vol", key, n % 2)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(8)))
    rescanned = ShardStore(tmp_path, 1 << 30)
    assert (store.used, store.shard_count) == (rescanned.used, rescanned.shard_count)


# ---------------------------------------------------------------- on a disk that loses power


@pytest.mark.needs_fuse
def test_stored_shards_survive_a_power_cut(power_cut_disk: PowerCutDisk) -> None:
    """A put that returned is durable: its file, and the new volume and fan
    directories that hold it (a store on an empty disk creates all three)."""
    root = power_cut_disk.mountpoint
    store = ShardStore(root, 1 << 30)
    shards = {("vol", BlockKey(i, 0).hex(), i % 3): os.urandom(1000 + i) for i in range(8)}
    shards[("other", KEY, 1)] = os.urandom(CHUNK_SIZE + 1)
    for (volume, key, index), data in shards.items():
        store.put(volume, key, index, b"m", data)
    power_cut_disk.cut()
    power_cut_disk.mount()
    store = ShardStore(root, 1 << 30)
    assert store.usage()["shards"] == len(shards)
    for (volume, key, index), data in shards.items():
        assert store.get(volume, key, index) == (b"m", data, len(data))


@pytest.mark.needs_fuse
def test_shards_found_at_start_up_are_made_durable(power_cut_disk: PowerCutDisk) -> None:
    """After kill -9 the directories may hold names only the page cache knows
    (a put killed between its rename and its directory fsync). What the store
    finds and counts at start-up, it must make durable before it serves."""
    root = power_cut_disk.mountpoint
    ShardStore(root, 1 << 30).put("vol", KEY, 0, b"m", b"first")
    fan = next((root / "shards" / "vol").iterdir())
    with open(root / "tmp" / "x.tmp", "wb", buffering=0) as f:  # a put cut short after its rename
        f.write(b"".join(bytes(p) for p in encode_shard_file(b"m", b"second")))
        os.fsync(f.fileno())
    os.replace(root / "tmp" / "x.tmp", fan / f"{KEY}.1")
    store = ShardStore(root, 1 << 30)
    assert store.usage()["shards"] == 2
    power_cut_disk.cut()
    power_cut_disk.mount()
    store = ShardStore(root, 1 << 30)
    assert store.get("vol", KEY, 1) == (b"m", b"second", 6)
