"""The datanode: an RPC service over a :class:`~cachefs.datanode.shardstore.ShardStore`.

A datanode knows nothing about blocks, policies or placement: it stores,
returns, lists and verifies shards named ``(volume, block key, shard index)``,
each with the small opaque ``meta`` (the block header) its writer gave it.
The backing-storage client (:mod:`cachefs.backing.client`) and repair
(:mod:`cachefs.backing.repair`) hold all the logic.

Store calls block on disk IO (and fsync), so they run in worker threads
behind a capacity limiter; the trio thread only parses and replies. The
exception is a ``get`` whose bytes are all in the page cache: it is read in
the connection's reader itself (``RWF_NOWAIT`` reads, see
:meth:`ShardStore.get`), since the hop to a worker thread and back costs
more than the read (measured: 1 MiB shard 127 us CPU inline against 334 us
with the hop, and 1.3 ms less wall time on a busy machine; 4 KiB 30 against
217 us). Only a read that would wait for the disk goes to a thread.

The daemon (:mod:`.daemon`) registers it in the metanodes' cluster map.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable
from typing import Any

import trio
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from cachefs.credentials import ADMINS, CLIENTS
from cachefs.datanode.shardstore import ShardStore
from cachefs.errors import InvalidArgument
from cachefs.ids import BlockKey
from cachefs.pagecache import NOWAIT_READS, WouldBlock
from cachefs.rpc import Reply, rpc_method

log = logging.getLogger(__name__)

IO_THREADS = 8
SCRUB_PAGE = 256

_CAPACITY = Gauge("cachefs_datanode_capacity_bytes", "Bytes this datanode may store")
_USED = Gauge("cachefs_datanode_used_bytes", "Bytes of shards stored")
_SHARDS = Gauge("cachefs_datanode_shards", "Shards stored")
_SHARD_IO = Histogram("cachefs_datanode_shard_io_seconds",
                      "Shard reads and writes (get: checksums verified; put: durable), I/O thread wait included",
                      ["op"], buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                       0.25, 0.5, 1, 2.5, 10))
_SHARD_GET, _SHARD_PUT = _SHARD_IO.labels("get"), _SHARD_IO.labels("put")
_SCRUBBED = Counter("cachefs_datanode_scrubbed_shards_total", "Shards verified end to end by scrub")
_SCRUBBED_BYTES = Counter("cachefs_datanode_scrubbed_bytes_total", "Bytes read by scrub")


class _CorruptShards:
    """``cachefs_datanode_corrupt_shards_found_total``: a counter of the store's own
    count (the store stays free of Prometheus; a Counter cannot follow a value)."""

    store: ShardStore | None = None

    def collect(self):  # type: ignore[no-untyped-def]
        found = CounterMetricFamily("cachefs_datanode_corrupt_shards_found",
                                    "Corrupt shards detected (and dropped) since start")
        found.add_metric([], self.store.corrupt_found if self.store else 0)
        yield found


_CORRUPT = _CorruptShards()
REGISTRY.register(_CORRUPT)


def _key_hex(key: bytes) -> str:
    try:
        return BlockKey.from_bytes(key).hex()
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


class DatanodeService:
    """The datanode's RPC methods (see docs/contracts.md, "Backing storage")."""

    def __init__(self, store: ShardStore, node_id: str, zone: str) -> None:
        self.store = store
        self.node_id = node_id
        self.zone = zone
        self._io = trio.CapacityLimiter(IO_THREADS)
        _CAPACITY.set_function(lambda: store.capacity)
        _USED.set_function(lambda: store.used)
        _SHARDS.set_function(lambda: store.shard_count)
        _CORRUPT.store = store

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._io)

    # Who may call what: clients read and write the shards of their own
    # volumes (the backing client runs in the mount); removing, listing and
    # scrubbing shards is for servers (GC on the leader) and admins (repair).
    @rpc_method(roles=CLIENTS)
    async def put(self, volume: str, key: bytes, index: int, meta: bytes = b"",
                  payload: Any = None) -> dict:
        """Store shard ``index`` of ``key`` durably (replacing any older copy)."""
        data = payload if payload is not None else b""
        with _SHARD_PUT.time():
            await self._run(self.store.put, volume, _key_hex(key), index, meta, data)
        return {"size": len(data)}

    @rpc_method(roles=CLIENTS)
    def get(self, volume: str, key: bytes, index: int, offset: int = 0,
            length: int = -1) -> Reply | Awaitable[Reply]:
        """Bytes of one shard (checksums verified); ``meta`` and total size ride along.

        A plain method: bytes in the page cache are answered at once (see
        the module docstring), anything else is the awaitable of a read in a
        worker thread.
        """
        hex_key = _key_hex(key)
        if NOWAIT_READS:
            started = time.perf_counter()
            try:
                meta, data, total = self.store.get(volume, hex_key, index, offset, length, nowait=True)
            except WouldBlock:
                pass
            else:
                _SHARD_GET.observe(time.perf_counter() - started)
                return Reply({"meta": meta, "size": total}, payload=data)
        return self._get(volume, hex_key, index, offset, length)

    async def _get(self, volume: str, hex_key: str, index: int, offset: int, length: int) -> Reply:
        with _SHARD_GET.time():
            meta, data, total = await self._run(self.store.get, volume, hex_key, index, offset, length)
        return Reply({"meta": meta, "size": total}, payload=data)

    @rpc_method(roles=CLIENTS)
    async def stat(self, volume: str, key: bytes, index: int) -> dict:
        meta, size = await self._run(self.store.stat, volume, _key_hex(key), index)
        return {"meta": meta, "size": size}

    @rpc_method(roles=ADMINS)
    async def delete(self, volume: str, key: bytes, index: int = -1) -> dict:
        """Delete one shard, or every shard of the key held here (index -1)."""
        return {"removed": await self._run(self.store.delete, volume, _key_hex(key), index)}

    @rpc_method(name="list", roles=ADMINS)
    async def list_shards(self, volume: str, cursor: str = "", limit: int = 1000) -> dict:
        """A page of ``[key, index, bytes]``; page on with the returned cursor until it is ""."""
        limit = min(max(1, limit), 10_000)
        page, cursor = await self._run(self.store.list, volume, cursor, limit)
        return {"shards": [[BlockKey.from_hex(s.key).to_bytes(), s.index, s.size] for s in page],
                "cursor": cursor}

    @rpc_method(roles=ADMINS)
    async def scrub(self, volume: str, cursor: str = "", limit: int = SCRUB_PAGE,
                    max_bytes: int = 0) -> dict:
        """Verify a page of shards end to end; corrupt ones are removed and named.

        ``max_bytes`` (0: no cap) ends the page early once that many bytes
        were read (one shard at least), so a rate-limited scrub reads in
        small steps instead of bursts of ``limit`` shards; ``bytes`` in the
        answer is what was read, for the caller's throttle.
        """
        limit = min(max(1, limit), 10_000)
        page, cursor = await self._run(self.store.list, volume, cursor, limit)
        corrupt = []
        checked = read = 0
        for info in page:
            if not await self._run(self.store.verify, volume, info.key, info.index):
                corrupt.append([BlockKey.from_hex(info.key).to_bytes(), info.index])
            checked += 1
            read += info.size
            _SCRUBBED.inc()
            _SCRUBBED_BYTES.inc(info.size)
            if 0 < max_bytes <= read and checked < len(page):
                cursor = self.store.cursor_after(info)
                break
        return {"checked": checked, "corrupt": corrupt, "cursor": cursor, "bytes": read}

    @rpc_method(roles=ADMINS)
    async def volumes(self) -> list:
        return await self._run(self.store.volumes)

    @rpc_method(roles=ADMINS)
    async def stats(self) -> dict:
        return {"id": self.node_id, "zone": self.zone, **self.store.usage(),
                "corrupt_found": self.store.corrupt_found}
