"""The flash block store: ranges, LRU under a capacity, checksums, restart, TTL, memory tier."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachefs.blockstore import ALIGN, BlockStore, encode_header, segment_sums
from cachefs.cachenode.admission import SecondMissAdmission
from cachefs.errors import Corrupt, InvalidArgument, NoSpace
from cachefs.ids import BlockKey
from cachefs.pagecache import WouldBlock
from cachefs.testing.pagecache import cached_pages, evict_from_page_cache

SEG = 4096
NOWAIT_TRIES = 20  # evictions tried until a RWF_NOWAIT read misses


def _data(key: BlockKey, size: int) -> bytes:
    return random.Random(hash(key) ^ size).randbytes(size)


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "blocks").rglob("*") if p.is_file())


def _file_size(size: int) -> int:
    return len(encode_header("v", size, SEG, segment_sums(bytes(size), SEG))) + size


MAPPED = pytest.mark.parametrize("mmap_min", [1, 1 << 30], ids=["mapped", "pread"])


@MAPPED
def test_put_read_ranges_and_miss(tmp_path: Path, mmap_min: int) -> None:
    store = BlockStore.open(tmp_path, 1 << 20, segment_size=SEG, mmap_min=mmap_min)
    key = BlockKey(1, 0)
    data = _data(key, 3 * SEG + 123)
    assert store.read(key) is None
    assert store.put("v", key, data)
    assert not store.put("v", key, data)  # already cached
    assert bytes(store.read(key)) == data
    for off, ln in [
        (0, 1),
        (SEG - 1, 2),
        (SEG, SEG),
        (100, 3 * SEG),
        (len(data) - 5, 100),
        (len(data), 10),
        (7, -1),
    ]:
        want = data[off:] if ln == -1 else data[off : off + ln]
        assert bytes(store.read(key, off, ln)) == want, (off, ln)
    with pytest.raises(InvalidArgument):
        store.read(key, len(data) + 1, 1)
    with pytest.raises(InvalidArgument):
        store.read(key, -1, 1)
    empty = BlockKey(2, 0)
    store.put("v", empty, b"")
    assert bytes(store.read(empty)) == b""


@pytest.mark.allow_log("cachefs.blockstore", match=r"failed its checksum, dropped")
def test_a_store_reads_files_written_with_another_segment_size(tmp_path: Path) -> None:
    """Each file names its segment size: an L2 of small segments finds the
    files of a store of larger ones after a restart, reads and verifies
    ranges by the file's own segments, and still catches a flipped byte."""
    store = BlockStore.open(tmp_path, 1 << 20, segment_size=4 * SEG)
    key, other = BlockKey(1, 0), BlockKey(2, 0)
    data = _data(key, 9 * SEG + 77)
    assert store.put("v", key, data)
    reopened = BlockStore.open(tmp_path, 1 << 20, segment_size=SEG)
    entry = reopened.lookup(key)
    assert entry is not None and entry.segment_size == 4 * SEG and len(entry.sums) == 3
    assert bytes(reopened.read(key, 5 * SEG + 3, SEG)) == data[5 * SEG + 3 : 6 * SEG + 3]
    assert reopened.put("v", other, data)
    assert len(reopened.lookup(other).sums) == 10
    assert bytes(reopened.read(other)) == data
    with open(reopened.path(key), "r+b") as f:
        f.seek(entry.data_offset + 7 * SEG)  # in the file's second 4-SEG segment
        f.write(bytes([data[7 * SEG] ^ 1]))
    with pytest.raises(Corrupt):
        reopened.read(key, 6 * SEG, 10)
    assert reopened.lookup(key) is None


