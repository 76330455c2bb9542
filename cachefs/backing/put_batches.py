"""Shard puts to one datanode coalesced into ``put_many`` calls while one is in flight.

Why: a small file's close stores one shard on each datanode of its
placement group, and each put costs the datanode (and the writer) about a
millisecond of Python CPU for the call itself (frame, MAC, dispatch, worker
thread hop, reply) against ~0.1 ms for the bytes. With several files
closing at once (a data loader's output, ``cachefs import --jobs N``,
dbench) every datanode gets several small puts at the same moment, and on
a CPU-bound node those per-call costs are the write path's ceiling.

How (Nagle without the timer): a put to a node that has none in flight is
sent at once, as a plain ``put``; puts that arrive while one is in flight
queue, and go together in one ``put_many`` as soon as it returns. An idle
node therefore sees no added latency, and a busy one sees one call per
round trip instead of one per shard. Only small shards are coalesced (a
large one would be copied into the joined payload for little gain).

The sender of a queue is a trio system task, not one of the writers: a
writer whose put is cancelled (``put_block``'s stragglers, past their
grace) stops waiting, and the shards of the other writers in the same call
are unaffected. Each shard gets its own outcome: ``put_many`` answers one
result per shard, so one bad shard fails alone.

The wire shape (``put_many``, served by the datanode): ``volume``, and
``shards``: ``[key, index, meta, size]`` per shard, their bytes joined in
that order as the payload. :func:`parse` checks it on the datanode.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from cachefs.errors import CacheFSError, InvalidArgument, IOFailure, NoSuchMethod, error_from_wire

log = logging.getLogger(__name__)

MAX_SHARDS = 64  # per put_many call
MAX_BYTES = 4 << 20  # of joined shard bytes per call
SMALL_SHARD = 256 << 10  # larger shards are always sent alone


def parse(shards: list[Any], payload: Any) -> list[tuple[bytes, int, bytes, memoryview]]:
    """The shards of a ``put_many`` call: ``(key, index, meta, bytes)`` each
    (what the store checks itself, a bad key or meta, fails that shard alone).

    Raises:
        InvalidArgument: the call's shape is wrong, naming what and where.
    """
    data = memoryview(payload if payload is not None else b"")
    if not shards:
        raise InvalidArgument("put_many: no shards")
    if len(shards) > MAX_SHARDS:
        raise InvalidArgument(f"put_many: {len(shards)} shards, at most {MAX_SHARDS} per call")
    out = []
    at = 0
    for n, entry in enumerate(shards):
        if not isinstance(entry, list | tuple) or len(entry) != 4:
            raise InvalidArgument(f"put_many: shard {n} is not [key, index, meta, size]")
        key, index, meta, size = entry
        if not isinstance(key, bytes) or not isinstance(meta, bytes):
            raise InvalidArgument(f"put_many: shard {n}: key and meta must be bytes")
        if type(index) is not int or type(size) is not int or index < 0 or size < 0:
            raise InvalidArgument(f"put_many: shard {n}: index and size must be non-negative integers")
        if at + size > len(data):
            raise InvalidArgument(f"put_many: shard {n} ends at byte {at + size} of a {len(data)}-byte payload")
        out.append((key, index, meta, data[at : at + size]))
        at += size
    if at != len(data):
        raise InvalidArgument(f"put_many: the shards take {at} bytes of a {len(data)}-byte payload")
    return out


def outcome(error: CacheFSError | None) -> list[str] | None:
    """One shard's result on the wire: None when stored, else ``[code, message]``."""
    return None if error is None else [error.code, error.message]


@dataclass(eq=False)
class _Put:
    key: bytes
    index: int
    meta: bytes
    data: bytes | bytearray | memoryview
    timeout: float
    done: trio.Event = field(default_factory=trio.Event)
    error: CacheFSError | None = None

    def finish(self, error: CacheFSError | None) -> None:
        self.error = error
        self.done.set()


@dataclass(eq=False)
class _Queue:
    puts: collections.deque[_Put] = field(default_factory=collections.deque)
    sending: bool = False


Call = Callable[..., Awaitable[Any]]  # RpcPool.call(addr, method, args, *, payload, timeout)


