"""InstallSnapshot over RPC: zstd-compressed, in chunks, spooled to disk.

A snapshot can be as large as the state machine, so it does not travel as
one ``raft_step`` message. The leader compresses ``[u32 n][header][data]``
(``header`` is msgpack ``[term, src, dst, index, term, voters, len(data)]``,
``n`` its length) and sends it as numbered ``raft_snapshot`` chunks.

The receiver holds none of it in memory while it arrives: each chunk is
appended to ``install-<src>.tmp`` in the data directory (``RaftStorage``
deletes stray ``*.tmp`` files at start-up). On the last chunk it decompresses
the file as a stream, refusing a header that claims more than
``max_size`` bytes of data and a stream that holds more than the header
claims or more than ``max_size`` altogether, so the peak memory of a
transfer is one copy of the snapshot data, at most ``max_size`` bytes,
however hostile the sender. Spooled bytes are capped by ``max_size`` too
(compression never makes data larger by more than a few bytes per block,
so an honest transfer always fits). One transfer per source at a time, and
one decompression at a time.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import trio
import zstandard

from cachefs.errors import InvalidArgument, ProtocolError

from .messages import InstallSnapshot, Snapshot, snapshot_meta_from

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
MAX_HEADER = 64 << 10  # a header is a few small ints and the voter list
# Decompression window: the sender uses level 1 (a window of at most 2 MiB);
# refusing bigger windows stops a stream from making us allocate one.
MAX_WINDOW = 8 << 20


def encode(m: InstallSnapshot) -> bytes:
    """The compressed transfer body of ``m`` (the leader's side)."""
    meta, data = m.snapshot.meta, m.snapshot.data
    header = msgpack.packb([m.term, m.src, m.dst, meta.index, meta.term, list(meta.voters),
                            len(data), list(meta.learners), [list(a) for a in meta.addrs]])
    cctx = zstandard.ZstdCompressor(level=1)
    return cctx.compress(_LEN.pack(len(header)) + header + data)


def _uint(v: Any, what: str) -> int:
    if type(v) is not int or v < 0:
        raise ProtocolError(f"raft snapshot transfer: {what} must be a non-negative int")
    return v


def decode(path: Path, max_size: int) -> InstallSnapshot:
    """Read a transfer body spooled in ``path`` (blocking: run in a thread).

    Raises:
        ProtocolError: not zstd, a malformed header, or data of another size
            than the header says.
        InvalidArgument: the snapshot is over ``max_size`` bytes.
    """
    dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
    with open(path, "rb") as f, dctx.stream_reader(f) as reader:
        try:
            raw_len = reader.read(_LEN.size)
            if len(raw_len) != _LEN.size:
                raise ProtocolError("raft snapshot transfer: truncated")
            (n,) = _LEN.unpack(raw_len)
            if n > MAX_HEADER:
                raise ProtocolError(f"raft snapshot transfer: a {n}-byte header")
            fields = msgpack.unpackb(reader.read(n), raw=False)
            if type(fields) is not list or len(fields) not in (7, 9):
                raise ProtocolError("raft snapshot transfer: bad header")
            term, src, dst, size = (
                _uint(fields[k], what) for k, what in ((0, "term"), (1, "src"), (2, "dst"),
                                                       (6, "size")))
            meta = snapshot_meta_from(fields[3], fields[4], fields[5], *fields[7:])
            if size > max_size:
                raise InvalidArgument(
                    f"raft snapshot from {src}: {size} bytes, over this replica's limit of "
                    f"{max_size} (max_snapshot); refused")
            data = reader.read(size)
            if len(data) != size or reader.read(1):
                raise ProtocolError(
                    f"raft snapshot transfer: the header says {size} bytes of data, "
                    f"the stream holds {'fewer' if len(data) < size else 'more'}")
        except zstandard.ZstdError as exc:
            raise ProtocolError(f"raft snapshot transfer: undecodable ({exc})") from None
        except (ValueError, msgpack.UnpackException) as exc:
            raise ProtocolError(f"raft snapshot transfer: bad header ({exc})") from None
    return InstallSnapshot(term, src, dst, Snapshot(meta, data))


class _Spool:
    __slots__ = ("xfer", "next_chunk", "size", "path")

    def __init__(self, xfer: int, path: Path) -> None:
        self.xfer = xfer
        self.next_chunk = 0
        self.size = 0
        self.path = path


class SnapshotReceiver:
    """The follower's side: ``await receiver.chunk(...)`` per RPC call;
    the last chunk returns the assembled message."""

    def __init__(self, spool_dir: Path, max_size: int) -> None:
        self.spool_dir = spool_dir
        self.max_size = max_size
        self._spools: dict[int, _Spool] = {}
        self._locks: dict[int, trio.Lock] = {}
        self._decoding = trio.Lock()

    async def chunk(self, src: int, xfer: int, chunk: int, chunks: int,
                    payload: bytes | bytearray | memoryview) -> InstallSnapshot | None:
        """Take chunk ``chunk`` of ``chunks`` of transfer ``xfer`` from ``src``.

        Raises:
            InvalidArgument: out of order, over ``max_size``, or claiming to
                come from another node than ``src``; the transfer is dropped.
            ProtocolError: the assembled transfer does not decode.
        """
        if not 0 <= chunk < chunks:
            raise InvalidArgument(f"raft_snapshot: chunk {chunk} of {chunks}")
        lock = self._locks.setdefault(src, trio.Lock())
        async with lock:  # a sender sends one chunk at a time; a hostile one may not
            spool = self._spools.get(src)
            if chunk == 0:
                if spool is not None:
                    await self._drop(src)
                spool = _Spool(xfer, self.spool_dir / f"install-{src}.tmp")
                self._spools[src] = spool
            if spool is None or spool.xfer != xfer or spool.next_chunk != chunk:
                await self._drop(src)
                raise InvalidArgument(
                    f"raft_snapshot: chunk {chunk} of transfer {xfer} from {src} out of order")
            if spool.size + len(payload) > self.max_size:
                await self._drop(src)
                raise InvalidArgument(
                    f"raft_snapshot from {src}: over this replica's limit of {self.max_size} "
                    f"bytes (max_snapshot); refused")
            try:
                await trio.to_thread.run_sync(_append, spool.path, payload, chunk == 0)
            except BaseException:
                await self._drop(src)
                raise
            spool.size += len(payload)
            spool.next_chunk += 1
            if spool.next_chunk < chunks:
                return None
            del self._spools[src]
            try:
                async with self._decoding:
                    m = await trio.to_thread.run_sync(decode, spool.path, self.max_size)
            finally:
                await trio.to_thread.run_sync(_unlink, spool.path)
        if m.src != src:
            raise InvalidArgument(f"raft_snapshot: a transfer from {src} says it is from {m.src}")
        return m

    async def _drop(self, src: int) -> None:
        spool = self._spools.pop(src, None)
        if spool is not None:
            await trio.to_thread.run_sync(_unlink, spool.path)

    def close(self) -> None:
        for spool in self._spools.values():
            _unlink(spool.path)
        self._spools.clear()


def _append(path: Path, payload: bytes | bytearray | memoryview, first: bool) -> None:
    with open(path, "wb" if first else "ab") as f:
        f.write(payload)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