@pytest.mark.allow_log("cachefs.blockstore", match=r"failed its checksum, dropped")
@MAPPED
def test_large_blocks_are_written_page_aligned_and_read_back_after_a_restart(
    tmp_path: Path, mmap_min: int
) -> None:
    """Blocks of direct_min bytes or more go to disk with O_DIRECT: the data
    starts at a page boundary, the file is cut to its exact size, the index
    rebuild reads the layout back, and a flipped byte is still caught."""
    store = BlockStore.open(tmp_path, 64 << 20, segment_size=SEG, mmap_min=mmap_min, direct_min=64 << 10)
    big, small = BlockKey(1, 0), BlockKey(2, 0)
    data = _data(big, (1 << 20) + 123)  # not a multiple of ALIGN: the rounded-up write is cut back
    assert store.put("v", big, data)
    assert store.put("v", small, _data(small, 1000))
    entry = store.lookup(big)
    assert entry is not None and entry.data_offset % ALIGN == 0
    assert store.path(big).stat().st_size == entry.file_size == entry.data_offset + len(data)
    small_entry = store.lookup(small)
    assert small_entry is not None and small_entry.file_size == _file_size(1000)  # compact layout
    assert store.used == entry.file_size + small_entry.file_size
    assert bytes(store.read(big)) == data
    assert bytes(store.read(big, SEG + 5, 3 * SEG)) == data[SEG + 5 : 4 * SEG + 5]
    reopened = BlockStore.open(tmp_path, 64 << 20, segment_size=SEG, mmap_min=mmap_min)
    assert reopened.lookup(big) is not None and reopened.lookup(big).data_offset == entry.data_offset
    assert bytes(reopened.read(big)) == data
    assert bytes(reopened.read(small)) == _data(small, 1000)
    with open(reopened.path(big), "r+b") as f:
        f.seek(entry.data_offset + 2 * SEG)
        f.write(bytes([data[2 * SEG] ^ 1]))
    with pytest.raises(Corrupt):
        reopened.read(big, 2 * SEG, 10)
    assert reopened.lookup(big) is None


@pytest.mark.allow_log("cachefs.blockstore", match=r"failed its checksum, dropped")
def test_large_reads_of_aligned_blocks_bypass_the_page_cache(tmp_path: Path) -> None:
    """With ``direct_read_min``, a read that large of a block written
    page-aligned is read with O_DIRECT: the right bytes, verified (a flipped
    byte is Corrupt), and none of the file's pages left in the page cache.
    Smaller reads and blocks written unaligned go through the page cache."""
    store = BlockStore.open(tmp_path, 64 << 20, segment_size=SEG, mmap_min=1 << 62,
                            direct_min=64 << 10, direct_read_min=64 << 10)  # fmt: skip
    big, small = BlockKey(3, 0), BlockKey(4, 0)
    data = _data(big, (1 << 20) + 123)
    assert store.put("v", big, data) and store.put("v", small, _data(small, 1000))
    assert evict_from_page_cache(store.path(big))
    fd = os.open(store.path(big), os.O_RDONLY)
    try:
        if cached_pages(fd) is None:
            pytest.skip("this kernel has no cachestat(2)")
        assert bytes(store.read(big)) == data
        assert bytes(store.read(big, SEG + 5, 100 << 10)) == data[SEG + 5 : SEG + 5 + (100 << 10)]
        assert cached_pages(fd) == 0  # never through the page cache
        assert bytes(store.read(big, 7, 100)) == data[7:107]  # small: buffered
        assert cached_pages(fd) > 0
    finally:
        os.close(fd)
    assert bytes(store.read(small)) == _data(small, 1000)
    assert store.stats()["flash_hits"] == 4
    with open(store.path(big), "r+b") as f:
        f.seek(store.lookup(big).data_offset + 5 * SEG)
        f.write(bytes([data[5 * SEG] ^ 1]))
    with pytest.raises(Corrupt):
        store.read(big)
    assert store.lookup(big) is None and not store.path(big).exists()


def test_lru_evicts_least_recently_used(tmp_path: Path) -> None:
    size = 10_000
    store = BlockStore.open(tmp_path, 3 * _file_size(size), segment_size=SEG)
    keys = [BlockKey(i, 0) for i in range(4)]
    for k in keys[:3]:
        store.put("v", k, _data(k, size))
    store.read(keys[0])  # 0 is now the most recent; 1 is the LRU
    store.put("v", keys[3], _data(keys[3], size))
    assert set(store.cached_keys()) == {keys[0], keys[2], keys[3]}
    assert store.stats()["evictions"] == 1
    assert _disk_bytes(tmp_path) == store.used <= store.capacity


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    capacity_blocks=st.integers(min_value=1, max_value=6),
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 15), st.integers(0, 3 * SEG)),
        min_size=1,
        max_size=60,
    ),
)
def test_capacity_never_exceeded_random_access(tmp_path_factory, capacity_blocks: int, ops) -> None:
    root = tmp_path_factory.mktemp("store")
    capacity = capacity_blocks * _file_size(2 * SEG)
    store = BlockStore.open(root, capacity, segment_size=SEG)
    sizes: dict[BlockKey, int] = {}
    for is_put, k, size in ops:
        key = BlockKey(k, 0)
        size = sizes.setdefault(key, size)
        if is_put:
            try:
                store.put("v", key, _data(key, size))
            except NoSpace:
                assert _file_size(size) > capacity
        else:
            got = store.read(key)
            assert got is None or bytes(got) == _data(key, size)
        assert store.used <= capacity
        assert _disk_bytes(root) == store.used
    reopened = BlockStore.open(root, capacity, segment_size=SEG)
    assert set(reopened.cached_keys()) == set(store.cached_keys())


