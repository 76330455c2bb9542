"""The WAL and snapshots on a real filesystem: torn tails, bit flips, round trips."""

from __future__ import annotations

import errno
import logging
import os
import resource
import signal
from pathlib import Path

import pytest

from cachefs.errors import Corrupt
from cachefs.metanode.raft import storage
from cachefs.metanode.raft.messages import Entry, EntryKind, HardState, Snapshot, SnapshotMeta
from cachefs.metanode.raft.storage import RaftStorage
from cachefs.testing.powercut import PowerCutDisk


def entries(first: int, last: int, term: int) -> list[Entry]:
    return [Entry(term, i, f"cmd{i}".encode() * 3) for i in range(first, last + 1)]


def test_round_trip_and_conflicting_suffix(tmp_path: Path) -> None:
    st = RaftStorage.open(tmp_path)
    assert (st.hard_state, st.snapshot, st.entries) == (storage.NEW_DISK, None, [])
    st.save(entries(1, 5, 1), HardState(1, 2, 3), sync=True)
    st.save([Entry(1, 6, b"", EntryKind.NOOP)], None, sync=True)
    # A new leader overwrote 4.. with its own entries: replay must cut and append.
    st.save(entries(4, 7, 2), HardState(2, 1, 5), sync=True)
    assert st.syncs == 3
    st.close()
    st = RaftStorage.open(tmp_path)
    assert st.hard_state == HardState(2, 1, 5)
    assert st.entries == entries(1, 3, 1) + entries(4, 7, 2)
    st.close()


def test_group_commit_is_one_write_and_one_fsync(tmp_path: Path) -> None:
    st = RaftStorage.open(tmp_path)
    st.save(entries(1, 100, 1), HardState(1, 1, 0), sync=True)
    st.save([], HardState(1, 1, 100), sync=False)  # a commit-only change needs no fsync
    assert st.syncs == 1
    st.close()
    assert RaftStorage.open(tmp_path).hard_state.commit == 100


@pytest.mark.allow_log("cachefs.metanode.raft.storage", match=r"torn record header")
def test_torn_tail_is_cut_with_a_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    st = RaftStorage.open(tmp_path)
    st.save(entries(1, 10, 1), HardState(1, 1, 10), sync=True)
    good = st.wal_size()
    st.save(entries(11, 12, 1), None, sync=True)
    st.close()
    wal = tmp_path / storage.WAL_NAME
    raw = wal.read_bytes()
    wal.write_bytes(raw[: good + 7])  # a crash in the middle of the next record
    with caplog.at_level(logging.WARNING, logger="cachefs.metanode.raft.storage"):
        st = RaftStorage.open(tmp_path)
    assert st.entries == entries(1, 10, 1)
    assert st.hard_state == HardState(1, 1, 10)
    assert wal.stat().st_size == good
    assert any("torn" in r.getMessage() and f"byte {good}" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)
    # The cut file takes appends again.
    st.save(entries(11, 11, 2), None, sync=True)
    st.close()
    assert RaftStorage.open(tmp_path).entries == entries(1, 10, 1) + entries(11, 11, 2)


def _wal_of_20(tmp_path: Path) -> tuple[Path, list[int]]:
    """A WAL of 20 single-entry Readys; the offset of each."""
    st = RaftStorage.open(tmp_path)
    offsets = []
    for i in range(1, 21):
        offsets.append(st.wal_size())
        st.save(entries(i, i, 1), HardState(1, 1, i - 1), sync=False)
    offsets.append(st.wal_size())
    st.close()
    return tmp_path / storage.WAL_NAME, offsets


def _damage(wal: Path, offset: int, mask: int = 0x10) -> None:
    raw = bytearray(wal.read_bytes())
    raw[offset] ^= mask
    wal.write_bytes(bytes(raw))


def test_bit_flip_before_the_tail_is_refused_naming_file_and_offset(tmp_path: Path) -> None:
    """Entries 11..20 and their hard states were written after entry 10, maybe
    fsynced and acknowledged: cutting at 10 would forget them (and the vote)."""
    wal, offsets = _wal_of_20(tmp_path)
    before = wal.read_bytes()
    _damage(wal, offsets[9] + 12)  # inside entry 10's payload
    damaged = wal.read_bytes()
    with pytest.raises(Corrupt) as info:
        RaftStorage.open(tmp_path)
    msg = str(info.value)
    assert str(wal) in msg and f"CRC mismatch at byte {offsets[9]}" in msg
    assert "rebuild this replica" in msg
    assert wal.read_bytes() == damaged != before  # nothing cut


