"""The cache node's RPC service: get (with read-through), put, prefetch, stats.

Theory of operation
-------------------

A ``get`` first looks in the :class:`~cachefs.blockstore.BlockStore`
(memory tier, then flash). On a miss it joins the *fill* of that block: one
background task per missing key (a :mod:`~cachefs.singleflight`), so a hundred
readers of one cold block cost one backing fetch. Fills run in the service's own nursery, not
in the request's task, so a reader that gives up (deadline, disconnect) never
cancels the fetch the others wait for. A fill:

1. waits for a backing-fetch slot (``max_backing_fetches``, a
   ``trio.CapacityLimiter``), fetches the whole block, and wakes every waiter
   with the bytes in memory (they are served from that buffer, not re-read);
2. writes the block to flash in a worker thread, if the admission rule lets
   it in (warm-up and write-through bypass the rule);
3. only then leaves the table of fills, so a request arriving during the
   write joins the finished fill instead of fetching again.

The life of one block on a node::

    absent --miss--> fetching --bytes--> writing --stored--> cached
      ^                 |                   |                   |
      |     error: every waiter gets it     | refused by        | evicted, expired,
      |                 |                   | admission/space   | or corrupt on read
      +-----------------+-------------------+-------------------+

    fetching: readers join the fill and wait;  writing: readers are served from
    the fill's buffer (a hit);  cached: readers are served from the store.

Miss policies, per request: ``wait`` (above), ``fast-fail`` (CubeFS's
choice: start the fill, answer ``CacheMiss`` at once; the client reads backing
storage itself, so a cold cache never adds a round trip) and ``peek`` (answer
``CacheMiss``, fill nothing: what another zone's node asks, see below).

Other cache nodes (:mod:`.peers`, with ``peers``): after a ring change in
this node's zone, a fill first asks the key's owner before the change and
keeps what it holds (the block moved here); then it asks the key's
owner in the next zone (``peek``) and serves what it holds without storing it
here; a fill that would evict here goes to that owner instead while it has
room. The zones' capacities so add up to the tier's.

Load limits: at most ``max_requests`` gets and puts in flight on the node and
``max_per_client`` per connection (fairness: one greedy client cannot take
every slot); over either, the answer is ``Busy`` at once and the client tries
its next candidate. Background fills started by ``fast-fail`` are bounded by
``max_background_fills``.

``get_many`` (a client's directory readahead: the next small files of a
listed directory, one call per owning node) serves up to ``MAX_GET_MANY``
whole blocks from the store in one reply and marks the rest as misses,
never reading through: a batch costs no backing fetch and joins no fill, and
the client reads its misses with ``get`` as before. One warm epoch of small
files so costs a round trip per batch instead of per file.

Prefetch (the warm-up path) queues keys for workers that fill them, bypassing
admission. ``prefetch(..., wait=True)`` answers when its own batch is done,
with per-batch counts, which is what ``cachefs warmup`` uses for its progress.

Where the work runs: lookups and memory-tier hits run inline; flash reads of
up to ``inline_read_max`` bytes run inline too when the page cache holds them
(``RWF_NOWAIT``: a page-cache pread of a 128 KiB range costs less than a
thread hop; one from the disk would stall every connection), larger reads and every write run
in worker threads so one 4 MiB copy never stalls the other connections. A
``get`` that hits inline is answered by the connection's reader itself
(``get`` is a plain method): no task, no cancel scope, no request slot.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from cachefs.blockstore import BlockStore
from cachefs.buffers import BufferPool
from cachefs.credentials import ADMINS, CLIENTS
from cachefs.errors import (
    Busy,
    CacheFSError,
    CacheMiss,
    Corrupt,
    InvalidArgument,
    IOFailure,
    NoSpace,
    TimedOut,
)
from cachefs.ids import BlockKey
from cachefs.messages import GET_MANY_BYTES, MANY_MISS, MANY_NOT_SERVED, BlockBatch
from cachefs.pagecache import WouldBlock
from cachefs.rpc import CallContext, Reply, rpc_method
from cachefs.singleflight import Flight, SingleFlight

from .admission import SecondMissAdmission
from .peers import PeerZones

log = logging.getLogger(__name__)

POLICIES = ("wait", "fast-fail", "peek")
MAX_HOLDS = 10_000  # keys per holds or evict call
MAX_ADDR = 300  # bytes of a prefetch source address
MAX_GET_MANY = 64  # keys per get_many call
HEADER_ROOM = 64 * 1024  # a block file's header and more: the store's per-segment sums

HITS = Counter("cachefs_cache_hits_total", "Cache gets served from the cache", ["node"])
MISSES = Counter("cachefs_cache_misses_total", "Cache gets that missed", ["node"])
BYTES_IN = Counter(
    "cachefs_cache_filled_bytes_total", "Bytes filled from backing storage or written through", ["node"]
)
BYTES_OUT = Counter("cachefs_cache_served_bytes_total", "Bytes served to clients", ["node"])
USED = Gauge("cachefs_cache_used_bytes", "Bytes of blocks in the cache store", ["node"])
CAPACITY = Gauge("cachefs_cache_capacity_bytes", "Bytes the cache store may hold", ["node"])
MANY_CALLS = Counter("cachefs_cache_get_many_total", "get_many calls (batches of blocks)", ["node"])
MANY_BLOCKS = Counter("cachefs_cache_get_many_blocks_total", "Blocks served by get_many calls", ["node"])
BUSY = Counter("cachefs_cache_busy_total", "Requests refused over a load limit", ["node"])
BACKING_LATENCY = Histogram(
    "cachefs_cache_backing_fetch_seconds",
    "Latency of whole-block fetches from backing storage",
    ["node"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 30),
)
FILL_LATENCY = Histogram(
    "cachefs_cache_fill_seconds",
    "A miss's fill, from its start to the block on flash here or in the next zone (fetch + write)",
    ["node"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 30),
)


class _StoreCounters:
    """Evictions by cause and admission decisions of every cache service in
    this process, read from their own plain counters at scrape time (nothing
    on the read path, no delta bookkeeping)."""

    def __init__(self) -> None:
        self.services: weakref.WeakSet[CacheService] = weakref.WeakSet()

    def collect(self):  # type: ignore[no-untyped-def]
        evictions = CounterMetricFamily(
            "cachefs_cache_evictions",
            "Blocks dropped from the store, by cause (capacity: least recently used, to make room; "
            "expired: past the volume's TTL; corrupt: failed its checksum on read)",
            labels=["node", "cause"],
        )
        admission = CounterMetricFamily(
            "cachefs_cache_admissions",
            "Read-through fills by admission decision (refused: a first miss, see admission.py)",
            labels=["node", "decision"],
        )
        by_node: dict[str, list[int]] = {}  # one series per node name, as the labelled Counters
        for service in list(self.services):
            store, c = service.store.counters, service.counters
            sums = by_node.setdefault(service.node, [0] * 5)
            for i, value in enumerate((store.evictions, store.expired, store.corrupt, c.admitted, c.not_admitted)):
                sums[i] += value
        for node, (capacity, expired, corrupt, admitted, refused) in sorted(by_node.items()):
            evictions.add_metric([node, "capacity"], capacity)
            evictions.add_metric([node, "expired"], expired)
            evictions.add_metric([node, "corrupt"], corrupt)
            admission.add_metric([node, "admitted"], admitted)
            admission.add_metric([node, "refused"], refused)
        yield evictions
        yield admission


_COUNTERS = _StoreCounters()
REGISTRY.register(_COUNTERS)


Buffer = bytes | bytearray | memoryview
_CORRUPT = object()  # a block a worker thread found corrupt (``_read_blocks``)


class BlockSource(Protocol):
    """Where misses are read from: ``cachefs.backing.client.BackingClient`` in production."""

    async def get_block(self, volume: str, key: BlockKey) -> Buffer: ...


@dataclass(frozen=True, slots=True)
class CacheLimits:
    max_requests: int = 512
    max_per_client: int = 128
    max_backing_fetches: int = 16
    max_background_fills: int = 256
    prefetch_workers: int = 8
    max_prefetch_queue: int = 1 << 16
    backing_timeout: float = 30.0
    inline_read_max: int = 256 * 1024
    io_threads: int = 2

    def __post_init__(self) -> None:
        for name in (
            "max_requests",
            "max_per_client",
            "max_backing_fetches",
            "prefetch_workers",
            "io_threads",
        ):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"cache limit {name} must be at least 1")


@dataclass(slots=True)
class _Batch:
    """The keys of one ``prefetch`` call, for ``wait=True`` answers."""

    pending: int
    done: int = 0
    failed: int = 0
    bytes: int = 0
    finished: trio.Event = field(default_factory=trio.Event)

    def settle(self, ok: bool, nbytes: int = 0) -> None:
        if ok:
            self.done += 1
            self.bytes += nbytes
        else:
            self.failed += 1
        self.pending -= 1
        if self.pending == 0:
            self.finished.set()


@dataclass(slots=True)
class ServiceCounters:
    hits: int = 0
    misses: int = 0
    corrupt_refetched: int = 0
    backing_fetches: int = 0
    backing_errors: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    busy: int = 0
    admitted: int = 0  # fills the admission rule let in (or that bypass it)
    not_admitted: int = 0
    not_stored: int = 0
    puts: int = 0
    prefetch_done: int = 0
    prefetch_failed: int = 0
    prefetch_cached: int = 0
    peeks_missed: int = 0
    held_elsewhere: int = 0
    placed_elsewhere: int = 0
    get_many: int = 0  # get_many calls
    many_blocks: int = 0  # blocks they served


def _key(raw: bytes) -> BlockKey:
    try:
        return BlockKey.from_bytes(raw)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def _check_volume(volume: str) -> None:
    if not volume or len(volume) > 255:
        raise InvalidArgument(f"bad volume name {volume!r}")


class CacheService:
    """The cache node's RPC methods (see module docstring)."""

    def __init__(
        self,
        store: BlockStore,
        backing: BlockSource,
        *,
        nursery: trio.Nursery,
        limits: CacheLimits = CacheLimits(),
        admission: SecondMissAdmission | None = None,
        node: str = "cachenode",
        expire_interval: float = 60.0,
        peers: PeerZones | None = None,
        buffers: BufferPool | None = None,
    ) -> None:
        """``buffers``: the pool ``backing`` takes its fill buffers from; a
        finished fill's buffer is retired there (:mod:`cachefs.buffers`)."""
        self.store = store
        self.buffers = buffers
        self.backing = backing
        self.peers = peers
        self._held_elsewhere: set[BlockKey] = set()  # fills served by another zone's node
        self._handed_over: set[BlockKey] = set()  # fills served by the owner before a ring change
        self._keeping = 0  # bytes of fills on their way to flash (or to the next zone)
        self.limits = limits
        self.admission = admission
        self.node = node
        self.counters = ServiceCounters()
        self._nursery = nursery
        self._fills: SingleFlight[BlockKey, Buffer] = SingleFlight()
        self._backing_slots = trio.CapacityLimiter(limits.max_backing_fetches)
        self._io_threads = trio.CapacityLimiter(limits.io_threads)
        self._active = 0
        self._per_client: dict[str, int] = {}
        self._prefetch_send, prefetch_recv = trio.open_memory_channel[
            tuple[str, BlockKey, _Batch | None, str | None]
        ](limits.max_prefetch_queue)
        self._prefetch_queued = 0
        m = {"node": node}
        self._m_hits, self._m_misses = HITS.labels(**m), MISSES.labels(**m)
        self._m_busy = BUSY.labels(**m)
        self._m_many, self._m_many_blocks = MANY_CALLS.labels(**m), MANY_BLOCKS.labels(**m)
        self._m_in, self._m_out = BYTES_IN.labels(**m), BYTES_OUT.labels(**m)
        self._m_backing = BACKING_LATENCY.labels(**m)
        self._m_fill = FILL_LATENCY.labels(**m)
        _COUNTERS.services.add(self)
        USED.labels(**m).set_function(lambda: store.used)
        CAPACITY.labels(**m).set_function(lambda: store.capacity)
        for _ in range(limits.prefetch_workers):
            nursery.start_soon(self._prefetch_worker, prefetch_recv.clone())
        prefetch_recv.close()
        if store.ttl:
            nursery.start_soon(self._expire_loop, expire_interval)

    # -- limits ---------------------------------------------------------------

    @contextmanager
    def _slot(self, ctx: CallContext | None) -> Iterator[None]:
        client = ctx.peer if ctx is not None else "local"
        mine = self._per_client.get(client, 0)
        if self._active >= self.limits.max_requests or mine >= self.limits.max_per_client:
            self.counters.busy += 1
            self._m_busy.inc()
            which = "node" if self._active >= self.limits.max_requests else "client"
            raise Busy(f"{self.node}: over the {which} request limit")
        self._active += 1
        self._per_client[client] = mine + 1
        try:
            yield
        finally:
            self._active -= 1
            left = self._per_client[client] - 1
            if left:
                self._per_client[client] = left
            else:
                del self._per_client[client]

    # -- reads ------------------------------------------------------------------

    def _may_read_inline(self, key: BlockKey, span: int) -> bool:
        """Whether a read of ``span`` bytes of ``key`` may try the event loop
        first (a memory-tier block, or a range small enough to copy from
        the page cache inline; see the module docstring)."""
        return span <= self.limits.inline_read_max or self.store.in_memory(key)

    async def _read_cached(
        self, key: BlockKey, offset: int, length: int, *, inline: bool = True
    ) -> tuple[memoryview, int] | None:
        """``inline=False``: the caller's inline try found the bytes on the
        disk already; read them in a thread without asking the page cache again."""
        entry = self.store.lookup(key)
        if entry is None:
            return None
        span = entry.size - offset if length == -1 else min(length, max(entry.size - offset, 0))
        in_thread = functools.partial(
            trio.to_thread.run_sync, self.store.read, key, offset, length, limiter=self._io_threads
        )
        try:
            if inline and self._may_read_inline(key, span):
                try:
                    data = self.store.read(key, offset, length, nowait=True)
                except WouldBlock:  # on the disk: not on the event loop
                    data = await in_thread()
            else:
                data = await in_thread()
        except Corrupt:
            self.counters.corrupt_refetched += 1
            return None
        return None if data is None else (data, entry.size)

    async def read(
        self, volume: str, key: BlockKey, offset: int = 0, length: int = -1, policy: str = "wait",
        *, inline: bool = True,
    ) -> tuple[memoryview, int, bool]:
        """Bytes of a block, its size and whether it was a hit (no limits; for in-process use).

        ``inline=False``: the caller tried the store inline already (``get``).

        Raises:
            CacheMiss: under ``fast-fail`` when the block is not cached.
            InvalidArgument: a bad range or policy.
            NotFound, Unavailable, Corrupt, TimedOut: from backing storage.
        """
        if policy not in POLICIES:
            raise InvalidArgument(f"miss policy must be one of {POLICIES}, got {policy!r}")
        if offset < 0 or length < -1:
            raise InvalidArgument(f"bad range: offset={offset} length={length}")
        cached = await self._read_cached(key, offset, length, inline=inline)
        if cached is None and key not in self._fills and self.store.lookup(key) is not None:
            # Dropped under this read (found short here, or unlinked by a
            # reader that found it short) and filled again before it resumed:
            # read that copy, not the backing store once more.
            cached = await self._read_cached(key, offset, length)
        if cached is not None:
            data, size = cached
            self.counters.hits += 1
            self.counters.bytes_out += len(data)
            self._m_hits.inc()
            self._m_out.inc(len(data))
            return data, size, True
        fill = self._fills.get(key)
        if fill is not None and fill.ready:  # fetched, still being written to flash
            view, size = self._slice(fill.value, offset, length)
            self.counters.hits += 1
            self._m_hits.inc()
            return view, size, True
        if policy == "peek":
            self.counters.peeks_missed += 1
            raise CacheMiss(f"{key.hex()} is not cached on {self.node}")
        self.counters.misses += 1
        self._m_misses.inc()
        if policy == "fast-fail":
            if key not in self._fills and len(self._fills) < self.limits.max_background_fills:
                self._start_fill(volume, key, bypass_admission=False)
            raise CacheMiss(f"{key.hex()} is not cached on {self.node}; filling")
        fill = self._start_fill(volume, key, bypass_admission=False)
        view, size = self._slice(await fill.wait(), offset, length)
        return view, size, False

    def _slice(self, block: Buffer, offset: int, length: int) -> tuple[memoryview, int]:
        size = len(block)
        if offset > size:
            raise InvalidArgument(f"offset {offset} is past the end of the block ({size})")
        end = size if length == -1 else min(size, offset + length)
        view = memoryview(block)[offset:end]
        self.counters.bytes_out += len(view)
        self._m_out.inc(len(view))
        return view, size

    async def read_range(
        self, volume: str, key: BlockKey, offset: int, length: int, policy: str
    ) -> memoryview:
        """The bytes alone, under the node's request limit: what the RDMA responder serves."""
        _check_volume(volume)
        with self._slot(None):
            data, _size, _hit = await self.read(volume, key, offset, length, policy)
        return data

    # -- fills ------------------------------------------------------------------

    def _start_fill(self, volume: str, key: BlockKey, *, bypass_admission: bool,
                    source: str | None = None) -> Flight[Buffer]:  # fmt: skip
        """The fill of ``key``: the one under way, else a new one (single flight)."""
        return self._fills.start(
            key,
            functools.partial(self._fetch, volume, key, source),
            nursery=self._nursery,
            then=functools.partial(self._keep, volume, key, bypass_admission, time.perf_counter()),
        )

    async def _fetch(self, volume: str, key: BlockKey, source: str | None = None) -> Buffer:
        """A fill's fetch (from ``source``, a warm-up's copy, or the next zone's
        node, else backing storage); its waiters are served from the bytes it returns."""
        if self.peers is not None:
            held = None
            if source is not None:
                held = await self.peers.get_from(source, volume, key)
            if held is None:
                held = await self.peers.get_previous(volume, key)
                if held is not None:  # the block's owner before a ring change: it moves here
                    self._handed_over.add(key)
                    return held
                held = await self.peers.get(volume, key)
            if held is not None:
                self._held_elsewhere.add(key)
                return held
        try:
            async with self._backing_slots:
                started = time.perf_counter()
                try:
                    with trio.fail_after(self.limits.backing_timeout):
                        data = await self.backing.get_block(volume, key)
                except trio.TooSlowError:
                    raise TimedOut(
                        f"backing fetch of {key.hex()} passed {self.limits.backing_timeout}s"
                    ) from None
                finally:
                    self._m_backing.observe(time.perf_counter() - started)
            self.counters.backing_fetches += 1
            self.counters.bytes_in += len(data)
            self._m_in.inc(len(data))
            return data
        except CacheFSError as exc:
            self.counters.backing_errors += 1
            if not exc.remote:
                log.info("%s: fill of %s failed: %s", self.node, key.hex(), exc)
            raise
        except Exception:  # a bug must fail this block's readers, not the node
            self.counters.backing_errors += 1
            log.exception("%s: fill of %s failed unexpectedly", self.node, key.hex())
            raise IOFailure(f"internal error filling {key.hex()}") from None

    async def _keep(
        self, volume: str, key: BlockKey, bypass_admission: bool, started: float, data: Buffer
    ) -> None:
        """A fill's second step: the block goes to flash if the admission rule
        lets it in, and here only if it came from backing storage and fits
        without evicting, or the next zone has no room for it. ``started``:
        when the fill began (its fetch included, for the fill latency)."""
        handed_over = key in self._handed_over  # admitted by its previous owner already
        self._handed_over.discard(key)
        try:
            if key in self._held_elsewhere:
                self._held_elsewhere.discard(key)
                self.counters.held_elsewhere += 1
            elif bypass_admission or handed_over or self.admission is None or self.admission.admit(key):
                self.counters.admitted += 1
                need = len(data) + HEADER_ROOM
                # Fills being written count too: they have not reserved their room yet.
                full = self.store.used + self._keeping + need > self.store.capacity
                self._keeping += need
                try:
                    if full and self.peers is not None and await self.peers.place(volume, key, data):
                        self.counters.placed_elsewhere += 1
                        self._m_fill.observe(time.perf_counter() - started)
                    elif await self._store(volume, key, data):
                        self._m_fill.observe(time.perf_counter() - started)
                finally:
                    self._keeping -= need
            else:
                self.counters.not_admitted += 1
        except CacheFSError as exc:  # the readers have their bytes already
            self.counters.backing_errors += 1
            log.info("%s: block %s not cached: %s", self.node, key.hex(), exc)
        except Exception:  # a bug must not end the node
            self.counters.backing_errors += 1
            log.exception("%s: storing %s failed unexpectedly", self.node, key.hex())
        finally:
            if self.buffers is not None:  # reused once its readers' views and the flight are gone
                self.buffers.retire(data)

    async def _store(self, volume: str, key: BlockKey, data: Buffer) -> bool:
        try:
            stored = await trio.to_thread.run_sync(
                self.store.put, volume, key, data, limiter=self._io_threads
            )
        except (NoSpace, IOFailure) as exc:
            self.counters.not_stored += 1
            log.warning("%s: block %s not cached: %s", self.node, key.hex(), exc.message)
            return False
        return stored

    # -- prefetch -----------------------------------------------------------------

    async def _prefetch_worker(
        self, recv: trio.MemoryReceiveChannel[tuple[str, BlockKey, _Batch | None, str | None]]
    ) -> None:
        async with recv:
            async for volume, key, batch, source in recv:
                ok, nbytes = False, 0
                try:
                    entry = self.store.lookup(key)
                    if entry is not None:
                        ok, nbytes = True, entry.size
                    else:
                        fill = self._start_fill(volume, key, bypass_admission=True, source=source)
                        data = await fill.wait()
                        nbytes = len(data)
                        await fill.finished.wait()
                        # A get's fill may have been refused by the admission rule.
                        ok = key in self.store or await self._store(volume, key, data)
                except CacheFSError as exc:
                    log.info("%s: prefetch of %s failed: %s", self.node, key.hex(), exc)
                except Exception:  # keep the worker alive: one bad block is one failure
                    log.exception("%s: prefetch of %s failed unexpectedly", self.node, key.hex())
                finally:
                    self._prefetch_queued -= 1
                    if ok:
                        self.counters.prefetch_done += 1
                    else:
                        self.counters.prefetch_failed += 1
                    if batch is not None:
                        batch.settle(ok, nbytes)

    async def prefetch_keys(
        self, volume: str, keys: list[BlockKey], *, wait: bool = False, source: str | None = None,
        pin_until: float = 0.0,
    ) -> dict[str, int]:
        """Queue keys for read-through; see :meth:`prefetch`."""
        _check_volume(volume)
        if source is not None and (not isinstance(source, str) or len(source) > MAX_ADDR):
            raise InvalidArgument(f"a prefetch source is a cache node address (host:port), not {source!r:.80}")
        if not isinstance(pin_until, int | float) or pin_until < 0:
            raise InvalidArgument(f"pin_until must be a time in seconds, got {pin_until!r}")
        if pin_until > time.time():  # before the fetches: a block is pinned as it lands
            await trio.to_thread.run_sync(self.store.pin, keys, float(pin_until), limiter=self._io_threads)
        cached = 0
        todo = []
        for key in keys:
            if self.store.lookup(key) is not None:
                cached += 1
            else:
                todo.append(key)
        if self._prefetch_queued + len(todo) > self.limits.max_prefetch_queue:
            self.counters.busy += 1
            self._m_busy.inc()
            raise Busy(f"{self.node}: the prefetch queue is full")
        self.counters.prefetch_cached += cached
        batch = _Batch(len(todo)) if wait and todo else None
        for key in todo:
            self._prefetch_send.send_nowait((volume, key, batch, source))  # room checked above
            self._prefetch_queued += 1
        answer = {"queued": len(todo), "cached": cached}
        if batch is not None:
            await batch.finished.wait()
            answer.update(done=batch.done, failed=batch.failed, bytes=batch.bytes)
        elif wait:
            answer.update(done=0, failed=0, bytes=0)
        return answer

    async def _expire_loop(self, interval: float) -> None:
        while True:
            await trio.sleep(interval)
            await trio.to_thread.run_sync(self.store.expire, limiter=self._io_threads)

    # -- RPC methods -----------------------------------------------------------------
    # Clients get, put and prefetch the blocks of their own volumes (the RPC
    # layer checks the volume argument against the credential); the node's
    # stats are for servers and admins.

    @rpc_method(roles=CLIENTS)
    def get(
        self,
        volume: str,
        key: bytes,
        offset: int = 0,
        length: int = -1,
        policy: str = "wait",
        ctx: CallContext | None = None,
    ) -> Reply | Awaitable[Reply]:
        """Bytes ``[offset, offset+length)`` of a block, reading through on a miss.

        A plain method: a hit that is served inline (see the module
        docstring) is answered at once by the connection's reader, with no
        task and no cancel scope (they cost more than the hit); anything
        else returns the awaitable that the RPC layer runs under the deadline.

        Raises:
            CacheMiss: under ``fast-fail`` when the block is not cached.
            Busy: over a load limit.
        """
        _check_volume(volume)
        block_key = _key(key)
        if offset < 0 or length < -1:
            raise InvalidArgument(f"bad range: offset={offset} length={length}")
        if policy not in POLICIES:
            raise InvalidArgument(f"miss policy must be one of {POLICIES}, got {policy!r}")
        hit = self._inline_hit(block_key, offset, length)
        if hit is not None:
            return hit
        # Not served inline (not cached, too long, on the disk or corrupt): _get does not try again.
        return self._get(volume, block_key, offset, length, policy, ctx)

    def _inline_hit(self, key: BlockKey, offset: int, length: int) -> Reply | None:
        entry = self.store.lookup(key)
        if entry is None:
            return None
        span = entry.size - offset if length == -1 else min(length, max(entry.size - offset, 0))
        if not self._may_read_inline(key, span):
            return None
        try:
            data = self.store.read(key, offset, length, nowait=True)
        except WouldBlock:  # on the disk: the request's task reads it in a thread
            return None
        except Corrupt:
            self.counters.corrupt_refetched += 1
            return None
        if data is None:
            return None
        self.counters.hits += 1
        self.counters.bytes_out += len(data)
        self._m_hits.inc()
        self._m_out.inc(len(data))
        return Reply({"size": entry.size, "hit": True}, payload=data)

    async def _get(
        self,
        volume: str,
        key: BlockKey,
        offset: int,
        length: int,
        policy: str,
        ctx: CallContext | None,
    ) -> Reply:
        with self._slot(ctx):
            data, size, hit = await self.read(volume, key, offset, length, policy, inline=False)
        return Reply({"size": size, "hit": hit}, payload=data)

    @rpc_method(roles=CLIENTS)
    async def get_many(self, volume: str, keys: list, ctx: CallContext | None = None) -> Reply:
        """Whole blocks of ``keys`` that this node holds, in one reply (a
        directory's small files, :mod:`cachefs.client.dirahead`).

        Served from the store only: a miss is answered as one
        (:data:`~cachefs.messages.MANY_MISS`) and never read through, so a
        batch costs no backing fetch and holds no request slot; the client
        reads the misses through the single-block ``get`` (single flight and
        read-through stay there). Blocks are added in order while they fit
        in :data:`~cachefs.messages.GET_MANY_BYTES` (well under the wire's frame and outbox
        limits); the rest are answered :data:`~cachefs.messages.MANY_NOT_SERVED`
        for the client to ask again. A memory-tier or page-cache hit is read
        inline; the blocks on the disk are read together in at most
        ``io_threads`` worker-thread jobs (``_read_from_disk``), not a thread
        hop each; checksums are verified by the store on every read, and a
        corrupt block is a miss.

        The reply: :class:`~cachefs.messages.BlockBatch` (a size or marker
        per key) and the served blocks joined, in key order, as the payload.

        Raises:
            InvalidArgument: a bad volume name, ``keys`` not a list of at
                most :data:`MAX_GET_MANY` block keys (bytes), a malformed key.
            Busy: over a load limit (it takes one request slot, as ``get``).
        """
        _check_volume(volume)
        if not isinstance(keys, list) or not all(isinstance(k, bytes) for k in keys):
            raise InvalidArgument(f"get_many takes a list of at most {MAX_GET_MANY} block keys (bytes)")
        if len(keys) > MAX_GET_MANY:
            raise InvalidArgument(f"get_many takes at most {MAX_GET_MANY} block keys, got {len(keys)}")
        wanted = [_key(k) for k in keys]
        self.counters.get_many += 1
        self._m_many.inc()
        with self._slot(ctx):
            return await self._get_many(wanted)

    async def _get_many(self, keys: list[BlockKey]) -> Reply:
        sizes: list[int] = []
        found: list[tuple[int, BlockKey, Buffer | None]] = []  # (index in sizes, key, bytes or None: on the disk)
        total = 0
        for i, key in enumerate(keys):
            entry = self.store.lookup(key)
            if entry is None:
                sizes.append(MANY_MISS)
                continue
            if total + entry.size > GET_MANY_BYTES:
                sizes.extend([MANY_NOT_SERVED] * (len(keys) - i))
                break
            try:
                data = self.store.read(key, nowait=True) if self._may_read_inline(key, entry.size) else None
            except WouldBlock:
                data = None
            except Corrupt:  # dropped by the store
                self.counters.corrupt_refetched += 1
                sizes.append(MANY_MISS)
                continue
            found.append((len(sizes), key, data))
            sizes.append(entry.size)
            total += entry.size
        on_disk = [key for _, key, data in found if data is None]
        read = iter(await self._read_from_disk(on_disk) if on_disk else ())
        parts: list[Buffer] = []
        for i, _, data in found:
            if data is None:
                data = next(read)
            if data is None or len(data) != sizes[i]:
                sizes[i] = MANY_MISS  # dropped meanwhile, or corrupt on the disk
            else:
                parts.append(data)
        total = sum(len(data) for data in parts)
        served = len(parts)
        self.counters.hits += served
        self.counters.misses += sizes.count(MANY_MISS)
        self.counters.bytes_out += total
        self.counters.many_blocks += served
        self._m_hits.inc(served)
        self._m_misses.inc(sizes.count(MANY_MISS))
        self._m_out.inc(total)
        self._m_many_blocks.inc(served)
        payload = b"".join(parts) if parts else None
        return Reply(BlockBatch(tuple(sizes)), payload=payload)

    async def _read_from_disk(self, keys: list[BlockKey]) -> list[Buffer | None]:
        """Whole blocks that the page cache did not hold, read in worker
        threads: the keys split over at most ``io_threads`` jobs, so a batch
        costs that many thread hops instead of one per block, and its disk
        reads still overlap. None for a block dropped meanwhile or found
        corrupt (counted; the store dropped it).

        Raises:
            IOFailure: a read failed (as a block read inline would, so the
                whole batch fails the same way and not as a nursery's group).
        """
        jobs = min(self.limits.io_threads, len(keys))
        shares = [keys[j::jobs] for j in range(jobs)]
        results: list[list[Buffer | None]] = [[] for _ in shares]
        failures: list[CacheFSError] = []

        async def job(j: int) -> None:
            try:
                results[j] = await trio.to_thread.run_sync(self._read_blocks, shares[j], limiter=self._io_threads)
            except CacheFSError as exc:
                failures.append(exc)

        async with trio.open_nursery() as nursery:
            for j in range(jobs):
                nursery.start_soon(job, j)
        if failures:
            raise failures[0]
        self.counters.corrupt_refetched += sum(data is _CORRUPT for share in results for data in share)
        out: list[Buffer | None] = [None] * len(keys)
        for j, share in enumerate(results):
            out[j::jobs] = [None if data is _CORRUPT else data for data in share]
        return out

    def _read_blocks(self, keys: list[BlockKey]) -> list[Any]:
        """(In a worker thread) each block of ``keys`` from the store: its
        bytes, None if it was dropped, or ``_CORRUPT``."""
        out: list[Any] = []
        for key in keys:
            try:
                out.append(self.store.read(key))
            except Corrupt:
                out.append(_CORRUPT)
        return out

    @rpc_method(roles=CLIENTS)
    async def put(
        self, volume: str, key: bytes, *, payload: Any = None, ctx: CallContext | None = None
    ) -> dict[str, Any]:
        """Write-through: cache a block a client just stored (bypasses admission)."""
        _check_volume(volume)
        block_key = _key(key)
        if payload is None:
            raise InvalidArgument("put needs the block as its payload")
        with self._slot(ctx):
            self.counters.puts += 1
            self.counters.bytes_in += len(payload)
            self._m_in.inc(len(payload))
            stored = await self._store(volume, block_key, payload)
        return {"stored": stored}

    @rpc_method(roles=CLIENTS)
    async def prefetch(self, volume: str, keys: list, wait: bool = False, source: str | None = None,
                       pin_until: float = 0.0) -> dict[str, int]:  # fmt: skip
        """Queue blocks for read-through (warm-up); ``wait`` answers when they are
        done; ``source``: the cache node to copy them from first (``peers.py``);
        ``pin_until`` (wall clock, seconds) keeps them from eviction until then."""
        return await self.prefetch_keys(volume, [_key(k) for k in keys], wait=wait, source=source,
                                        pin_until=pin_until)  # fmt: skip

    @rpc_method(roles=CLIENTS)
    def holds(self, volume: str, keys: list) -> list[bool]:
        """Which of ``keys`` are on this node's flash now: no read-through, no
        LRU touch, no hit counted (``cachefs info``; a client could learn as
        much from a ``fast-fail`` get of its own volume's blocks)."""
        _check_volume(volume)
        if not isinstance(keys, list) or len(keys) > MAX_HOLDS or not all(isinstance(k, bytes) for k in keys):
            raise InvalidArgument(f"holds takes a list of at most {MAX_HOLDS} block keys (bytes)")
        return [self.store.lookup(_key(k)) is not None for k in keys]

    @rpc_method(roles=CLIENTS)
    async def evict(self, volume: str, keys: list) -> dict[str, int]:
        """Drop ``keys`` from this node's flash (``cachefs warmup --evict``): a
        client may make its own volume's blocks cold, which costs it reads only
        (blocks are immutable: nothing can go stale or be lost)."""
        _check_volume(volume)
        if not isinstance(keys, list) or len(keys) > MAX_HOLDS or not all(isinstance(k, bytes) for k in keys):
            raise InvalidArgument(f"evict takes a list of at most {MAX_HOLDS} block keys (bytes)")
        wanted = [_key(k) for k in keys]
        evicted = await trio.to_thread.run_sync(lambda: sum(self.store.discard(k) for k in wanted),
                                                limiter=self._io_threads)  # fmt: skip
        return {"evicted": evicted}

    @rpc_method(roles=CLIENTS)
    async def prefetch_status(self) -> dict[str, int]:
        c = self.counters
        return {
            "done": c.prefetch_done,
            "failed": c.prefetch_failed,
            "queued": self._prefetch_queued,
            "cached": c.prefetch_cached,
        }

    @rpc_method(roles=ADMINS)
    async def stats(self) -> dict[str, Any]:
        c = self.counters
        total = c.hits + c.misses
        return {
            "node": self.node,
            **self.store.stats(),
            "hits": c.hits,
            "misses": c.misses,
            "hit_ratio": c.hits / total if total else 0.0,
            "corrupt_refetched": c.corrupt_refetched,
            "backing_fetches": c.backing_fetches,
            "backing_errors": c.backing_errors,
            "bytes_in": c.bytes_in,
            "bytes_out": c.bytes_out,
            "busy": c.busy,
            "not_admitted": c.not_admitted,
            "not_stored": c.not_stored,
            "puts": c.puts,
            "fills_in_flight": len(self._fills),
            "active_requests": self._active,
            "prefetch": await self.prefetch_status(),
            "peeks_missed": c.peeks_missed,
            "held_elsewhere": c.held_elsewhere,
            "placed_elsewhere": c.placed_elsewhere,
            "get_many": c.get_many,
            "get_many_blocks": c.many_blocks,
            **(self.buffers.stats if self.buffers is not None else {}),
            **(self.peers.stats if self.peers is not None else {}),
        }
