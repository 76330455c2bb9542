"""The datanode's on-disk shard store. Blocking file IO; the service runs it in threads.

Layout under the data directory::

    shards/<volume>/<fan>/<key hex>.<shard index>   one file per shard
    tmp/                                            writes in progress

``fan`` is two hex digits of a hash of the key, so no directory grows past a
few thousand entries. A shard file is self-describing and self-checking::

    header  magic "CFSS", version, meta length, data length, chunk size,
            chunk count, xxh3 of (header fields + meta + checksum table)
    meta    the caller's small opaque header (the block header)
    table   one xxh3-64 per 64 KiB chunk of data
    data

Every read verifies the header checksum and the checksums of the chunks it
touches, so a byte range needs only its covering chunks read, and a flipped
bit, a truncated or a zero-filled file is reported as :class:`Corrupt` and
never returned. A corrupt shard is deleted on detection and an empty
``<name>.corrupt`` marker left in its place: later reads still answer
``Corrupt`` (data loss must not read as "never written"), listings skip it,
and the next put of that shard (repair) clears it.

Atomicity: a shard is written to ``tmp/``, fsynced, renamed into place, and
the directory fsynced. Readers see the old shard or the new one, never a
partial one, also after kill -9 or power loss; start-up removes leftover
temporary files. A new volume or fan directory is fsynced into its parent
before any shard in it is acknowledged (without that, a power cut loses the
directory and every shard in it). After kill -9 a directory may hold names
only the page cache knows (a put killed between rename and directory
fsync), so start-up fsyncs every directory it counts shards in before
serving: what the store reports as present is durable. Capacity is reserved before writing; a write that would pass
``capacity`` (or hits a real ENOSPC) raises :class:`NoSpace` and leaves nothing.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import struct
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import xxhash

from cachefs.errors import Corrupt, InvalidArgument, IOFailure, NoSpace, NotFound
from cachefs.pagecache import pread_nowait

log = logging.getLogger(__name__)

CHUNK_SIZE = 64 * 1024
MAX_META = 4096
MAX_INDEX = 255
_HEAD = struct.Struct(">4sBxHQII")
_MAGIC = b"CFSS"
_VERSION = 1
_CSUM = struct.Struct(">Q")
_PREFIX = _HEAD.size + _CSUM.size
_VOLUME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")
_NAME = re.compile(r"([0-9a-f]{16}-[0-9a-f]{8})\.(\d{1,3})")
_KEY_HEX = re.compile(r"[0-9a-f]{16}-[0-9a-f]{8}")


@dataclass(frozen=True, slots=True)
class ShardInfo:
    volume: str
    key: str  # BlockKey.hex()
    index: int
    size: int  # bytes on disk, headers included


def _fan(key: str) -> str:
    return f"{xxhash.xxh3_64_intdigest(key.encode()) & 0xFF:02x}"


def check_volume(volume: str) -> str:
    if not isinstance(volume, str) or not _VOLUME.fullmatch(volume):
        raise InvalidArgument(f"bad volume name {volume!r}: use 1-64 of [A-Za-z0-9._-]")
    return volume


def _check_key(key: str, index: int) -> None:
    if not _KEY_HEX.fullmatch(key):
        raise InvalidArgument(f"bad block key {key!r}")
    if not 0 <= index <= MAX_INDEX:
        raise InvalidArgument(f"shard index must be 0..{MAX_INDEX}, got {index}")


def encode_shard_file(meta: bytes, data: bytes | bytearray | memoryview) -> list[bytes | memoryview]:
    """The byte pieces of a shard file (header, meta, table, data)."""
    view = memoryview(data)
    count = (len(view) + CHUNK_SIZE - 1) // CHUNK_SIZE
    table = b"".join(
        _CSUM.pack(xxhash.xxh3_64_intdigest(view[i * CHUNK_SIZE : (i + 1) * CHUNK_SIZE]))
        for i in range(count)
    )
    head = _HEAD.pack(_MAGIC, _VERSION, len(meta), len(view), CHUNK_SIZE, count)
    csum = _CSUM.pack(xxhash.xxh3_64_intdigest(head + meta + table))
    return [head, csum, meta, table, view]


class ShardStore:
    """Shards of blocks on one local filesystem, with capacity accounting.

    Thread-safe: the only shared state is the usage counter (under a lock);
    file operations rely on rename atomicity.
    """

    def __init__(self, root: str | os.PathLike[str], capacity: int, *, durable: bool = True) -> None:
        if capacity <= 0:
            raise InvalidArgument(f"capacity must be positive, got {capacity}")
        self.root = Path(root)
        self.capacity = capacity
        self.durable = durable
        self._lock = threading.Lock()
        self._stripes = [threading.Lock() for _ in range(64)]
        self._dirs_lock = threading.Lock()
        self._durable_dirs: set[Path] = set()  # volume and fan directories fsynced into their parents
        self.corrupt_found = 0
        self._shards_dir = self.root / "shards"
        self._tmp_dir = self.root / "tmp"
        self._shards_dir.mkdir(parents=True, exist_ok=True)
        self._tmp_dir.mkdir(parents=True, exist_ok=True)
        for leftover in self._tmp_dir.iterdir():
            log.info("removing leftover temporary shard %s", leftover.name)
            leftover.unlink(missing_ok=True)
        self.used, self.shard_count = self._scan_usage()
        if durable:
            self._fsync_dir(self.root)  # shards/ and tmp/ themselves

    # -- accounting -----------------------------------------------------------

    def _scan_usage(self) -> tuple[int, int]:
        """Bytes and shards on disk; with ``durable``, every directory fsynced on the way."""
        used = count = 0
        for dirpath, _dirs, files in os.walk(self._shards_dir):
            if self.durable:
                self._fsync_dir(Path(dirpath))
                self._durable_dirs.add(Path(dirpath))
            for name in files:
                if name.endswith(".corrupt"):
                    continue
                try:
                    used += os.stat(os.path.join(dirpath, name)).st_size
                    count += 1
                except FileNotFoundError:
                    pass
        return used, count

    def _reserve(self, size: int) -> None:
        with self._lock:
            if size > 0 and self.used + size > self.capacity:
                raise NoSpace(
                    f"shard of {size} bytes does not fit: {self.used} of {self.capacity} bytes used"
                )
            self.used += size

    def _release(self, size: int, shards: int = 0) -> None:
        with self._lock:
            self.used -= size
            self.shard_count -= shards

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {"capacity": self.capacity, "used": self.used, "shards": self.shard_count}

    # -- paths ----------------------------------------------------------------

    def _path(self, volume: str, key: str, index: int) -> Path:
        check_volume(volume)
        _check_key(key, index)
        return self._shards_dir / volume / _fan(key) / f"{key}.{index}"

    # -- operations -----------------------------------------------------------

    def put(self, volume: str, key: str, index: int, meta: bytes, data: bytes | bytearray | memoryview) -> None:
        """Store (or replace) one shard atomically and durably.

        Raises:
            NoSpace: over capacity or the disk is full; nothing is left behind.
            InvalidArgument: bad volume, key, index or meta.
        """
        path = self._path(volume, key, index)
        if len(meta) > MAX_META:
            raise InvalidArgument(f"shard meta is {len(meta)} bytes, at most {MAX_META}")
        pieces = encode_shard_file(bytes(meta), data)
        with self._stripe(path):
            self._put_locked(path, key, index, pieces)

    def _put_locked(self, path: Path, key: str, index: int, pieces: list[bytes | memoryview]) -> None:
        size = sum(len(p) for p in pieces)
        try:
            old_size = path.stat().st_size
        except FileNotFoundError:
            old_size = -1
        delta = size - max(old_size, 0)  # a replaced shard gives its space back
        self._reserve(delta)
        tmp = self._tmp_dir / f"{uuid.uuid4().hex}.tmp"
        try:
            self._make_dirs(path.parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for piece in pieces:
                    view = memoryview(piece)
                    while view:
                        view = view[os.write(fd, view) :]
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            self._marker(path).unlink(missing_ok=True)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self._release(delta)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise NoSpace(f"disk full writing shard {key}.{index}") from exc
            raise IOFailure(f"writing shard {key}.{index}: {exc}") from exc
        except BaseException:
            tmp.unlink(missing_ok=True)
            self._release(delta)
            raise
        if self.durable:
            self._fsync_dir(path.parent)
        if old_size < 0:
            with self._lock:
                self.shard_count += 1

    def _make_dirs(self, fan_dir: Path) -> None:
        """The volume and fan directories of a shard exist and are durably in their parents.

        Under one lock: a put that finds the directory made by another must
        not go on before that one's parent fsync is done.
        """
        if fan_dir in self._durable_dirs:
            return
        with self._dirs_lock:
            for d in (fan_dir.parent, fan_dir):
                if d in self._durable_dirs:
                    continue
                d.mkdir(exist_ok=True)
                if self.durable:
                    self._fsync_dir(d.parent)
                self._durable_dirs.add(d)

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def get(self, volume: str, key: str, index: int, offset: int = 0,
            length: int = -1, *, nowait: bool = False) -> tuple[bytes, bytes | bytearray | memoryview, int]:
        """Read ``[offset, offset+length)`` of a shard's data (length -1: to the end).

        Returns ``(meta, data, total data length)``; a range inside the chunks
        read is a view of them, not a copy. With ``nowait`` every read is a
        ``preadv(RWF_NOWAIT)``: bytes not all in the page cache raise
        :class:`WouldBlock` instead of waiting for the disk (the service then
        reads in a worker thread), so the caller's thread may be an event loop.

        Raises:
            NotFound: no such shard.
            Corrupt: a checksum failed (the shard is removed, so it reads as missing next time).
            WouldBlock: ``nowait`` and the bytes are not all in the page cache.
        """
        if offset < 0 or length < -1:
            raise InvalidArgument(f"bad range offset={offset} length={length}")
        path = self._path(volume, key, index)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._missing(path, volume, key, index)
        pread = pread_nowait if nowait else os.pread
        try:
            meta, table, data_start, data_len, file_size = self._read_head(fd, path, pread)
            end = data_len if length == -1 else min(data_len, offset + length)
            start = min(offset, data_len)
            if end <= start:
                return meta, b"", data_len
            first, last = start // CHUNK_SIZE, (end - 1) // CHUNK_SIZE
            chunk_start = first * CHUNK_SIZE
            chunk_end = min(data_len, (last + 1) * CHUNK_SIZE)
            raw = pread(fd, chunk_end - chunk_start, data_start + chunk_start)
            if len(raw) != chunk_end - chunk_start:
                self._corrupt(fd, path, "truncated data")
            view = memoryview(raw)
            for n in range(first, last + 1):
                piece = view[(n - first) * CHUNK_SIZE : (n - first + 1) * CHUNK_SIZE]
                if xxhash.xxh3_64_intdigest(piece) != table[n]:
                    self._corrupt(fd, path, f"chunk {n} fails its checksum")
            if start == chunk_start and end == chunk_end:
                return meta, raw, data_len
            return meta, view[start - chunk_start : end - chunk_start], data_len
        except OSError as exc:
            raise IOFailure(f"reading shard {key}.{index}: {exc}") from exc
        finally:
            os.close(fd)

    def _read_head(self, fd: int, path: Path,
                   pread: Callable[[int, int, int], bytes | bytearray] = os.pread,
                   ) -> tuple[bytes, list[int], int, int, int]:
        file_size = os.fstat(fd).st_size
        prefix = pread(fd, min(_PREFIX + MAX_META + 256, file_size), 0)
        if len(prefix) < _PREFIX:
            self._corrupt(fd, path, "truncated header")
        magic, version, meta_len, data_len, chunk_size, count = _HEAD.unpack_from(prefix)
        if magic != _MAGIC or version != _VERSION or chunk_size != CHUNK_SIZE or meta_len > MAX_META:
            self._corrupt(fd, path, "bad header")
        if count != (data_len + CHUNK_SIZE - 1) // CHUNK_SIZE:
            self._corrupt(fd, path, "bad chunk count")
        rest = meta_len + 8 * count
        if len(prefix) < _PREFIX + rest:
            prefix = pread(fd, min(_PREFIX + rest, file_size), 0)
        body = prefix[_PREFIX : _PREFIX + rest]
        (csum,) = _CSUM.unpack_from(prefix, _HEAD.size)
        if len(body) != rest or xxhash.xxh3_64_intdigest(prefix[: _HEAD.size] + body) != csum:
            self._corrupt(fd, path, "header checksum mismatch")
        data_start = _PREFIX + rest
        if file_size != data_start + data_len:
            self._corrupt(fd, path, f"file is {file_size} bytes, header says {data_start + data_len}")
        meta = bytes(body[:meta_len])
        table = list(struct.unpack_from(f">{count}Q", body, meta_len))
        return meta, table, data_start, data_len, file_size

    @staticmethod
    def _marker(path: Path) -> Path:
        return path.with_name(path.name + ".corrupt")

    def _missing(self, path: Path, volume: str, key: str, index: int) -> NoReturn:
        if self._marker(path).exists():
            raise Corrupt(f"shard {volume}/{key}.{index} was found corrupt and awaits repair")
        raise NotFound(f"shard {volume}/{key}.{index} not on this datanode")

    def _corrupt(self, fd: int, path: Path, why: str) -> NoReturn:
        """Drop a bad shard, leave a marker that says so, and raise Corrupt.

        Only the file that was read (same inode) is dropped: a put may have
        replaced it with a good shard meanwhile.
        """
        log.warning("corrupt shard %s: %s; removing it", path, why)
        with self._lock:
            self.corrupt_found += 1
        bad_inode = os.fstat(fd).st_ino
        with self._stripe(path):
            try:
                st = path.stat()
                if st.st_ino == bad_inode:
                    self._marker(path).touch()
                    path.unlink()
                    self._release(st.st_size, 1)
            except FileNotFoundError:
                pass
        raise Corrupt(f"shard {path.name}: {why}")

    def _stripe(self, path: Path) -> threading.Lock:
        """Serialises changes to one shard path (put, delete, drop) across threads."""
        return self._stripes[hash(path.name) % len(self._stripes)]

    def stat(self, volume: str, key: str, index: int) -> tuple[bytes, int]:
        """``(meta, data length)`` of a shard, checking its header only."""
        path = self._path(volume, key, index)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._missing(path, volume, key, index)
        try:
            meta, _table, _start, data_len, _size = self._read_head(fd, path)
            return meta, data_len
        finally:
            os.close(fd)

    def verify(self, volume: str, key: str, index: int) -> bool:
        """Read and check a whole shard; False (and the shard removed) when corrupt."""
        try:
            self.get(volume, key, index)
        except Corrupt:
            return False
        return True

    def delete(self, volume: str, key: str, index: int = -1) -> int:
        """Delete one shard, or every shard of ``key`` here (index -1). Returns the count."""
        if index >= 0:
            paths = [self._path(volume, key, index)]
        else:
            self._path(volume, key, 0)  # validates
            fan_dir = self._shards_dir / volume / _fan(key)
            try:
                paths = [p for p in fan_dir.iterdir() if p.name.startswith(key + ".")]
            except FileNotFoundError:
                paths = []
        removed = 0
        for path in paths:
            if path.name.endswith(".corrupt"):
                path.unlink(missing_ok=True)
                continue
            with self._stripe(path):
                self._marker(path).unlink(missing_ok=True)
                try:
                    size = path.stat().st_size
                    path.unlink()
                except FileNotFoundError:
                    continue
                self._release(size, 1)
            removed += 1
        return removed

    def volumes(self) -> list[str]:
        return sorted(p.name for p in self._shards_dir.iterdir() if p.is_dir())

    def list(self, volume: str, cursor: str = "", limit: int = 1000) -> tuple[list[ShardInfo], str]:
        """A page of this volume's shards in a stable order.

        ``cursor`` is "" to start, then the value returned by the previous page;
        the returned cursor is "" when the listing is complete.
        """
        check_volume(volume)
        if limit < 1:
            raise InvalidArgument(f"limit must be positive, got {limit}")
        out: list[ShardInfo] = []
        last = ""
        for position, info in self._walk(volume, cursor):
            if len(out) == limit:
                return out, last
            out.append(info)
            last = position
        return out, ""

    @staticmethod
    def cursor_after(info: ShardInfo) -> str:
        """The listing cursor that resumes right after ``info`` (a page cut short)."""
        return f"{_fan(info.key)}/{info.key}.{info.index}"

    def _walk(self, volume: str, cursor: str) -> Iterator[tuple[str, ShardInfo]]:
        vol_dir = self._shards_dir / volume
        if not vol_dir.is_dir():
            return
        cur_fan, _, cur_name = cursor.partition("/")
        for fan in sorted(p.name for p in vol_dir.iterdir()):
            if fan < cur_fan:
                continue
            try:
                entries = sorted(os.scandir(vol_dir / fan), key=lambda e: e.name)
            except FileNotFoundError:
                continue
            for entry in entries:
                if fan == cur_fan and entry.name <= cur_name:
                    continue
                match = _NAME.fullmatch(entry.name)
                if not match:
                    continue
                try:
                    size = entry.stat().st_size
                except FileNotFoundError:
                    continue
                yield f"{fan}/{entry.name}", ShardInfo(volume, match[1], int(match[2]), size)
