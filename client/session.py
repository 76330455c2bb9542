"""One mounted volume's connection to the cluster: its metanode session and the block chain.

The :class:`Session` is what the engine (:mod:`.volume`, :mod:`.reader`,
:mod:`.writer`) talks to. It owns:

- the metanode client ``meta`` (leader following, retries and dedup live
  there), which the front ends send their commands and queries to
  (:mod:`cachefs.commands`, :mod:`cachefs.queries`), and the volume session
  from ``mount_volume`` (the metanodes keep unlinked files we hold open until
  we release them or the session ends);
- the session's open files: an inode's first open is announced to the leader
  (``Open``) and its last close too (``Release``), one at a time per inode so
  they reach it in order; both are soft state there, not log entries. Every
  heartbeat carries the whole open set, which is how a new leader learns it
  after a failover (see ``metanode.opentable.OpenTable``). Under a lease an
  open is not announced at all (see below);
- with :meth:`enable_leases` (the FUSE front end), the session's metadata
  leases (:mod:`.leases`): the lease poll, kept outstanding on the leader,
  which renews them and brings revocations (acknowledged by the next poll,
  once the front end has dropped the kernel's caches); opens of a leased
  file that the leader hears of only if it loses the lease while the file
  is open; and the session's own changes (:meth:`mutate`), which keep its
  leases on what they change;
- the cluster map, refreshed in the background, which feeds the backing-storage
  client's placement and the cache router's rings;
- the block chain for reads (DESIGN.md "Reads"): the owner of the block on our
  zone's ring, then the owners on the other zones' rings, then backing storage
  directly. A cache node that refuses or times out is marked down in the router
  and skipped; a dead cache node slows reads, it never fails them.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.backing.client import BackingClient
from cachefs.backing.cluster import MetaClusterView
from cachefs.buffers import ScratchPool
from cachefs.errors import (
    Busy,
    CacheFSError,
    CacheMiss,
    ConnectionLost,
    InvalidArgument,
    NoSuchMethod,
    NotFound,
    SliceExpired,
    TimedOut,
    Unreachable,
)
from cachefs.ids import CHUNK_SIZE, DEFAULT_BLOCK_SIZE, BlockKey
from cachefs.layout import Slice
from cachefs.messages import GET_MANY_BYTES, MANY_NOT_SERVED, Attr, LeasedAttr, Renamed
from cachefs.metanode.client import MetaClient
from cachefs.repo.source import RepoBlocks
from cachefs.ring import CacheRouter
from cachefs.rpc import RpcPool
from cachefs.transport import BlockTransport, open_transport

from .leases import REJECTIONS, LeaseCache

log = logging.getLogger(__name__)


CACHE_TIMEOUT = 5.0
MAP_REFRESH = 5.0
GET_MANY_KEYS = 64  # keys per get_many call (the cache node's limit)
SCRATCH_KEEP = 2  # get_many receive scratches (GET_MANY_BYTES each) a mount keeps
# Slice ids taken from the metanodes at once: each ``alloc_slices`` is a
# replicated log entry, and a random writer seals a run every few MiB. Ids
# left unused when the mount ends are only gaps (no block has them).
SLICE_BATCH = 64
# A batch older than this is dropped for a fresh one: the collector seals
# slice ids a grace (10 min by default) after their allocation, and a slice
# must be stored and committed before that (cachefs/backing/gc.py).
SLICE_ID_TTL = 60.0
POLL_WAIT = 2.0  # seconds the leader may hold a lease poll (it caps this at a quarter term)
_DOWN = (Unreachable, ConnectionLost, TimedOut)


class Session:
    """Metadata and block access for one volume (see module docstring)."""

    def __init__(
        self,
        meta: MetaClient,
        volume: str,
        session_id: str,
        cluster_map: dict[str, Any],
        *,
        zone: str,
        transport: BlockTransport,
        backing: BackingClient | RepoBlocks,
        view: MetaClusterView | None = None,
        pool: RpcPool | None = None,
        takes_leases: bool = True,
    ) -> None:
        """Parts are injected so tests can run the same session over other parts;
        :meth:`connect` builds the real ones (``pool``: the connections under them;
        ``takes_leases``: the session was opened as one that may take leases)."""
        self.meta = meta
        self.takes_leases = takes_leases
        self.pool = pool
        self.volume = volume
        self.session_id = session_id
        self.zone = zone
        self.transport = transport
        self.view = view
        self.backing = backing
        self.router = CacheRouter(cluster_map, zone)
        self._set_map(cluster_map)
        self.on_new_session: Callable[[], Awaitable[None]] | None = None
        # Called with each block stored on backing storage (the mount keeps
        # it in L1: a reader of what was just written needs no fetch).
        self.on_block_stored: Callable[[BlockKey, bytes | memoryview], None] | None = None
        self._slice_ids = range(0)
        self._slice_ids_at = 0.0  # trio time the batch was allocated
        self._slice_lock = trio.Lock()
        self._open: dict[int, int] = {}  # ino -> opens by this mount
        self._open_locks: dict[int, trio.Lock] = {}
        self.leases: LeaseCache | None = None  # see enable_leases
        # The front end drops the kernel's caches of lost leases: [(ino, names)].
        self._on_lost: Callable[[tuple[tuple[int, tuple[bytes, ...]], ...]], Awaitable[None]] | None = None
        self._no_get_many: set[str] = set()  # cache nodes that answered get_many with ENOSYS
        self._scratch = ScratchPool(GET_MANY_BYTES, SCRATCH_KEEP)  # get_many replies land here
        self.stats = {"cache_reads": 0, "backing_reads": 0, "cache_errors": 0, "write_through": 0,
                      "cache_batches": 0, "cache_batch_blocks": 0}

    @classmethod
    async def connect(
        cls,
        pool: RpcPool,
        meta_addrs: list[str],
        volume: str,
        *,
        zone: str = "",
        transport: str = "tcp",
        client_id: str | None = None,
        token: str | None = None,
        leases: bool = True,
    ) -> Session:
        """Mount ``volume``: check it exists, open a session, read the cluster map.
        ``token``: the volume's mount token, if it is not open. ``leases``:
        whether the session may take metadata leases (:meth:`enable_leases`);
        one that may not is not waited for by a new leader.

        Raises:
            NotFound: the volume does not exist.
            PermissionDenied: the volume needs a token and ``token`` is not it.
            Unavailable: no metanode answered.
            AuthFailed: the cluster secret is wrong.
            RdmaUnavailable: ``transport`` is rdma and RDMA cannot be used.
        """
        client_id = client_id or f"fuse-{uuid.uuid4().hex[:12]}"
        meta = MetaClient(pool, meta_addrs, client_id=client_id)
        info = await meta.mount_volume(volume, token, leases)
        cmap = await meta.query(Q.ClusterMap())
        if volume not in cmap.get("volumes", {}):
            raise NotFound(f"volume {volume!r} is not in the cluster map")
        view = MetaClusterView(meta)
        await view.refresh()
        return cls(
            meta,
            volume,
            info.session,
            cmap,
            zone=zone,
            transport=open_transport(transport, pool),
            backing=RepoBlocks(BackingClient(pool, view, zone=zone), meta.query),
            view=view,
            pool=pool,
            takes_leases=leases,
        )

    def _set_map(self, cmap: dict[str, Any]) -> None:
        """Take a new cluster map. The block size is fixed at mount time: a
        volume's block size never changes, and a map without it must not make
        this mount cut or address blocks differently."""
        if not hasattr(self, "block_size"):
            vol = cmap.get("volumes", {}).get(self.volume, {})
            block_size = int(vol.get("block_size") or DEFAULT_BLOCK_SIZE)
            if not 0 < block_size <= CHUNK_SIZE or CHUNK_SIZE % block_size:
                raise InvalidArgument(
                    f"volume {self.volume} has an unusable block size {block_size}"
                )
            self.block_size = block_size
        self.router.update(cmap)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the session alive and the cluster map fresh (start it in the
        mount's nursery). The metanodes close a session silent for a minute,
        and with it the hold on our unlinked-but-open files; if that happened
        anyway (a long partition), open a new session and re-open the files
        through ``on_new_session``."""
        task_status.started()
        while True:
            await trio.sleep(MAP_REFRESH)
            try:
                if self.session_id and not await self.heartbeat():
                    log.warning("session %s expired; opening a new one", self.session_id)
                    info = await self.meta.mount_volume(self.volume, leases=self.takes_leases)
                    self.session_id = info.session
                    if self.leases is not None:
                        self.leases.drop_all()
                        self.leases.unannounced.clear()  # re-opened below
                    await self._reopen_all()
                    if self.on_new_session is not None:
                        await self.on_new_session()
                cmap = await self.meta.query(Q.ClusterMap())
                self._set_map(cmap)
                if self.view is not None:
                    await self.view.refresh()
            except CacheFSError as exc:
                log.warning("session upkeep failed (will retry): %s", exc)

    async def heartbeat(self) -> bool:
        """Keep the session alive and announce its open set (a new leader
        counts it once, opens under a lease included: it knows no lease);
        False: it is gone."""
        return await self.meta.query(Q.SessionHeartbeat(self.session_id, tuple(sorted(self._open))))

    async def _reopen_all(self) -> None:
        """A new metanode session: hold our open files again."""
        for ino in list(self._open):
            try:
                await self.meta.query(Q.Open(self.volume, ino, self.session_id))
            except CacheFSError as exc:
                log.error("could not re-open inode %d in the new session: %s", ino, exc)

    async def close(self) -> None:
        try:
            await self.meta.close_session(self.session_id)
        except CacheFSError as exc:
            log.warning("could not close session %s: %s", self.session_id, exc)
        await self.transport.aclose()

    # ------------------------------------------------------------------ open files

    def _lock(self, ino: int) -> trio.Lock:
        lock = self._open_locks.get(ino)
        if lock is None:
            lock = self._open_locks[ino] = trio.Lock()
        return lock

    def _unlock_idle(self, ino: int, lock: trio.Lock) -> None:
        """Called last while holding ``lock`` (no await after it): with no
        one waiting for it, the inode's next open or release may take the
        fast path again."""
        if not lock.statistics().tasks_waiting:
            self._open_locks.pop(ino, None)

    async def open(self, ino: int) -> Attr | None:
        """Count an open; the first one returns the inode's attributes as of
        then (a linearizable read, as ``getattr``), None when the inode was
        already open here. Under a valid lease with attributes it is the
        lease's answer and the leader is not told (it revokes the lease
        before anyone unlinks or changes the file, and hears of the open
        then); else the open is announced (``LeaseOpen``: the leader checks
        the inode is a regular file that still exists) and leased.

        The fast path (an open here already, or a valid lease) takes no
        lock and yields to no other task: a second read of a small file
        costs its open a few dictionary lookups. The inode's lock is held
        only by an announce or a release in flight, which it waits for."""
        if ino not in self._open_locks:  # nothing in flight: no await from here to the return
            count = self._open.get(ino, 0)
            attr = None if count else self._open_leased(ino)
            if count or attr is not None:
                self._open[ino] = count + 1
                return attr
        lock = self._lock(ino)
        attr = None
        async with lock:
            try:
                count = self._open.get(ino, 0)
                if not count:
                    attr = self._open_leased(ino) or await self._announce_open(ino)
                self._open[ino] = count + 1
            finally:
                self._unlock_idle(ino, lock)
        return attr

    def leased_attr(self, ino: int) -> Attr | None:
        """``ino``'s attributes under a valid lease, or None."""
        if self.leases is None:
            return None
        lease = self.leases.get(ino, time.monotonic())
        return None if lease is None else lease.attr

    def _open_leased(self, ino: int) -> Attr | None:
        attr = self.leased_attr(ino)
        if attr is None or not attr.is_reg:
            return None
        assert self.leases is not None
        self.leases.unannounced.add(ino)
        self.leases.stats["hits"] += 1
        return attr

    async def _announce_open(self, ino: int) -> Attr:
        if self.leases is None:
            return await self.meta.query(Q.Open(self.volume, ino, self.session_id))
        reply = await self.leased(ino, Q.LeaseOpen(self.volume, ino, self.session_id))
        return reply.attr

    async def release(self, ino: int) -> None:
        """Uncount an open; the last one is announced to the leader, if it
        knows of the open. Without an RPC (not the last, or unannounced)
        and nothing in flight, no lock and no await, as in :meth:`open`."""
        if ino not in self._open_locks:  # no await from here to the return
            count = self._open.get(ino, 0)
            if count > 1:
                self._open[ino] = count - 1
                return
            if not count or (self.leases is not None and not self.leases.closed(ino)):
                self._open.pop(ino, None)
                return
        lock = self._lock(ino)
        async with lock:
            try:
                count = self._open.get(ino, 0)
                if count > 1:
                    self._open[ino] = count - 1
                    return
                self._open.pop(ino, None)
                if count and (self.leases is None or self.leases.closed(ino)):
                    await self.meta.query(Q.Release(self.volume, ino, self.session_id))
            finally:
                self._unlock_idle(ino, lock)

    # ------------------------------------------------------------------ leases

    def enable_leases(
        self,
        nursery: trio.Nursery,
        on_lost: Callable[[tuple[tuple[int, tuple[bytes, ...]], ...]], Awaitable[None]],
    ) -> None:
        """Take metadata leases from now on; ``on_lost`` drops the kernel's
        caches of ``(ino, names)`` whose lease went (before it is acknowledged).
        The session must have been opened as one that takes leases."""
        if not self.takes_leases:
            raise ValueError("this session was opened without leases (Session.connect(leases=False))")
        self.leases = LeaseCache()
        self._on_lost = on_lost
        nursery.start_soon(self._poll_leases)

    async def leased(self, ino: int, q: Q.Query[LeasedAttr]) -> LeasedAttr:
        """Send a query that answers ``ino``'s attributes with leases; the
        leases are installed and hold the answer (unless something about the
        inode changed here meanwhile)."""
        leases = self.leases
        assert leases is not None
        ticket = leases.ticket(time.monotonic())
        try:
            reply = await self.meta.query(q)
            lease = leases.accept(ticket, reply.grant, time.monotonic()).get(ino)
            if lease is not None:
                lease.attr = reply.attr
            return reply
        finally:
            leases.done(ticket)

    async def _poll_leases(self) -> None:
        """Keep a lease poll outstanding on the leader (see module docstring):
        what a poll acknowledges is dropped from the kernel first."""
        leases = self.leases
        assert leases is not None and self._on_lost is not None
        while True:
            out = leases.outgoing()
            if out.lost:
                await self._on_lost(out.lost)
            poll = Q.LeasePoll(
                self.session_id, out.acks, out.drops, out.opens, out.held_term,
                int(POLL_WAIT * 1000),
            )
            sent = time.monotonic()
            try:
                news = await self.meta.query(poll, deadline=POLL_WAIT + 10.0)
            except CacheFSError as exc:
                leases.resend(out)
                log.info("lease poll failed (will retry): %s", exc)
                await trio.sleep(0.5)
                continue
            leases.news(news, sent)

    async def mutate(self, cmd: C.Command[Any], report: bool = True) -> Any:
        """Apply our own change: with leases, the leader leaves ours on what
        it changes alone (it revokes everyone else's), and we forget what
        the change makes stale. An open of those inodes the leader does not
        know of is reported with it (an unlink must see it). An unlink or
        rmdir answers the directory's attributes and a rename the moved
        inode's and both directories', which the leases keep."""
        leases = self.leases
        refs = C.inode_refs(cmd) if leases is not None else None
        if refs is None or leases is None:
            return await self.meta.mutate(cmd)
        change = leases.begin_mutation(self._named(refs), report)
        entries = refs[2]
        result = None
        rejected = False
        try:
            result = await self.meta.mutate(cmd, lease=(self.session_id, change.kept, change.opens))
            return result
        except CacheFSError as exc:
            if not exc.remote:  # the outcome is unknown: the kernel may not know it
                for ino in change.kept:
                    leases.lose(ino)
            rejected = exc.remote and isinstance(exc, REJECTIONS)
            raise
        finally:
            attr = result if isinstance(result, Attr) else None
            if isinstance(result, Renamed):  # the moved inode's and both directories' attributes
                leases.end_mutation(change, entries, None, result, outcome=(None, result.attr.ino))
            elif attr is not None and isinstance(cmd, C.Unlink | C.Rmdir):  # the directory's attributes
                leases.end_mutation(change, entries, None, (attr,), outcome=(None,))
            else:
                leases.end_mutation(change, entries, attr, rejected=rejected)

    def _named(self, refs: C.Refs) -> set[int]:
        """The inodes a change names, and those its names resolve to here."""
        assert self.leases is not None
        _, inos, entries = refs
        named = set(inos)
        for parent, name in entries:
            lease = self.leases.held(parent)
            if lease is not None and name in lease.entries:
                named.add(lease.entries[name])
        return named

    async def create(self, cmd: C.Mknod | C.Mkdir) -> tuple[Attr, bool]:
        """Create a regular file in one round trip: the answer carries a lease
        on it (so that its open, which follows, is answered here and never
        announced, and the kernel's getxattr of it too) and its directory's
        attributes (which the kernel asks for next). A new directory's lease
        says it is empty (``complete``): the lookup before each create in it
        is answered here. Returns the attributes and whether the new inode
        had no extended attributes when the leader answered (leased or not)."""
        leases = self.leases
        refs = C.inode_refs(cmd)
        if leases is None or refs is None:
            return await self.meta.mutate(cmd), False
        change = leases.begin_mutation(self._named(refs))
        entries = refs[2]
        ticket = leases.ticket(time.monotonic())
        created = None
        rejected = False
        try:
            created = await self.meta.create(cmd, (self.session_id, change.kept, change.opens))
            lease = leases.accept(ticket, created.grant, time.monotonic()).get(created.attr.ino)
            if lease is not None:
                lease.attr, lease.bare = created.attr, created.bare
                lease.complete = created.attr.is_dir  # granted only while empty
            return created.attr, created.bare
        except CacheFSError as exc:
            if not exc.remote:
                for ino in change.kept:
                    leases.lose(ino)
            rejected = exc.remote and isinstance(exc, REJECTIONS)
            raise
        finally:
            leases.done(ticket)
            attr = created.attr if created else None
            others = (created.parent,) if created and created.parent else ()
            leases.end_mutation(change, entries, attr, others, rejected=rejected)

    async def read_chunk(self, ino: int, chunk: int) -> list[Slice]:
        """A chunk's slice list (the reader's ``BlockSource`` call)."""
        return await self.meta.query(Q.ReadChunk(self.volume, ino, chunk))

    # ------------------------------------------------------------------ writes

    async def alloc_slice(self) -> int:
        """A new slice id, from a batch of ``SLICE_BATCH`` taken from the metanodes
        at most ``SLICE_ID_TTL`` seconds ago."""
        async with self._slice_lock:
            if not self._slice_ids or trio.current_time() - self._slice_ids_at > SLICE_ID_TTL:
                first = await self.meta.mutate(C.AllocSlices(SLICE_BATCH))
                self._slice_ids = range(first, first + SLICE_BATCH)
                self._slice_ids_at = trio.current_time()
            sid = self._slice_ids[0]
            self._slice_ids = self._slice_ids[1:]
            return sid

    async def store_block(self, key: BlockKey, data: bytes | memoryview) -> bool:
        """Store a block durably; True when some shards are left for repair (the
        commit of its slice must say so).

        ``data`` (a view of the writer's run) is copied once, here, when the
        mount keeps the block: the codec needs ``bytes`` and would copy it
        itself, and L1 and L2 keep that same copy (``on_block_stored``).
        """
        if self.on_block_stored is not None:
            data = bytes(data)
        short = await self.backing.put_block(self.volume, key, data)
        if self.on_block_stored is not None:
            self.on_block_stored(key, data)
        return bool(short)

    async def write_through(self, key: BlockKey, data: bytes | memoryview) -> None:
        """Best effort: a block the cache tier did not take is read from backing later."""
        for addr in self.router.candidates(key)[:1]:
            try:
                await self.transport.put(addr, self.volume, key, bytes(data), timeout=CACHE_TIMEOUT)
                self.stats["write_through"] += 1
            except _DOWN:
                self.router.mark_down(addr)
            except CacheFSError as exc:
                log.debug("write-through of %s to %s failed: %s", key.hex(), addr, exc)

    async def write_slice(
        self, ino: int, chunk: int, slice_id: int, pos: int, length: int, offset: int, mtime_ns: int,
        short: tuple[int, ...] = (),
    ) -> Attr:
        """Commit a slice (the writer's ``BlockSink`` call). A commit at or
        past the file's end, as known under its lease with no other own
        change of it in flight, trashes no slice (a slice record lies below
        the end), so an unannounced open of the file stays unannounced: its
        release then needs no round trip either."""
        leases = self.leases
        appends = False
        if leases is not None and not leases.busy(ino):
            lease = leases.get(ino, time.monotonic())
            appends = lease is not None and lease.attr is not None and chunk * CHUNK_SIZE + pos >= lease.attr.size
        try:
            return await self.mutate(
                C.WriteSlice(self.volume, ino, chunk, slice_id, pos, length, offset, mtime_ns, short),
                report=not appends,
            )
        except SliceExpired:
            self.drop_slice_ids()
            raise

    def drop_slice_ids(self) -> None:
        """Forget the batch of slice ids: a commit found one sealed (the
        collector's grace is shorter than ``SLICE_ID_TTL``, or the mount stalled)."""
        self._slice_ids = range(0)

    # ------------------------------------------------------------------ reads

    def owner(self, key: BlockKey) -> str | None:
        """The cache node :meth:`fetch` asks first for ``key``, or None."""
        candidates = self.router.candidates(key)
        if not candidates or candidates[0] in self._no_get_many:
            return None  # the single path
        return candidates[0]

    async def fetch_many(self, addr: str, keys: list[BlockKey]) -> dict[BlockKey, bytes]:
        """Whole blocks of ``keys`` that cache node ``addr`` holds, in as few
        ``get_many`` calls as its reply budget allows (at most
        ``GET_MANY_KEYS`` keys a call). Keys missing from the answer (the node
        misses them, is down or failed) are for :meth:`fetch` to read the
        usual way; this never raises a cache node's error.

        Each block is copied out of the reply into its own ``bytes``: a view
        would keep the whole batch's buffer alive for as long as any one of
        its blocks stayed in L1. The reply itself lands in a scratch lent for
        the call (:class:`~cachefs.buffers.ScratchPool`).
        """
        got: dict[BlockKey, bytes] = {}
        todo = list(keys)
        while todo:
            ask, todo = todo[:GET_MANY_KEYS], todo[GET_MANY_KEYS:]
            try:
                answer = await self._get_many(addr, ask)
            except _DOWN as exc:
                log.info("cache node %s is not answering (%s); reading around it", addr, exc)
                self.router.mark_down(addr)
                break
            except Busy:
                break
            except NoSuchMethod:  # a node older than get_many (a rolling upgrade): single gets there
                log.info("cache node %s has no get_many: fetching its blocks one at a time", addr)
                self._no_get_many.add(addr)
                break
            except CacheFSError as exc:
                self.stats["cache_errors"] += 1
                log.info("cache node %s failed a get_many of %d blocks: %s", addr, len(ask), exc)
                break
            self.stats["cache_batches"] += 1
            unserved = []
            for key, item in zip(ask, answer, strict=True):
                if isinstance(item, bytes):
                    got[key] = item
                elif item == MANY_NOT_SERVED:
                    unserved.append(key)
            if unserved and len(unserved) == len(ask):
                break  # not even one fits a reply (a huge block): the single path
            todo = unserved + todo
        self.stats["cache_batch_blocks"] += len(got)
        return got

    async def _get_many(self, addr: str, keys: list[BlockKey]) -> list[bytes | int]:
        """One ``get_many``: per key, its block copied out of the reply, or
        its marker. The scratch goes back to the pool only once the reply
        is complete and every view of it is gone (raises as the transport does)."""
        scratch = self._scratch.take()
        try:
            answer = await self.transport.get_many(addr, self.volume, keys, timeout=CACHE_TIMEOUT,
                                                   scratch=scratch)
        except BaseException:
            self._scratch.lose(scratch)  # a reply may still be landing in it
            raise
        blocks = [bytes(item) if isinstance(item, memoryview) else item for item in answer]
        for item in answer:
            if isinstance(item, memoryview):
                item.release()
        del answer
        self._scratch.give(scratch)
        return blocks

    async def fetch(self, key: BlockKey, offset: int = 0, length: int = -1) -> bytes | bytearray:
        """A block (range) from the cache tier, else from backing storage."""
        for addr in self.router.candidates(key):
            try:
                data = await self.transport.get(
                    addr, self.volume, key, offset, length, timeout=CACHE_TIMEOUT
                )
                self.stats["cache_reads"] += 1
                return data
            except _DOWN as exc:
                log.info("cache node %s is not answering (%s); reading around it", addr, exc)
                self.router.mark_down(addr)
            except (Busy, CacheMiss):
                continue
            except NotFound:
                break  # the node read through and backing storage has no such block
            except CacheFSError as exc:
                self.stats["cache_errors"] += 1
                log.info("cache node %s failed %s: %s", addr, key.hex(), exc)
        self.stats["backing_reads"] += 1
        return await self.backing.get_block(self.volume, key, offset, length)