class PutCoalescer:
    """Per (datanode, volume): one call in flight, the puts that arrive meanwhile queued for the next."""

    def __init__(self, call: Call) -> None:
        self._call = call
        self._queues: dict[tuple[str, str], _Queue] = {}
        self._plain_only: set[str] = set()  # datanodes without put_many (older versions)
        self.stats: collections.Counter[str] = collections.Counter()

    async def put(self, addr: str, volume: str, key: bytes, index: int, meta: bytes,
                  data: bytes | bytearray | memoryview, *, timeout: float) -> None:
        """Store one shard on ``addr``; returns once that datanode has it durably.

        Raises:
            CacheFSError: this shard's failure (or the call's, for all of its shards).
        """
        if len(data) > SMALL_SHARD:
            await self._plain(addr, volume, _Put(key, index, meta, data, timeout))
            return
        queue = self._queues.setdefault((addr, volume), _Queue())
        put = _Put(key, index, meta, data, timeout)
        queue.puts.append(put)
        if not queue.sending:
            queue.sending = True
            trio.lowlevel.spawn_system_task(self._send, addr, volume, queue, name=f"puts to {addr}")
        await put.done.wait()
        if put.error is not None:
            raise put.error

    async def _plain(self, addr: str, volume: str, put: _Put) -> None:
        await self._call(addr, "put", {"volume": volume, "key": put.key, "index": put.index, "meta": put.meta},
                         payload=put.data, timeout=put.timeout)

    def _take(self, queue: _Queue) -> list[_Put]:
        batch = [queue.puts.popleft()]
        size = len(batch[0].data)
        while queue.puts and len(batch) < MAX_SHARDS and size + len(queue.puts[0].data) <= MAX_BYTES:
            put = queue.puts.popleft()
            batch.append(put)
            size += len(put.data)
        return batch

    async def _send(self, addr: str, volume: str, queue: _Queue) -> None:
        """Send what the queue holds, call after call, until it is empty.

        A system task: it must never raise (that would end the trio run),
        so every failure becomes the outcome of the shards it carried."""
        batch: list[_Put] = []
        try:
            while queue.puts:
                batch = self._take(queue)
                try:
                    await self._send_batch(addr, volume, batch)
                except CacheFSError as exc:
                    for put in batch:
                        put.finish(exc)
                batch = []
        except BaseException as exc:  # cancelled (the run is ending), or a bug
            error = IOFailure(f"puts to {addr} stopped: {exc!r}")
            if not isinstance(exc, trio.Cancelled):
                log.exception("puts to %s failed unexpectedly", addr)
            for put in [*batch, *queue.puts]:
                if not put.done.is_set():
                    put.finish(error)
            queue.puts.clear()
            if isinstance(exc, trio.Cancelled):
                raise
        finally:
            queue.sending = False
            if not queue.puts:
                self._queues.pop((addr, volume), None)

    async def _send_batch(self, addr: str, volume: str, batch: list[_Put]) -> None:
        if len(batch) == 1 or addr in self._plain_only:
            for put in batch:
                try:
                    await self._plain(addr, volume, put)
                except CacheFSError as exc:
                    put.finish(exc)
                else:
                    put.finish(None)
            self.stats["plain"] += len(batch)
            return
        try:
            reply = await self._call(
                addr, "put_many",
                {"volume": volume, "shards": [[p.key, p.index, p.meta, len(p.data)] for p in batch]},
                payload=b"".join(p.data for p in batch), timeout=max(p.timeout for p in batch))
        except NoSuchMethod:
            self._plain_only.add(addr)
            await self._send_batch(addr, volume, batch)
            return
        results = reply.result.get("results") if isinstance(reply.result, dict) else None
        if not isinstance(results, list) or len(results) != len(batch):
            raise IOFailure(f"put_many to {addr} answered {len(results or [])} results for {len(batch)} shards")
        for put, result in zip(batch, results, strict=True):
            if result is None:
                put.finish(None)
            elif isinstance(result, list) and len(result) == 2:
                put.finish(error_from_wire(str(result[0]), str(result[1])))
            else:
                put.finish(IOFailure(f"put_many to {addr} answered {result!r} for a shard"))
        self.stats["calls"] += 1
        self.stats["coalesced"] += len(batch)