@pytest.mark.parametrize("where", ["length", "type", "crc"])
def test_a_damaged_header_before_the_tail_is_refused(tmp_path: Path, where: str) -> None:
    """A flipped length can make a middle record look torn (it claims to run
    past the end): the whole records after it still give it away."""
    wal, offsets = _wal_of_20(tmp_path)
    at, mask = {"length": (offsets[4], 0x40), "type": (offsets[4] + 8, 0x03),
                "crc": (offsets[4] + 5, 0x01)}[where]
    _damage(wal, at, mask)
    with pytest.raises(Corrupt, match=f"at byte {offsets[4]} .*follow from byte {offsets[5]}"):
        RaftStorage.open(tmp_path)


@pytest.mark.allow_log("cachefs.metanode.raft.storage", match=r"CRC mismatch .* the last one; cutting")
def test_a_garbled_last_record_is_cut_with_an_error_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The last write never fully reached the disk: its CRC fails and nothing
    whole follows, so it is cut (it was never acknowledged)."""
    wal, offsets = _wal_of_20(tmp_path)
    _damage(wal, offsets[19] + 12)
    with caplog.at_level(logging.WARNING, logger="cachefs.metanode.raft.storage"):
        st = RaftStorage.open(tmp_path)
    assert st.entries == entries(1, 19, 1)
    assert wal.stat().st_size == offsets[19]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "CRC mismatch" in errors[0] and f"byte {offsets[19]}" in errors[0]
    st.close()


@pytest.mark.allow_log("cachefs.metanode.raft.storage", match=r"CRC mismatch .* the last one; cutting")
def test_a_zero_filled_tail_is_cut(tmp_path: Path) -> None:
    """The file grew but the pages never came: zeros after the last record."""
    wal, offsets = _wal_of_20(tmp_path)
    with open(wal, "ab") as f:
        f.write(bytes(10_000))
    st = RaftStorage.open(tmp_path)
    assert st.entries == entries(1, 20, 1) and wal.stat().st_size == offsets[20]
    st.close()


def test_an_undecodable_record_is_refused_even_last(tmp_path: Path) -> None:
    """A CRC-valid record that does not decode is a bug, not a torn write."""
    st = RaftStorage.open(tmp_path)
    st.save(entries(1, 3, 1), None, sync=True)
    st.close()
    wal = tmp_path / storage.WAL_NAME
    with open(wal, "ab") as f:
        f.write(storage._record(storage.ENTRY, b"\x94\x01\x04\x07\xc0"))  # kind 7, data nil
    with pytest.raises(Corrupt, match="undecodable"):
        RaftStorage.open(tmp_path)


def test_a_short_write_is_finished_or_cut_back(tmp_path: Path) -> None:
    """A file size limit makes write() short, then fail (as a full disk does).
    The Ready must not be half in the file: a later one would land behind
    the torn half and look like damage before the tail."""
    st = RaftStorage.open(tmp_path)
    st.save(entries(1, 3, 1), HardState(1, 1, 3), sync=True)
    size = st.wal_size()
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 20, old[1]))
        with pytest.raises(OSError) as info:
            st.save(entries(4, 40, 1), HardState(1, 1, 40), sync=True)
        assert info.value.errno == errno.EFBIG
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)
    assert st.wal_size() == size
    st.save(entries(4, 5, 1), HardState(1, 1, 5), sync=True)  # the disk has room again
    st.close()
    st = RaftStorage.open(tmp_path)
    assert st.entries == entries(1, 5, 1) and st.hard_state == HardState(1, 1, 5)
    st.close()


def test_snapshot_round_trip_and_compaction(tmp_path: Path) -> None:
    st = RaftStorage.open(tmp_path)
    st.save(entries(1, 30, 1) + entries(31, 40, 2), HardState(2, 3, 40), sync=True)
    data = b"state machine " * 1000
    snap = Snapshot(SnapshotMeta(35, 2, (1, 2, 3)), data)
    st.save_snapshot(snap)
    st.rewrite(snap.meta, HardState(2, 3, 40), entries(1, 30, 1) + entries(31, 40, 2))
    before = st.wal_size()
    st.save(entries(41, 42, 2), HardState(2, 3, 42), sync=True)
    st.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"snap-{35:020d}.snap", storage.WAL_NAME]
    assert (tmp_path / files[0]).stat().st_size < len(data) // 10  # zstd
    st = RaftStorage.open(tmp_path)
    assert st.snapshot == snap
    assert st.entries == entries(36, 40, 2) + entries(41, 42, 2)
    assert st.hard_state == HardState(2, 3, 42)
    assert before < 1000  # compaction dropped entries 1..35
    # A newer snapshot replaces the older file.
    snap2 = Snapshot(SnapshotMeta(42, 2, (1, 2, 3)), b"newer")
    st.save_snapshot(snap2)
    st.rewrite(snap2.meta, HardState(2, 3, 42), st.entries)
    st.close()
    st = RaftStorage.open(tmp_path)
    assert st.snapshot == snap2 and st.entries == []
    assert len(list(tmp_path.glob("snap-*.snap"))) == 1
    st.close()


def test_corrupt_snapshot_is_refused(tmp_path: Path) -> None:
    st = RaftStorage.open(tmp_path)
    st.save_snapshot(Snapshot(SnapshotMeta(5, 1, (1,)), b"x" * 100))
    st.close()
    path = next(tmp_path.glob("snap-*.snap"))
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(Corrupt):
        RaftStorage.open(tmp_path)


def test_replay_drops_a_tail_that_diverged_before_an_installed_snapshot() -> None:
    # Crash after the snapshot file landed but before the WAL was rewritten:
    # our old entries past the snapshot belong to a log that no longer exists.
    recs = storage.scan(storage.encode_base(0, 0)
                        + storage.encode_ready(entries(1, 8, 1), HardState(1, 1, 2))).records
    rep = storage.replay(recs, SnapshotMeta(6, 3))
    assert rep.entries == [] and rep.hard_state.commit == 6
    rep = storage.replay(recs, SnapshotMeta(6, 1))  # the same log: keep the tail
    assert rep.entries == entries(7, 8, 1)


def test_scan_reports_where_it_stopped() -> None:
    buf = storage.encode_base(0, 0) + storage.encode_ready(entries(1, 3, 1), None)
    assert storage.scan(buf).problem is None
    for cut in range(1, len(buf)):
        res = storage.scan(buf[:cut])
        assert res.valid_len <= cut
        assert (res.problem is None) == (res.valid_len == cut)


def _reboot_and_load(disk: PowerCutDisk) -> tuple[HardState, list[Entry]]:
    disk.cut()
    disk.mount()
    st = RaftStorage.open(disk.mountpoint)
    st.close()
    return st.hard_state, st.entries


@pytest.mark.needs_fuse
def test_records_open_loads_survive_a_power_cut(power_cut_disk: PowerCutDisk) -> None:
    """A replica killed between its WAL write and its fsync restarts with those
    records in the page cache. The core takes what open() returns as
    persisted (it acks those entries, it keeps that vote), so open() must
    make them durable."""
    d = power_cut_disk.mountpoint
    st = RaftStorage.open(d)
    st.save(entries(1, 3, 1), HardState(1, 2, 0), sync=True)
    st.save(entries(4, 6, 2), HardState(2, 3, 0), sync=False)  # killed before the fsync
    st.close()
    st = RaftStorage.open(d)  # the restart
    loaded = (st.hard_state, st.entries)
    assert loaded == (HardState(2, 3, 0), entries(1, 3, 1) + entries(4, 6, 2))
    st.close()
    assert _reboot_and_load(power_cut_disk) == loaded


@pytest.mark.needs_fuse
def test_a_wal_renamed_before_a_kill_survives_a_power_cut(power_cut_disk: PowerCutDisk) -> None:
    """A rewrite (compaction) killed between its rename and its directory
    fsync leaves a WAL whose name only the page cache knows: the restart
    loads it, so open() must make the name durable too."""
    d = power_cut_disk.mountpoint
    st = RaftStorage.open(d)
    st.save(entries(1, 3, 1), HardState(1, 2, 0), sync=True)
    st.close()
    with open(d / "wal.log.new", "wb", buffering=0) as f:
        f.write(storage.encode_base(0, 0) + storage.encode_ready(entries(1, 3, 1), HardState(2, 3, 0)))
        os.fsync(f.fileno())
    os.replace(d / "wal.log.new", d / "wal.log")  # and no directory fsync
    st = RaftStorage.open(d)
    loaded = (st.hard_state, st.entries)
    assert loaded[0] == HardState(2, 3, 0)
    st.close()
    assert _reboot_and_load(power_cut_disk) == loaded
