"""Raft durability: a write-ahead log and state machine snapshots.

On disk, in ``data_dir``::

    wal.log                       records, appended; rewritten on compaction
    snap-<index:020d>.snap        the newest snapshot (older ones are deleted)

A WAL record is ``[u32 length][u32 crc32][u8 type][payload]``; the CRC covers
type and payload. Types: ``BASE`` (the log starts after this snapshot index
and term: the first record of every WAL file), ``ENTRY``, ``HARD_STATE``, and
``READY``, whose payload is the ``ENTRY`` and ``HARD_STATE`` records of one
Raft ``Ready``. Replaying "entry i" means "cut the log after i-1, then
append", so a follower's conflicting suffix needs no separate truncate record.

Group commit: a whole ``Ready`` is one ``READY`` record, one ``write``
(repeated until every byte is in; a failed write is cut back off, so the file
never keeps half a Ready in front of later ones) and at most one
``fdatasync``.

At start-up the WAL is scanned. A crash can only damage its end: the last
write may be short (torn) or hold garbage where its pages never reached the
disk, and since a write is one record, that is the last record. So a bad
*last* record (short, or failing its CRC, with no whole record after it) is
cut off with a log line; then the WAL and its directory are fsynced, since
what a restart after kill -9 reads may not be on disk yet. A bad record with
whole records after it is different: those were written after it, and maybe
fsynced and acknowledged, so cutting there would forget votes and entries
this replica promised. That is refused (:class:`~cachefs.errors.Corrupt`,
naming the file and the offsets), as etcd refuses a CRC mismatch before the
tail. The way back is to rebuild the replica from its peers (docs/raft.md).
(Writes that were never synced can in principle reach the disk out of order,
garbling an earlier unsynced Ready behind a later one; that is refused too:
rebuilding costs time, cutting fsynced records would cost safety.)

A snapshot file is ``MAGIC [u32 crc32] zstd(msgpack [index, term, voters,
data, learners, addrs])`` (older files lack the last two), written to a temporary name, fsynced and renamed, so it is either
whole or absent. Compaction (after a snapshot) rewrites the WAL the same way:
a new file with ``BASE``, the hard state and the entries after the snapshot.

The codec part (``encode_*``, ``scan``, ``replay``) is pure, so the
simulation tests run the very same bytes through a disk that loses unsynced
writes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import zstandard

from cachefs.errors import Corrupt, IOFailure

from .messages import Entry, EntryKind, HardState, Snapshot, SnapshotMeta, snapshot_meta_from

log = logging.getLogger(__name__)

BASE, ENTRY, HARD_STATE, READY = 1, 2, 3, 4
_HEADER = struct.Struct(">IIB")
MAX_RECORD = 1 << 30
SNAP_MAGIC = b"CFSNAP1\n"
NEW_DISK = HardState(discovering=True)  # the hard state a new WAL starts with
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
    flags = hs.rebuilding | hs.discovering << 1
    fields = [hs.term, hs.vote, hs.commit] + ([flags] if flags else [])
    return _record(HARD_STATE, msgpack.packb(fields))


def encode_base(index: int, term: int) -> bytes:
    return _record(BASE, msgpack.packb([index, term]))


def encode_ready(entries: list[Entry] | tuple[Entry, ...], hs: HardState | None) -> bytes:
    """One ``READY`` record: the entries, then the hard state (b"" if none)."""
    inner = encode_entries(entries)
    if hs is not None:
        inner += encode_hard_state(hs)
    return _record(READY, inner) if inner else b""


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
        hs = dataclasses.replace(hs, commit=last)
    if hs.commit < s:
        hs = dataclasses.replace(hs, commit=s)
    return Replayed(hs, entries, problem)


@dataclass(frozen=True, slots=True)
class ScanResult:
    records: list[tuple[int, Any]]
    valid_len: int  # bytes of whole, checked records from the start
    problem: str | None  # why scanning stopped early, or None at a clean end
    record_no: int  # the number of the record where it stopped
    # where the first whole, checked record after the bad one starts: the
    # damage is not at the tail (None: nothing valid follows, a torn end)
    resumes_at: int | None = None


def _decode_payload(kind: int, payload: bytes) -> Any:
    if kind == READY:
        inner = scan(payload)
        if inner.problem is not None or any(k in (BASE, READY) for k, _ in inner.records):
            raise ValueError(f"bad record inside a Ready ({inner.problem or 'nested'})")
        return inner.records
    obj = msgpack.unpackb(payload, raw=False)
    if kind == ENTRY:
        term, index, ekind, data = obj
        if type(data) is not bytes or ekind not in tuple(EntryKind):
            raise ValueError("bad entry")
        return Entry(int(term), int(index), data, EntryKind(ekind))
    if kind == HARD_STATE:
        term, vote, commit, *more = obj
        flags = more[0] if more else 0
        if len(more) > 1 or type(flags) is not int or not 0 <= flags <= 3:
            raise ValueError("bad hard state")
        return HardState(int(term), int(vote), int(commit), bool(flags & 1), bool(flags & 2))
    if kind == BASE:
        index, term = obj
        return (int(index), int(term))
    raise ValueError(f"unknown record type {kind}")


# Resyncing after a bad record looks for the bytes a record header ends with:
# its type and the head of its payload (BASE: a msgpack array of 2; READY:
# the header of its first inner record, whose own payload is an array of 4
# (ENTRY) or 3 or 4 (HARD_STATE)). Only these two start a write, so only they
# prove that something was written after the damage.
_H = _HEADER.size
_RESYNC = (
    (bytes((BASE, 0x92)), _H - 1, BASE),
    (bytes((ENTRY, 0x94)), 2 * _H - 1, READY),
    (bytes((HARD_STATE, 0x93)), 2 * _H - 1, READY),
    (bytes((HARD_STATE, 0x94)), 2 * _H - 1, READY),
)


def _next_whole_record(raw: bytes, start: int) -> int | None:
    """Where the first whole ``BASE`` or ``READY`` record with a valid CRC
    after ``start`` begins, or None. Runs only on a damaged WAL, at start-up."""
    end = len(raw)
    best: int | None = None
    for pattern, back, kind in _RESYNC:
        at = raw.find(pattern, start + 1 + back)
        while at != -1 and (best is None or at - back < best):
            pos = at - back
            length, crc, k = _HEADER.unpack_from(raw, pos)
            if k == kind and 0 < length <= end - pos - _H:
                payload = raw[pos + _H : pos + _H + length]
                if zlib.crc32(payload, zlib.crc32(bytes((kind,)))) == crc:
                    best = pos
                    break
            at = raw.find(pattern, at + 1)
    return best


def scan(buf: bytes | bytearray | memoryview) -> ScanResult:
    """Decode records until the end or the first bad one, and say whether
    whole records follow that one (``resumes_at``). The records of a
    ``READY`` come out one by one, as if written singly."""
    raw = bytes(buf)
    records: list[tuple[int, Any]] = []
    pos = 0
    count = 0
    end = len(raw)

    def stop(problem: str, resumes_at: int | None = None) -> ScanResult:
        if resumes_at is None:
            resumes_at = _next_whole_record(raw, pos)
        return ScanResult(records, pos, problem, count, resumes_at)

    while pos < end:
        if end - pos < _H:
            return stop(f"torn record header ({end - pos} bytes)")
        length, crc, kind = _HEADER.unpack_from(raw, pos)
        if length > MAX_RECORD:
            return stop(f"corrupt record length {length}")
        if end - pos - _H < length:
            return stop(f"torn record ({end - pos - _H} of {length} bytes)")
        payload = raw[pos + _H : pos + _H + length]
        if zlib.crc32(payload, zlib.crc32(bytes((kind,)))) != crc:
            return stop("CRC mismatch")
        try:
            obj = _decode_payload(kind, payload)
        except Exception as exc:  # CRC-valid but undecodable: a bug, never a torn write
            return stop(f"undecodable record ({exc})", pos + _H + length)
        if kind == READY:
            records.extend(obj)
        else:
            records.append((kind, obj))
        count += 1
        pos += _H + length
    return ScanResult(records, pos, None, count)


def record_spans(raw: bytes) -> list[tuple[int, int]]:
    """Where each whole top-level record starts and its size (header
    included), up to a torn one, CRCs unchecked: for tests and the chaos
    matrix, which damage a WAL on purpose."""
    out, pos = [], 0
    while len(raw) - pos >= _H:
        size = _H + _HEADER.unpack_from(raw, pos)[0]
        if len(raw) - pos < size:
            break
        out.append((pos, size))
        pos += size
    return out


def recover(raw: bytes, snapshot: SnapshotMeta, name: str) -> tuple[Replayed, ScanResult]:
    """Scan and replay a WAL read at start-up (``name`` is for errors).

    A bad last record is left for the caller to cut (``ScanResult.valid_len``).

    Raises:
        Corrupt: damage before the tail (whole records follow the bad one),
            or records that do not fit together or with the snapshot.
    """
    res = scan(raw)
    if res.problem is not None and res.resumes_at is not None:
        raise Corrupt(
            f"raft WAL {name}: {res.problem} at byte {res.valid_len} (record {res.record_no}), "
            f"but whole records follow from byte {res.resumes_at}: damage before the tail, "
            f"not a torn write. Refusing to start rather than forget what those records "
            f"promised; rebuild this replica from its peers (move its data directory aside "
            f"and restart it, see docs/raft.md)"
        )
    rep = replay(res.records, snapshot)
    if rep.problem is not None:
        raise Corrupt(f"raft WAL {name}: {rep.problem}")
    return rep, res


def encode_snapshot(snapshot: Snapshot) -> bytes:
    m = snapshot.meta
    body = zstandard.ZstdCompressor(level=3).compress(
        msgpack.packb([m.index, m.term, list(m.voters), snapshot.data, list(m.learners),
                       [list(a) for a in m.addrs]], use_bin_type=True)
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
        index, term, voters, data, *members = msgpack.unpackb(
            zstandard.ZstdDecompressor().decompress(body), raw=False
        )
        return Snapshot(snapshot_meta_from(index, term, voters, *members), data)
    except Exception as exc:
        raise Corrupt(f"raft snapshot: undecodable ({exc})") from None


# ------------------------------------------------------------ on-disk store
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dir(path: Path) -> None:
    """Create ``path`` (and missing parents), each fsynced into its parent:
    a directory entry that never reached the disk takes the WAL with it."""
    if path.is_dir():
        return
    _make_dir(path.parent)
    try:
        path.mkdir()
    except FileExistsError:
        return
    _fsync_dir(path.parent)


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
        """Load (or create) the store, cutting a torn or garbled last record.

        Raises:
            Corrupt: the newest snapshot is unreadable, the WAL is damaged
                before its tail, or WAL and snapshot do not fit together.
        """
        d = Path(data_dir)
        _make_dir(d)
        for stale in d.glob("*.tmp"):
            stale.unlink()
        snaps = sorted(d.glob("snap-*.snap"))
        snapshot = decode_snapshot(snaps[-1].read_bytes()) if snaps else None
        for old in snaps[:-1]:
            old.unlink()
        meta = snapshot.meta if snapshot else SnapshotMeta()
        wal = d / WAL_NAME
        if not wal.exists():
            # No WAL and no snapshot: a new disk, a new cluster's or a lost
            # one's. The replica must ask its peers first (core.py), and must
            # remember to until it has, even across a crash.
            new = b"" if snapshot else encode_ready([], NEW_DISK)
            _write_atomic(wal, encode_base(meta.index, meta.term) + new)
        raw = wal.read_bytes()
        rep, res = recover(raw, meta, str(wal))
        if res.problem is not None:
            level = logging.WARNING if res.problem.startswith("torn") else logging.ERROR
            log.log(
                level,
                "raft WAL %s: %s at byte %d (record %d), the last one; cutting %d bytes there",
                wal,
                res.problem,
                res.valid_len,
                res.record_no,
                len(raw) - res.valid_len,
            )
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
        """One Ready: one write, and one fdatasync when ``sync``.

        A write can be short (a full disk, a file size limit): the rest is
        written on, and if that fails the partial Ready is cut off again, so
        a later Ready never lands behind half a record.

        Raises:
            OSError: the write failed; nothing of this Ready is in the file,
                and the same call may be retried.
            IOFailure: the fdatasync failed: not to be retried.
        """
        buf = encode_ready(entries, hard_state)
        if buf:
            start = os.lseek(self._fd, 0, os.SEEK_END)
            view = memoryview(buf)
            try:
                while view:
                    view = view[os.write(self._fd, view) :]
            except BaseException:
                os.ftruncate(self._fd, start)
                raise
        if sync:
            try:
                os.fdatasync(self._fd)
            except OSError as exc:
                # After a failed fsync the kernel may have dropped the dirty
                # pages and cleared the error, so a retry could "succeed"
                # without the data (PostgreSQL's fsyncgate): stop instead.
                raise IOFailure(
                    f"raft WAL {self.data_dir / WAL_NAME}: fdatasync failed ({exc.strerror}); "
                    f"what it covered may not be on disk, so this replica stops"
                ) from exc
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
