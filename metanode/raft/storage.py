"""Raft durability: a write-ahead log and state machine snapshots.

On disk, in ``data_dir``::

    wal.log                       records, appended; rewritten on compaction
    snap-<index:020d>.snap        the newest snapshot (older ones are deleted)

A WAL record is ``[u32 length][u32 crc32][u8 type][payload]``; the CRC covers
type and payload. Types: ``BASE`` (the log starts after this snapshot index
and term: the first record of every WAL file), ``ENTRY`` and ``HARD_STATE``.
Replaying "entry i" means "cut the log after i-1, then append", so a
follower's conflicting suffix needs no separate truncate record.

Group commit: a whole Raft ``Ready`` (every entry and the hard state) is one
``write`` and at most one ``fdatasync``. At start-up the WAL is scanned; at the
first record that is short (a torn write from a crash) or fails its CRC (bit
rot), the file is cut there, with a log line saying where and why; then the
WAL and its directory are fsynced, since what a restart after kill -9 reads
may not be on disk yet.

A snapshot file is ``MAGIC [u32 crc32] zstd(msgpack [index, term, voters,
data])``, written to a temporary name, fsynced and renamed, so it is either
whole or absent. Compaction (after a snapshot) rewrites the WAL the same way:
a new file with ``BASE``, the hard state and the entries after the snapshot.

The codec part (``encode_*``, ``scan``, ``replay``) is pure, so the
simulation tests run the very same bytes through a disk that loses unsynced
writes.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import zstandard

from cachefs.errors import Corrupt

from .messages import Entry, EntryKind, HardState, Snapshot, SnapshotMeta

log = logging.getLogger(__name__)

BASE, ENTRY, HARD_STATE = 1, 2, 3
_HEADER = struct.Struct(">IIB")
MAX_RECORD = 1 << 30
SNAP_MAGIC = b"CFSNAP1\n"
WAL_NAME = "wal.log"


# ------------------------------------------------------------------ codec
def _record(kind: int, payload: bytes) -> bytes:
    crc = zlib.crc32(payload, zlib.crc32(bytes((kind,))))
    return _HEADER.pack(len(payload), crc, kind) + payload


def encode_entries(entries: list[Entry] | tuple[Entry, ...]) -> bytes:
    pack = msgpack.packb
    return b"".join(
        _record(ENTRY, pack([e.term, e.index, int(e.kind), e.data], use_bin_type=True))
        for e in entries
    )


def encode_hard_state(hs: HardState) -> bytes:
    return _record(HARD_STATE, msgpack.packb([hs.term, hs.vote, hs.commit]))


def encode_base(index: int, term: int) -> bytes:
    return _record(BASE, msgpack.packb([index, term]))


def encode_ready(entries: list[Entry] | tuple[Entry, ...], hs: HardState | None) -> bytes:
    """Entries first, then the hard state: a torn write that kept the hard
    state kept the entries it commits."""
    out = encode_entries(entries)
    if hs is not None:
        out += encode_hard_state(hs)
    return out


@dataclass(frozen=True, slots=True)
class ScanResult:
    records: list[tuple[int, Any]]
    valid_len: int  # bytes of whole, checked records from the start
    problem: str | None  # why scanning stopped early, or None at a clean end
    record_no: int  # the number of the record where it stopped


def _decode_payload(kind: int, payload: bytes) -> Any:
    obj = msgpack.unpackb(payload, raw=False)
    if kind == ENTRY:
        term, index, ekind, data = obj
        if type(data) is not bytes or ekind not in (0, 1):
            raise ValueError("bad entry")
        return Entry(int(term), int(index), data, EntryKind(ekind))
    if kind == HARD_STATE:
        term, vote, commit = obj
        return HardState(int(term), int(vote), int(commit))
    if kind == BASE:
        index, term = obj
        return (int(index), int(term))
    raise ValueError(f"unknown record type {kind}")


def scan(buf: bytes | bytearray | memoryview) -> ScanResult:
    """Decode records until the end or the first bad one."""
    view = memoryview(buf)
    records: list[tuple[int, Any]] = []
    pos = 0
    end = len(view)
    hsize = _HEADER.size
    while pos < end:
        n = len(records)
        if end - pos < hsize:
            return ScanResult(records, pos, f"torn record header ({end - pos} bytes)", n)
        length, crc, kind = _HEADER.unpack_from(view, pos)
        if length > MAX_RECORD:
            return ScanResult(records, pos, f"corrupt record length {length}", n)
        if end - pos - hsize < length:
            return ScanResult(
                records, pos, f"torn record ({end - pos - hsize} of {length} bytes)", n
            )
        payload = bytes(view[pos + hsize : pos + hsize + length])
        if zlib.crc32(payload, zlib.crc32(bytes((kind,)))) != crc:
            return ScanResult(records, pos, "CRC mismatch", n)
        try:
            obj = _decode_payload(kind, payload)
        except Exception as exc:  # a CRC-valid but undecodable record: a bug or an attack
            return ScanResult(records, pos, f"undecodable record ({exc})", n)
        records.append((kind, obj))
        pos += hsize + length
    return ScanResult(records, pos, None, len(records))


@dataclass(frozen=True, slots=True)
class Replayed:
    hard_state: HardState
    entries: list[Entry]
    problem: str | None  # an inconsistency that made replay stop early


def replay(records: list[tuple[int, Any]], snapshot: SnapshotMeta) -> Replayed:
    """Rebuild hard state and the entries after ``snapshot`` from records."""
    hs = HardState()
    base_index, base_term = 0, 0
    entries: list[Entry] = []
    problem = None
    for kind, obj in records:
        if kind == BASE:
            base_index, base_term = obj
            entries = []
        elif kind == HARD_STATE:
            hs = obj
        else:
            e: Entry = obj
            first = base_index + 1
            if e.index < first:
                continue
            if e.index > first + len(entries):
                problem = f"gap before entry {e.index}"
                break
            del entries[e.index - first :]
            entries.append(e)
    # Keep only what follows the snapshot, and only if our log passes through
    # the snapshot's last entry (else it diverged before the snapshot was
    # installed and the tail belongs to nobody).
    s = snapshot.index
    if s > base_index:
        k = s - base_index - 1
        if k < len(entries) and entries[k].term == snapshot.term:
            entries = entries[k + 1 :]
        else:
            entries = []
    elif s < base_index:
        problem = problem or f"WAL starts after {base_index} but the snapshot is at {s}"
    elif base_term != snapshot.term and s > 0:
        problem = problem or f"WAL base term {base_term} != snapshot term {snapshot.term}"
    last = s + len(entries)
    if hs.commit > last:
        hs = HardState(hs.term, hs.vote, last)
    if hs.commit < s:
        hs = HardState(hs.term, hs.vote, s)
    return Replayed(hs, entries, problem)


def encode_snapshot(snapshot: Snapshot) -> bytes:
    m = snapshot.meta
    body = zstandard.ZstdCompressor(level=3).compress(
        msgpack.packb([m.index, m.term, list(m.voters), snapshot.data], use_bin_type=True)
    )
    return SNAP_MAGIC + struct.pack(">I", zlib.crc32(body)) + body


def decode_snapshot(raw: bytes) -> Snapshot:
    """Raises:
    Corrupt: bad magic, CRC or content.
    """
    head = len(SNAP_MAGIC) + 4
    if raw[: len(SNAP_MAGIC)] != SNAP_MAGIC or len(raw) < head:
        raise Corrupt("raft snapshot: bad magic")
    (crc,) = struct.unpack_from(">I", raw, len(SNAP_MAGIC))
    body = raw[head:]
    if zlib.crc32(body) != crc:
        raise Corrupt("raft snapshot: CRC mismatch")
    try:
        index, term, voters, data = msgpack.unpackb(
            zstandard.ZstdDecompressor().decompress(body), raw=False
        )
        return Snapshot(SnapshotMeta(int(index), int(term), tuple(int(v) for v in voters)), data)
    except Exception as exc:
        raise Corrupt(f"raft snapshot: undecodable ({exc})") from None


# ------------------------------------------------------------ on-disk store
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class RaftStorage:
    """The WAL and snapshots of one replica. Blocking calls: the driver runs
    them in a worker thread, one at a time."""

    def __init__(
        self,
        data_dir: Path,
        fd: int,
        hard_state: HardState,
        snapshot: Snapshot | None,
        entries: list[Entry],
    ) -> None:
        self.data_dir = data_dir
        self._fd = fd
        self.hard_state = hard_state  # as loaded
        self.snapshot = snapshot
        self.entries = entries
        self.syncs = 0  # fsyncs done: lets tests and benchmarks see group commit

    @classmethod
    def open(cls, data_dir: str | os.PathLike[str]) -> RaftStorage:
        """Load (or create) the store, cutting a torn or corrupt WAL tail.

        Raises:
            Corrupt: the newest snapshot is unreadable, or WAL and snapshot
                do not fit together.
        """
        d = Path(data_dir)
        d.mkdir(parents=True, exist_ok=True)
        for stale in d.glob("*.tmp"):
            stale.unlink()
        snaps = sorted(d.glob("snap-*.snap"))
        snapshot = decode_snapshot(snaps[-1].read_bytes()) if snaps else None
        for old in snaps[:-1]:
            old.unlink()
        meta = snapshot.meta if snapshot else SnapshotMeta()
        wal = d / WAL_NAME
        if not wal.exists():
            _write_atomic(wal, encode_base(meta.index, meta.term))
        raw = wal.read_bytes()
        res = scan(raw)
        if res.problem is not None:
            level = logging.WARNING if res.problem.startswith("torn") else logging.ERROR
            log.log(
                level,
                "raft WAL %s: %s at byte %d (record %d); cutting %d bytes there",
                wal,
                res.problem,
                res.valid_len,
                res.record_no,
                len(raw) - res.valid_len,
            )
        rep = replay(res.records, meta)
        if rep.problem is not None:
            raise Corrupt(f"raft WAL {wal}: {rep.problem}")
        fd = os.open(wal, os.O_WRONLY | os.O_APPEND)
        if res.problem is not None:
            os.ftruncate(fd, res.valid_len)
        # After kill -9, what was just read may be only in the page cache (a
        # save killed before its fsync, a rewrite before its directory fsync);
        # the core takes it as persisted, so make it so before it acts on it.
        os.fsync(fd)
        _fsync_dir(d)
        return cls(d, fd, rep.hard_state, snapshot, rep.entries)

    def save(
        self, entries: list[Entry] | tuple[Entry, ...], hard_state: HardState | None, sync: bool
    ) -> None:
        """One Ready: one write, and one fdatasync when ``sync``."""
        buf = encode_ready(entries, hard_state)
        if buf:
            os.write(self._fd, buf)
        if sync:
            os.fdatasync(self._fd)
            self.syncs += 1

    def save_snapshot(self, snapshot: Snapshot) -> None:
        path = self.data_dir / f"snap-{snapshot.meta.index:020d}.snap"
        _write_atomic(path, encode_snapshot(snapshot))
        for old in self.data_dir.glob("snap-*.snap"):
            if old != path:
                old.unlink()
        self.snapshot = snapshot

    def rewrite(
        self, base: SnapshotMeta, hard_state: HardState, entries: list[Entry] | tuple[Entry, ...]
    ) -> None:
        """Replace the WAL with one that starts after ``base`` (compaction,
        or a snapshot installed from the leader)."""
        wal = self.data_dir / WAL_NAME
        _write_atomic(
            wal,
            encode_base(base.index, base.term)
            + encode_ready([e for e in entries if e.index > base.index], hard_state),
        )
        os.close(self._fd)
        self._fd = os.open(wal, os.O_WRONLY | os.O_APPEND)
        self.syncs += 1

    def wal_size(self) -> int:
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