def test_concurrent_fills_never_exceed_capacity(tmp_path: Path) -> None:
    size = 20_000
    capacity = 5 * _file_size(size) + 100
    store = BlockStore.open(tmp_path, capacity, segment_size=SEG)
    worst = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            with store._lock:
                worst[0] = max(worst[0], store.used + store.reserved)

    def fill(t: int) -> None:
        for i in range(40):
            key = BlockKey(1000 * t + i, 0)
            try:
                store.put("v", key, _data(key, size))
            except NoSpace:
                pass  # every byte is reserved by other fills: served uncached
            store.read(BlockKey(1000 * t + i // 2, 0))

    sampler = threading.Thread(target=sample)
    sampler.start()
    workers = [threading.Thread(target=fill, args=(t,)) for t in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    sampler.join()
    assert 0 < worst[0] <= capacity
    assert store.reserved == 0
    assert _disk_bytes(tmp_path) == store.used <= capacity
    for key in store.cached_keys():
        assert bytes(store.read(key)) == _data(key, size)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(scan=st.integers(min_value=20, max_value=200), seed=st.integers(0, 1000))
def test_hot_set_survives_a_scan_with_admission(tmp_path_factory, scan: int, seed: int) -> None:
    """A one-pass scan bigger than the cache does not flush blocks read repeatedly."""
    size = 2 * SEG
    root = tmp_path_factory.mktemp("scan")
    store = BlockStore.open(root, 12 * _file_size(size), segment_size=SEG)
    admission = SecondMissAdmission(window=60.0)

    def access(key: BlockKey) -> None:  # the service's miss path, without the network
        if store.read(key) is None and admission.admit(key):
            store.put("v", key, _data(key, size))

    hot = [BlockKey(i, 0) for i in range(8)]
    for _ in range(3):
        for key in hot:
            access(key)
    assert set(hot) <= set(store.cached_keys())
    rng = random.Random(seed)
    cold = [BlockKey(10_000 + i, 0) for i in range(scan)]
    rng.shuffle(cold)
    for i, key in enumerate(cold):
        access(key)
        if i % 10 == 0:
            access(rng.choice(hot))
    assert set(hot) <= set(store.cached_keys())
    assert store.used <= store.capacity


def test_nowait_read_serves_only_the_page_cache(tmp_path: Path) -> None:
    """``nowait``: bytes that only the disk holds raise WouldBlock and leave the
    block untouched (no hit counted, LRU order kept); a blocking read then
    brings them in, and the next nowait read serves them.

    A RWF_NOWAIT read that misses starts the disk read, and this kernel may
    find it done on a fast disk and answer (about 1 try in 10 here): such a
    try must serve the right bytes as a hit, and the eviction is tried
    again until a miss is seen."""
    store = BlockStore.open(tmp_path, 1 << 20, segment_size=SEG, mmap_min=1 << 30)
    key, other = BlockKey(7, 0), BlockKey(7, 1)
    for k in (key, other):
        store.put("v", k, _data(k, 4 * SEG))
    (path,) = [p for p in (tmp_path / "blocks").rglob("*") if p.name == key.hex()]
    want = _data(key, 4 * SEG)[SEG : SEG + 100]
    served = 0
    for _ in range(NOWAIT_TRIES):
        assert evict_from_page_cache(path)
        hits = store.counters.flash_hits
        try:
            got = store.read(key, SEG, 100, nowait=True)
        except WouldBlock:
            break
        assert bytes(got) == want and store.counters.flash_hits == hits + 1
        served += 1
    else:
        pytest.skip(f"all {NOWAIT_TRIES} RWF_NOWAIT reads of evicted pages were served")
    assert store.counters.flash_hits == hits and store.lookup(key).hits == served
    if not served:
        assert store.cached_keys() == [key, other]  # not moved to the LRU's hot end
    assert bytes(store.read(key, SEG, 100)) == want
    assert bytes(store.read(key, SEG, 100, nowait=True)) == want
    assert store.counters.flash_hits == hits + 2 and store.lookup(key).hits == served + 2


@pytest.mark.allow_log("cachefs.blockstore", match=r"failed its checksum, dropped")
@MAPPED
def test_corrupt_block_is_dropped_never_served(tmp_path: Path, mmap_min: int) -> None:
    store = BlockStore.open(tmp_path, 1 << 20, segment_size=SEG, mmap_min=mmap_min)
    key = BlockKey(7, 3)
    data = _data(key, 5 * SEG)
    store.put("v", key, data)
    path = store.path(key)
    raw = bytearray(path.read_bytes())
    raw[-2 * SEG] ^= 0x40  # a bit flip in the fourth segment
    path.write_bytes(bytes(raw))
    assert bytes(store.read(key, 0, SEG)) == data[:SEG]  # untouched segments still verify
    with pytest.raises(Corrupt):
        store.read(key, 3 * SEG, 10)
    assert not path.exists()
    assert store.read(key) is None
    assert store.stats()["corrupt"] == 1 and store.used == 0


@pytest.mark.allow_log("cachefs.blockstore", match=r"failed its checksum, dropped")
@MAPPED
def test_truncated_file_is_corrupt(tmp_path: Path, mmap_min: int) -> None:
    store = BlockStore.open(tmp_path, 1 << 20, segment_size=SEG, mmap_min=mmap_min)
    key = BlockKey(8, 0)
    store.put("v", key, _data(key, 3 * SEG))
    with open(store.path(key), "r+b") as f:
        f.truncate(f.seek(0, os.SEEK_END) - 100)
    with pytest.raises(Corrupt):
        store.read(key)


def test_restart_rebuilds_index_and_discards_partial_files(tmp_path: Path) -> None:
    store = BlockStore.open(tmp_path, 1 << 20, segment_size=SEG)
    keys = [BlockKey(i, i) for i in range(1, 6)]
    for k in keys:
        store.put(f"vol{k.index}", k, _data(k, 2 * SEG + k.index))
    # a fill that died half way, a truncated block file, a header with a bad byte, junk
    (tmp_path / "tmp" / f"{BlockKey(99, 0).hex()}.deadbeef").write_bytes(b"half")
    with open(store.path(keys[0]), "r+b") as f:
        f.truncate(100)
    raw = bytearray(store.path(keys[1]).read_bytes())
    raw[10] ^= 1
    store.path(keys[1]).write_bytes(bytes(raw))
    (store.path(keys[2]).parent / "not-a-key").write_bytes(b"x")
    reopened = BlockStore(tmp_path, 1 << 20, segment_size=SEG)
    report = reopened.rebuild()
    assert report.discarded == 4
    assert set(reopened.cached_keys()) == set(keys[2:])
    for k in keys[2:]:
        assert bytes(reopened.read(k)) == _data(k, 2 * SEG + k.index)
    assert reopened.used == _disk_bytes(tmp_path)
    assert list((tmp_path / "tmp").iterdir()) == []
    # a smaller capacity after restart evicts the oldest fills (by mtime)
    for i, k in enumerate(keys[2:]):
        os.utime(reopened.path(k), (1_000_000 + i, 1_000_000 + i))
    smaller = BlockStore.open(tmp_path, reopened.used - 1, segment_size=SEG)
    assert set(smaller.cached_keys()) == set(keys[3:])


def test_ttl_per_volume(tmp_path: Path) -> None:
    now = [1000.0]
    store = BlockStore.open(
        tmp_path, 1 << 20, ttl={"short": 10.0}, segment_size=SEG, clock=lambda: now[0]
    )
    a, b = BlockKey(1, 0), BlockKey(2, 0)
    store.put("short", a, b"a" * 100)
    store.put("long", b, b"b" * 100)
    now[0] += 5
    assert store.read(a) is not None
    now[0] += 6
    assert store.read(a) is None
    assert not store.path(a).exists()
    assert store.read(b) is not None
    assert store.put("short", a, b"a" * 100)  # refilled after expiry
    store.put("short", BlockKey(3, 0), b"c")
    now[0] += 11
    assert store.expire() == 2
    assert store.cached_keys() == [b]


def test_memory_tier_keeps_hottest_blocks(tmp_path: Path) -> None:
    size = 3 * SEG
    store = BlockStore.open(
        tmp_path, 1 << 20, memory_capacity=2 * size, segment_size=SEG, mmap_min=1
    )
    keys = [BlockKey(i, 0) for i in range(3)]
    for k in keys:
        store.put("v", k, _data(k, size))
    for k in keys:
        store.read(k, 10, 20)
        assert bytes(store.read(k, 10, 20)) == _data(k, size)[10:30]  # second hit promotes
    stats = store.stats()
    assert stats["memory_blocks"] == 2 and stats["memory_used"] == 2 * size
    assert all(type(d) is bytes for d in store._memory.blocks.values())  # copies, never mappings
    before = stats["memory_hits"]
    assert bytes(store.read(keys[2])) == _data(keys[2], size)
    assert store.stats()["memory_hits"] == before + 1
    store.discard(keys[2])
    assert store.stats()["memory_blocks"] == 1


def test_admission_window(tmp_path: Path) -> None:
    now = [0.0]
    adm = SecondMissAdmission(window=10.0, max_tracked=2, clock=lambda: now[0])
    k1, k2, k3 = BlockKey(1, 0), BlockKey(2, 0), BlockKey(3, 0)
    assert not adm.admit(k1)
    now[0] = 5
    assert adm.admit(k1)
    assert not adm.admit(k2)
    now[0] = 20
    assert not adm.admit(k2)  # the first miss is outside the window
    assert not adm.admit(k3)
    assert not adm.admit(k1)
    assert len(adm._first_miss) <= 2  # bounded: k2's miss was pushed out
    assert not adm.admit(k2)


def test_free_space_floor_evicts_and_then_refuses(tmp_path: Path) -> None:
    """On a disk shared with others the store keeps a share of it free: it
    evicts more than its capacity asks, and with nothing left to evict (the
    others filled the disk) it refuses the fill instead of filling the disk."""
    from tests.smallfs import small_fs

    size = 1 << 20
    with small_fs(tmp_path / "disk", 16 << 20) as disk:
        store = BlockStore.open(disk / "cache", 1 << 30, segment_size=SEG, free_space_ratio=0.5)
        keys = [BlockKey(70, i) for i in range(12)]
        for key in keys:
            assert store.put("v", key, _data(key, size))
        st = os.statvfs(disk)
        assert st.f_bavail >= 0.5 * st.f_blocks - (size + 4096) // st.f_frsize
        assert 4 <= len(store) <= 8  # about half the 16 MiB disk: the oldest went first
        assert store.read(keys[0]) is None and bytes(store.read(keys[-1])) == _data(keys[-1], size)
        # Someone else takes the rest of the floor: the store gives up all it has, then refuses.
        (disk / "other").write_bytes(bytes(7 << 20))
        with pytest.raises(NoSpace, match="below the floor"):
            store.put("v", BlockKey(71, 0), _data(BlockKey(71, 0), size))
        assert len(store) == 0 and store.used == 0 and store.reserved == 0
        assert _disk_bytes(disk / "cache") == 0


def test_pinned_blocks_are_not_evicted_until_the_pin_lapses_and_survive_a_restart(tmp_path: Path) -> None:
    now = [1000.0]
    size = 10_000
    capacity = 3 * _file_size(size)
    store = BlockStore.open(tmp_path, capacity, ttl={"v": 5.0}, segment_size=SEG, clock=lambda: now[0])
    keys = [BlockKey(i, 0) for i in range(6)]
    store.pin(keys[:2], until=1100.0)  # 0 is pinned before it arrives, as a warm-up's fetch is
    for k in keys[:3]:
        store.put("v", k, _data(k, size))
    assert store.pinned(keys[0]) == 1100.0 and store.pinned(keys[2]) == 0.0
    store.put("v", keys[3], _data(keys[3], size))  # the LRU is 0, but 0 and 1 are pinned: 2 goes
    assert set(store.cached_keys()) == {keys[0], keys[1], keys[3]}
    now[0] += 10  # past the volume's TTL: the pins hold anyway
    assert store.read(keys[0]) is not None and store.read(keys[3]) is None
    store.pin([keys[4]], until=1100.0)
    store.put("v", keys[4], _data(keys[4], size))
    with pytest.raises(NoSpace):  # nothing left but pinned blocks
        store.put("v", keys[5], _data(keys[5], size))
    assert set(store.cached_keys()) == {keys[0], keys[1], keys[4]}
    assert _disk_bytes(tmp_path) == store.used <= capacity

    reopened = BlockStore.open(tmp_path, capacity, segment_size=SEG, clock=lambda: now[0])
    assert reopened.pinned(keys[1]) == 1100.0 and reopened.pinned(keys[4]) == 1100.0
    with pytest.raises(NoSpace):
        reopened.put("v", keys[5], _data(keys[5], size))
    assert reopened.discard(keys[4]) and reopened.pinned(keys[4]) == 0.0  # warmup --evict unpins
    now[0] = 1101.0  # the pins lapse: plain LRU again
    assert reopened.put("v", keys[5], _data(keys[5], size))
    assert reopened.put("v", keys[2], _data(keys[2], size))
    cached = set(reopened.cached_keys())
    assert {keys[5], keys[2]} <= cached and len(cached) == 3
    assert BlockStore.open(tmp_path, capacity, segment_size=SEG, clock=lambda: now[0]).stats()["pins"] == 0


def _fds_on(path: Path) -> list[int]:
    """This process's descriptors on ``path`` (also once it is unlinked)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.removesuffix(" (deleted)") == str(path):
            out.append(int(fd))
    return out


def test_kept_file_is_not_closed_under_a_read_in_flight(tmp_path: Path, monkeypatch) -> None:
    """A block dropped while a pread of its kept file is in flight: the file
    stays open (its number is not given to the next fill's file) until that
    read ends, which serves the block's own bytes; then it is closed."""
    store = BlockStore.open(tmp_path, 1 << 20, segment_size=SEG, mmap_min=1 << 30, open_files=2)
    a, b = BlockKey(90, 0), BlockKey(90, 1)
    data = _data(a, 3 * SEG)
    store.put("v", a, data)
    path = store.path(a)
    assert bytes(store.read(a, 0, 10)) == data[:10]
    (fd,) = _fds_on(path)  # kept open after the read
    entered, go = threading.Event(), threading.Event()
    real_pread = os.pread

    def paused_pread(*args: int) -> bytes:
        if threading.current_thread().name == "reader":
            entered.set()
            assert go.wait(30)
        return real_pread(*args)

    monkeypatch.setattr(os, "pread", paused_pread)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(bytes(store.read(a, SEG, SEG))), name="reader")
    reader.start()
    try:
        assert entered.wait(30)
        assert store.discard(a)  # unlinked and dropped with a read in flight
        store.put("v", b, _data(b, 3 * SEG))  # a fill opens (and closes) a file meanwhile
        assert _fds_on(path) == [fd]
    finally:
        go.set()
        reader.join(30)
    assert got == [data[SEG : 2 * SEG]]
    assert _fds_on(path) == []  # closed by the read that held it
    store.close()


@pytest.mark.allow_log("cachefs.blockstore", match=r"failed its checksum, dropped")
@pytest.mark.parametrize("how", ["corrupt", "discard"])
def test_removing_a_block_never_deletes_a_good_copy_filled_meanwhile(tmp_path: Path, monkeypatch, how: str) -> None:
    """A block leaves the index, then its file is unlinked. If a fill of the
    same key renames a good copy onto that path in between (another reader
    found the block gone and fetched it again), only the old file goes: the
    good copy stays on disk and is served."""
    store = BlockStore.open(tmp_path, 1 << 20, segment_size=SEG, mmap_min=1 << 30, open_files=4)
    key = BlockKey(91, 0)
    data = _data(key, 3 * SEG)
    store.put("v", key, data)
    path = store.path(key)
    old_ino = path.stat().st_ino
    if how == "corrupt":
        with open(path, "r+b") as f:  # a bit flip in place, in the first segment
            f.seek(os.path.getsize(path) - 3 * SEG + 5)
            f.write(b"\xff")
    real_unlink = store._unlink
    raced: list[int] = []

    def refilled_first(entries: list) -> None:
        if entries and not raced:  # the other reader's fill lands between the removal and the unlink
            assert store.put("v", key, data)
            raced.append(path.stat().st_ino)
        real_unlink(entries)

    monkeypatch.setattr(store, "_unlink", refilled_first)
    if how == "corrupt":
        with pytest.raises(Corrupt):
            store.read(key, 0, 10)
    else:
        assert store.discard(key)
    monkeypatch.undo()
    assert raced and raced[0] != old_ino
    assert path.exists() and path.stat().st_ino == raced[0]  # the good copy, not deleted
    assert bytes(store.read(key)) == data
    assert store.used == _disk_bytes(tmp_path)
    store.close()
