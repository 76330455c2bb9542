"""The backing-storage client: blocks in, shards out, and back again.

Used by cache nodes (read-through), the FUSE client (writes, and reads when no
cache node answers) and repair. It holds no state of its own beyond a view of
the cluster map (datanodes, placement groups, volume policies) and a record of
shards that a put could not store.

Writes. ``put_block`` encodes the block (:mod:`cachefs.backing.codec`) and sends
shard ``i`` to the ``i``-th datanode of the key's placement group, all in
parallel. It returns once the block is durable: ``policy.write_quorum``
shards stored (K+1 of K+M, or 2 replicas) and losing any one node still
leaves K (one more failure loses nothing). Stragglers get a short grace
period, then are cancelled and recorded in :attr:`missing` for repair.

Handoff (as Dynamo's hinted handoff or Ceph's acting set): when PG members
are down in the map, fail, or stay silent past the handoff delay (a few times
the first shard's latency), and the members left cannot make the block
durable, their shards go to substitute datanodes, in the deterministic order
of :func:`cachefs.backing.placement.handoff_order` (outside the PG first, nodes in
zones with no failing node preferred, fewest shards of the block first). With
a whole zone down and every datanode in the PG (6 nodes, ec:4+2) the four
left hold all six shards, two each at most, which is as durable as five on
distinct nodes. Handed-off shards are recorded in :attr:`missing` with their
holder; repair rebuilds them on their PG member and removes the copy. Below
that the put fails (``Unavailable``, or ``NoSpace`` when datanodes are full)
and what was written is removed again.

Reads. ``get_block`` asks for the K data shards first (a replica in the
nearest zone first). A shard that fails (missing, corrupt, node down) is
replaced at once by the next shard (parity, or the next replica); a shard that
is slow is *hedged*: after a delay adapted to recent shard latencies one more
shard is requested per outstanding slow one, and the first K answers win.
Byte ranges of uncompressed blocks read only the covering data shards,
unless something fails, in which case the whole block is rebuilt and sliced.
Whole blocks of volumes without compression are read the same way (the K
data shards' payloads, without their fragment headers) and then checked
against the block checksum. Either way each shard's bytes are received in
their place in one buffer of the result (``RpcPool.call(into=...)``): no
shard buffer is allocated and filled, and no block is joined from pieces
(measured on a cache node's cold fills: those copies and zero fills were
~7% of its CPU); with ``buffers`` (a cache node's), that buffer is one
a finished fill retired (:mod:`cachefs.buffers`), not a fresh zeroed
one. Anything unexpected (a shard missing, slow, short or
corrupt, a compressed block) falls back to the whole-block read above,
which reconstructs from parity.
Which shards and offsets cover a range depends on the block's header (its
length, compression); a range read plans with the header of a full-size
uncompressed block until it has seen the real one, which it then keeps
(blocks are immutable, so a header never changes): later ranges of a short or
compressed block take one round trip, not a wrong guess and a second. The
first whole read of a short block needs no second round either: a datanode
clips a range at its shard's end, so the replies to the guess hold the real
ranges, and they are cut out of them.
When the PG itself comes up short, the missing shards are looked for on
their first few handoff substitutes, then on the datanodes outside the PG:
after a join or leave the map moves slots at once but the shards only move
when repair runs.

Volumes whose blocks live in an object store (``--backing s3://...``, see
:mod:`cachefs.backing.objects`) have no placement groups: their puts, gets
and deletes go to :attr:`BackingClient.objects`, one object per block.

Errors: ``NotFound`` when enough datanodes deny having the block that an
acknowledged write cannot exist; ``Unavailable`` when too few shards can be
read; ``Corrupt`` when shards decode to bytes that fail the block checksum.
Never wrong bytes.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import trio
from prometheus_client import Counter

from cachefs.backing.codec import BlockHeader, Codec, ShardRange
from cachefs.backing.objects import ObjectBlocks, ObjectTarget
from cachefs.backing.placement import handoff_order
from cachefs.backing.policy import VolumePolicy
from cachefs.buffers import BufferPool
from cachefs.checksum import checksum
from cachefs.errors import (
    CacheFSError,
    ConnectionLost,
    Corrupt,
    InvalidArgument,
    NoSpace,
    NotFound,
    TimedOut,
    Unavailable,
    Unreachable,
)
from cachefs.ids import BlockKey
from cachefs.rpc import RpcPool

log = logging.getLogger(__name__)

_EVENTS = Counter("cachefs_backing_events_total",
                  "Backing-storage client events: degraded reads, hedges, range reads and "
                  "fallbacks, shards left missing by puts", ["event"])


class _Stats(collections.Counter[str]):
    """Per-client counts (tests read them) mirrored into the process's Prometheus counter."""

    def __setitem__(self, key: str, value: int) -> None:
        delta = value - self.get(key, 0)
        super().__setitem__(key, value)
        if delta > 0:
            _EVENTS.labels(key).inc(delta)


# ---------------------------------------------------------------- client

@dataclass(frozen=True, slots=True)
class MissingShard:
    """A shard a put could not store: repair should rebuild it."""

    volume: str
    key: BlockKey
    index: int
    node: str
    reason: str
    handoff: str | None = None  # the substitute datanode that holds it meanwhile, if any


@dataclass(slots=True)
class _Shard:
    header: BlockHeader
    data: bytes | bytearray | memoryview


@dataclass(slots=True)
class _Outcome:
    """What a batch of shard reads produced."""

    shards: dict[int, _Shard] = field(default_factory=dict)
    errors: dict[int, CacheFSError] = field(default_factory=dict)


class BackingClient:
    """put/get/delete whole blocks on the datanodes (see the module docstring)."""

    SEARCH_LIMIT = 64  # shard reads spent looking outside the PG when it comes up short
    HANDOFF_SEARCH = 8  # substitutes per shard a put may use and a read looks at (handoff_order's first)
    HANDOFF_TRIES = 3  # substitutes a put tries per shard before it gives that shard up
    HEADERS_KEPT = 16384  # block headers remembered for range reads (~300 bytes each)
    LATENCY_MIN_BYTES = 256 << 10  # shard reads at least this long feed the hedge delay

    def __init__(self, pool: RpcPool, view: Any, *, zone: str | None = None, timeout: float = 10.0,
                 hedge_min: float = 0.02, hedge_max: float = 0.5, put_grace: float = 0.5,
                 suspect_for: float = 5.0, buffers: BufferPool | None = None) -> None:
        self.pool = pool
        self.buffers = buffers  # where range reads take their result buffers (a cache node's fills)
        self.view = view
        self.zone = zone
        self.timeout = timeout
        self.hedge_min = hedge_min
        self.hedge_max = hedge_max
        self.put_grace = put_grace
        self.suspect_for = suspect_for
        self._suspect: dict[str, float] = {}  # datanode -> until when puts hand its shards off at once
        self.missing: collections.deque[MissingShard] = collections.deque(maxlen=100_000)
        self.stats = _Stats()
        self._codecs: dict[VolumePolicy, Codec] = {}
        self._latency = 0.05  # EWMA of shard read latency, seconds
        self._headers: collections.OrderedDict[tuple[str, BlockKey], BlockHeader] = collections.OrderedDict()
        self.objects = ObjectBlocks()

    # -- helpers --------------------------------------------------------------

    def codec(self, policy: VolumePolicy) -> Codec:
        codec = self._codecs.get(policy)
        if codec is None:
            codec = self._codecs[policy] = Codec(policy)
        return codec

    def _addr(self, node_id: str) -> str:
        node = self.view.datanodes.get(node_id)
        if node is None:
            raise Unavailable(f"datanode {node_id} is not in the cluster map")
        if node.state != "up":
            raise Unavailable(f"datanode {node_id} is {node.state}")
        return node.addr

    def _is_suspect(self, node_id: str) -> bool:
        """Whether a put found ``node_id`` failing or silent within the last ``suspect_for`` s."""
        return self._suspect.get(node_id, 0.0) > trio.current_time()

    def _usable(self, node_id: str) -> bool:
        node = self.view.datanodes.get(node_id)
        return node is not None and node.state == "up"

    def _substitutes(self, key: BlockKey, index: int, pg: tuple[str, ...]) -> list[str]:
        """The datanodes that may hold shard ``index`` in place of ``pg[index]``."""
        return handoff_order(key, index, self.view.datanodes, pg)[: self.HANDOFF_SEARCH]

    def _substitute(self, key: BlockKey, index: int, pg: tuple[str, ...], tried: set[str],
                    suspect: set[str], load: Mapping[str, int]) -> str | None:
        """The substitute for shard ``index`` of a put: up, not draining, not
        tried, in a zone with no suspect node if possible, holding the fewest
        shards of the block."""
        nodes = self.view.datanodes
        bad_zones = {nodes[n].zone for n in suspect if n in nodes}
        ranked = [(nodes[n].zone in bad_zones, load.get(n, 0), rank, n)
                  for rank, n in enumerate(self._substitutes(key, index, pg))
                  if n not in tried and n not in suspect and self._usable(n) and not nodes[n].draining]
        return min(ranked)[3] if ranked else None

    async def object_target(self, volume: str) -> ObjectTarget | None:
        """The object store of a volume whose blocks are objects; None for one on
        the datanodes (refreshing the view once, as :meth:`_locate` does)."""
        try:
            return self.view.target(volume)
        except NotFound:
            refresh = getattr(self.view, "refresh", None)
            if refresh is None:
                raise
            await refresh()
            return self.view.target(volume)

    async def _locate(self, volume: str, key: BlockKey) -> tuple[VolumePolicy, tuple[str, ...]]:
        """Policy and placement group; a view that can refresh is refreshed once
        when it does not know the volume yet (a map fetched before the volume
        was created, or not fetched at all yet)."""
        try:
            return self.view.policy(volume), self.view.placement(volume, key)
        except (NotFound, Unavailable):
            refresh = getattr(self.view, "refresh", None)
            if refresh is None:
                raise
            await refresh()
            return self.view.policy(volume), self.view.placement(volume, key)

    def _remember(self, volume: str, key: BlockKey, header: BlockHeader) -> None:
        """Keep a block's header for its later range reads (bounded, oldest out)."""
        self._headers[(volume, key)] = header
        if len(self._headers) > self.HEADERS_KEPT:
            self._headers.popitem(last=False)

    def _hedge_delay(self) -> float:
        return min(self.hedge_max, max(self.hedge_min, 4 * self._latency))

    async def read_shard(self, node: str, volume: str, key: BlockKey, index: int,
                         offset: int = 0, length: int = -1, into: memoryview | None = None) -> _Shard:
        """One shard (or a range of it) with its block header; ``into``: where
        its bytes should land if they are exactly that long (see RpcPool.call)."""
        started = trio.current_time()
        try:
            reply = await self.pool.call(
                self._addr(node), "get",
                {"volume": volume, "key": key.to_bytes(), "index": index, "offset": offset, "length": length},
                timeout=self.timeout, into=into)
        except (Unreachable, ConnectionLost, TimedOut):
            self._suspect[node] = trio.current_time() + self.suspect_for
            raise
        if length == -1 or length >= self.LATENCY_MIN_BYTES:  # whole shards, or most of one
            self._latency = 0.8 * self._latency + 0.2 * (trio.current_time() - started)
        header = BlockHeader.unpack(reply.result["meta"])
        return _Shard(header, reply.payload if reply.payload is not None else b"")

    async def write_shard(self, node: str, volume: str, key: BlockKey, index: int, header: BlockHeader,
                          data: bytes | bytearray | memoryview) -> None:
        await self.pool.call(
            self._addr(node), "put",
            {"volume": volume, "key": key.to_bytes(), "index": index, "meta": header.pack()},
            payload=data, timeout=self.timeout)

    async def _race(self, jobs: list[tuple[int, Callable[[], Awaitable[_Shard]]]], need: int) -> _Outcome:
        """Run jobs (in preference order) until ``need`` succeed or all have failed.

        ``need`` start at once; a failure starts the next job; when the hedge
        delay passes with results outstanding, one more job starts per
        outstanding one. Jobs still running when enough succeeded are cancelled.
        """
        outcome = _Outcome()
        pending = collections.deque(jobs)
        running = 0
        send, receive = trio.open_memory_channel[tuple[int, _Shard | None, CacheFSError | None]](len(jobs))

        async def run(index: int, job: Callable[[], Awaitable[_Shard]]) -> None:
            try:
                send.send_nowait((index, await job(), None))
            except CacheFSError as exc:
                send.send_nowait((index, None, exc))

        async with trio.open_nursery() as nursery:

            def start(count: int) -> None:
                nonlocal running
                for _ in range(min(count, len(pending))):
                    index, job = pending.popleft()
                    running += 1
                    nursery.start_soon(run, index, job)

            start(need)
            hedge_at = trio.current_time() + self._hedge_delay()
            while len(outcome.shards) < need and running:
                with trio.move_on_at(hedge_at):
                    index, shard, error = await receive.receive()
                    running -= 1
                    if shard is not None:
                        outcome.shards[index] = shard
                    else:
                        assert error is not None
                        outcome.errors[index] = error
                        start(1)
                    continue
                # Hedge: the outstanding reads are slow; back each up once.
                self.stats["hedged"] += min(running, len(pending))
                start(running)
                hedge_at = math.inf
            nursery.cancel_scope.cancel()
        return outcome

    def _failure(self, what: str, policy: VolumePolicy, outcome: _Outcome) -> CacheFSError:
        """The error for a read that got too few shards."""
        errors = list(outcome.errors.values())
        denied = sum(isinstance(e, NotFound) for e in errors)
        if not outcome.shards and denied > policy.n - policy.write_quorum and not any(
                isinstance(e, Corrupt) for e in errors):
            return NotFound(f"{what}: no datanode has it")
        causes = collections.Counter(type(e).__name__ for e in errors)
        detail = ", ".join(f"{n} {c}" for c, n in sorted(causes.items()))
        return Unavailable(f"{what}: {len(outcome.shards)} of {policy.k} needed shards readable ({detail})")

    # -- API ------------------------------------------------------------------

    async def put_block(self, volume: str, key: BlockKey, data: bytes | bytearray | memoryview) -> list[MissingShard]:
        """Store a block; returns once it is durable (see :func:`_durable`), with
        the shards not stored on their PG member (also recorded in :attr:`missing`):
        the writer names a block with any in its slice commit, for repair.

        Shards whose PG member is down, fails or stays silent past the
        handoff delay go to substitute datanodes (:func:`handoff_order`)
        when the PG members alone cannot make the write durable; they are
        recorded in :attr:`missing` with their holder, for repair to move.

        Raises:
            Unavailable: too few datanodes stored a shard for the block to be durable.
            NoSpace: the same, because datanodes are full.
            NotFound: unknown volume.
        """
        if (target := await self.object_target(volume)) is not None:
            _check_size(data, self.view.policy(volume).block_size)
            await self.objects.put(volume, target, key, data)
            return []
        policy, pg = await self._locate(volume, key)
        _check_size(data, policy.block_size)
        header, shards = self.codec(policy).encode(data)
        placed: dict[int, set[str]] = {}  # index -> nodes holding it durably
        inflight: set[tuple[int, str]] = set()
        tried: dict[int, set[str]] = collections.defaultdict(set)
        errors: dict[tuple[int, str], CacheFSError] = {}
        load: collections.Counter[str] = collections.Counter()  # shards of this block per node
        now = trio.current_time()
        suspect = {n for n in dict.fromkeys(pg) if not self._usable(n) or self._suspect.get(n, 0.0) > now}
        began = now
        first_ack = trio.Event()
        ack_at = 0.0

        def durable() -> bool:
            return _durable(placed, policy.write_quorum)

        try:
            async with trio.open_nursery() as nursery:
                watchdog = trio.CancelScope()

                def launch(index: int, node: str) -> None:
                    tried[index].add(node)
                    inflight.add((index, node))  # counted at once, so plan() does not pick it twice
                    load[node] += 1
                    nursery.start_soon(write, index, node)

                async def write(index: int, node: str) -> None:
                    nonlocal ack_at
                    try:
                        await self.write_shard(node, volume, key, index, header, shards[index])
                    except CacheFSError as exc:
                        errors[(index, node)] = exc
                        load[node] -= 1
                        suspect.add(node)
                        if not isinstance(exc, NoSpace):
                            self._suspect[node] = trio.current_time() + self.suspect_for
                        plan()
                        return
                    else:
                        placed.setdefault(index, set()).add(node)
                        if not first_ack.is_set():
                            ack_at = trio.current_time()
                            first_ack.set()
                        if durable() and nursery.cancel_scope.deadline == math.inf:
                            # Durable enough: give the stragglers a grace period, no more.
                            elapsed = trio.current_time() - began
                            nursery.cancel_scope.deadline = trio.current_time() + max(self.put_grace, 2 * elapsed)
                    finally:
                        inflight.discard((index, node))
                        if not inflight:
                            watchdog.cancel()

                def plan() -> None:
                    """Start handoffs until placed + hopeful writes would be durable."""
                    if durable():
                        return
                    hopeful = {i: set(nodes) for i, nodes in placed.items()}
                    for i, node in inflight:
                        if node not in suspect:
                            hopeful.setdefault(i, set()).add(node)
                    for index in range(policy.n):
                        if _durable(hopeful, policy.write_quorum):
                            return
                        if hopeful.get(index) or len(tried[index]) > self.HANDOFF_TRIES:
                            continue
                        node = self._substitute(key, index, pg, tried[index], suspect, load)
                        if node is None:
                            continue
                        hopeful[index] = {node}
                        self.stats["handoffs_started"] += 1
                        launch(index, node)

                async def watch() -> None:
                    """Suspect PG members still silent after the handoff delay, and hand off."""
                    with watchdog:
                        await first_ack.wait()
                        delay = max(self.put_grace, 3 * (ack_at - began))
                        while not durable():
                            await trio.sleep(delay)
                            slow = {node for _index, node in inflight} - suspect
                            suspect.update(slow)
                            until = trio.current_time() + self.suspect_for
                            for node in slow:
                                self._suspect[node] = max(self._suspect.get(node, 0.0), until)
                            plan()

                for index in range(policy.n):
                    if self._usable(pg[index]):
                        launch(index, pg[index])
                    else:
                        tried[index].add(pg[index])
                nursery.start_soon(watch)
                plan()
                if not inflight:
                    watchdog.cancel()
        finally:
            # launch, write and plan name one another (closure cells), a cycle
            # that would keep the shards until the cyclic collector ran: tens
            # of MiB of a mount's heap between two collections (cachefs/heap.py).
            shards.clear()
            launch = write = plan = None  # type: ignore[assignment]

        if not durable():
            await self._undo(volume, key, placed)
            full = sum(isinstance(e, NoSpace) for e in errors.values())
            causes = "; ".join(f"shard {i} on {n}: {e}" for (i, n), e in sorted(errors.items()))
            cls = NoSpace if full and 2 * full >= len(errors) else Unavailable
            stored = sum(1 for nodes in placed.values() if nodes)
            raise cls(f"block {key.hex()}: only {stored} of {policy.n} shards stored durably, "
                      f"{policy.write_quorum} on distinct nodes needed ({causes or 'timed out'})")
        until = trio.current_time() + self.suspect_for
        short: list[MissingShard] = []
        for index in range(policy.n):
            holders = placed.get(index, set())
            if pg[index] in holders:
                continue
            if pg[index] in suspect and (index, pg[index]) not in errors:
                # Still silent when the put moved on: keep handing its shards off at once.
                self._suspect[pg[index]] = max(self._suspect.get(pg[index], 0.0), until)
            holder = min(holders) if holders else None
            reason = str(errors.get((index, pg[index]), "down" if pg[index] in suspect else "cancelled after quorum"))
            short.append(MissingShard(volume, key, index, pg[index], reason, holder))
            self.missing.append(short[-1])
            self.stats["shards_missing"] += 1
            if holder is not None:
                self.stats["handoffs"] += 1
            log.info("block %s/%s stored without shard %d on %s (%s)%s; left for repair",
                     volume, key.hex(), index, pg[index], reason,
                     f", handed off to {holder}" if holder else "")
        return short

    async def _undo(self, volume: str, key: BlockKey, placed: Mapping[int, Iterable[str]]) -> None:
        with trio.move_on_after(self.timeout):
            async with trio.open_nursery() as nursery:
                for index, nodes in placed.items():
                    for node in nodes:
                        nursery.start_soon(self._delete_shard, node, volume, key, index)

    async def _delete_shard(self, node: str, volume: str, key: BlockKey, index: int) -> int:
        try:
            reply = await self.pool.call(self._addr(node), "delete",
                                         {"volume": volume, "key": key.to_bytes(), "index": index},
                                         timeout=self.timeout)
        except CacheFSError as exc:
            log.info("could not remove shard %s.%d from %s: %s", key.hex(), index, node, exc)
            return -1
        return int(reply.result["removed"])

    async def delete_block(self, volume: str, key: BlockKey) -> None:
        """Delete every shard of a block from its placement group.

        Raises:
            NotFound: every datanode answered and none had a shard.
            Unavailable: some datanode did not answer (retry later).
        """
        if (target := await self.object_target(volume)) is not None:
            return await self.objects.delete(volume, target, key)
        policy, pg = await self._locate(volume, key)
        removed: list[int] = []
        # Handed-off shards too (best effort: repair removes any left behind).
        extra = {n for i in range(policy.n) for n in self._substitutes(key, i, pg)
                 if n not in pg and self._usable(n)}

        async def one(node: str) -> None:
            removed.append(await self._delete_shard(node, volume, key, -1))

        async def best_effort(node: str) -> None:
            if await self._delete_shard(node, volume, key, -1) > 0:
                removed.append(1)

        async with trio.open_nursery() as nursery:
            for node in dict.fromkeys(pg):
                nursery.start_soon(one, node)
            for node in sorted(extra):
                nursery.start_soon(best_effort, node)
        if -1 in removed:
            raise Unavailable(f"block {key.hex()}: some datanodes could not delete their shards")
        if not any(removed):
            raise NotFound(f"block {key.hex()} not found in volume {volume}")

    async def get_block(self, volume: str, key: BlockKey, offset: int = 0,
                        length: int = -1) -> bytes | bytearray:
        """Bytes ``[offset, offset+length)`` of a block (length -1: to its end).

        Raises:
            NotFound, Unavailable, Corrupt: see the module docstring.
        """
        if offset < 0 or length < -1:
            raise InvalidArgument(f"bad range offset={offset} length={length}")
        if (target := await self.object_target(volume)) is not None:
            return await self.objects.get(volume, target, key, offset, length)
        policy, pg = await self._locate(volume, key)
        codec = self.codec(policy)
        whole = offset == 0 and length == -1
        if policy.kind == "ec" and not (whole and policy.compressed):
            what = "whole" if whole else "range"
            try:
                data = await self._get_range_ec(codec, volume, key, pg, offset, length, whole=whole)
            except _Fallback:
                self.stats[f"{what}_fallbacks"] += 1
            else:
                self.stats[f"{what}_reads"] += 1
                return data
        if policy.kind == "replica":
            return await self._get_replica(codec, volume, key, pg, offset, length)
        header, shards = await self.read_shards(volume, key, pg=pg)
        data = codec.decode(header, shards)
        return data if whole else _slice(data, offset, length)

    async def read_shards(self, volume: str, key: BlockKey, *, pg: tuple[str, ...] | None = None,
                          need: int | None = None, avoid: Iterable[int] = (),
                          sources: Mapping[int, str] | None = None,
                          ) -> tuple[BlockHeader, dict[int, bytes | bytearray | memoryview]]:
        """At least ``need`` (default K) intact shards of a block, data shards first.

        Shard ``i`` is read from ``pg[i]``, or from ``sources[i]`` when given
        (repair knows where misplaced shards sit); ``avoid`` lists shards
        known to be missing, tried last.
        """
        policy = self.view.policy(volume)
        pg = pg or self.view.placement(volume, key)
        where = dict(sources) if sources is not None else dict(enumerate(pg))
        known_bad = set(avoid)
        order = [i for i in range(policy.n) if i not in known_bad and i in where]
        order += sorted(i for i in known_bad if i in where and 0 <= i < policy.n)
        if policy.kind == "replica":
            order = self._replica_order(tuple(where.get(i, "") for i in range(policy.n)), order)
        order.sort(key=lambda i: self._is_suspect(where[i]))  # stable: nodes silent lately last
        jobs = [(i, _job(self.read_shard, where[i], volume, key, i)) for i in order]
        outcome = await self._race(jobs, need or policy.k)
        if len(outcome.shards) < (need or policy.k) and sources is None:
            await self._search_elsewhere(volume, key, policy, pg, outcome, need or policy.k)
        if len(outcome.shards) < (need or policy.k):
            raise self._failure(f"block {key.hex()}", policy, outcome)
        header = _consensus(outcome)
        self.codec(policy).check_header(header)
        self._remember(volume, key, header)
        if outcome.errors:
            self.stats["degraded_reads"] += 1
        return header, {i: s.data for i, s in outcome.shards.items() if s.header == header}

    async def _search_elsewhere(self, volume: str, key: BlockKey, policy: VolumePolicy,
                                pg: tuple[str, ...], outcome: _Outcome, need: int) -> None:
        """Look for the missing shards on datanodes outside their PG slot.

        After a datanode joins or leaves, the cluster map's placement moves at
        most a few slots per PG, but the shards move only when repair runs;
        until then a moved shard still sits on its old node. Only reached when
        the PG itself came up short, and capped at :attr:`SEARCH_LIMIT` calls.
        """
        # First where a put hands a shard off when its slot is down (the
        # first few of handoff_order), then, since a node that stays in a PG
        # keeps its slot (placement's `previous`), the nodes no longer in it.
        others = [n.id for n in self.view.datanodes.values() if n.state == "up" and n.id not in pg]
        wanted = [i for i in range(policy.n) if i not in outcome.shards]
        jobs, seen = [], set()
        for i in wanted:
            for node in self._substitutes(key, i, pg):
                if self._usable(node):
                    seen.add((i, node))
                    jobs.append((i, _job(self.read_shard, node, volume, key, i)))
        for i in wanted:
            jobs += [(i, _job(self.read_shard, node, volume, key, i)) for node in others if (i, node) not in seen]
        jobs = jobs[: self.SEARCH_LIMIT]
        if not jobs:
            return
        self.stats["searches"] += 1
        found = await self._race(jobs, need - len(outcome.shards))
        for i, shard in found.shards.items():
            outcome.shards.setdefault(i, shard)
            outcome.errors.pop(i, None)

    def _replica_order(self, pg: tuple[str, ...], order: list[int]) -> list[int]:
        zone_of = {n: d.zone for n, d in self.view.datanodes.items()}
        return sorted(order, key=lambda i: (self._is_suspect(pg[i]),  # stable
                                            self.zone is not None and zone_of.get(pg[i]) != self.zone))

    async def _get_replica(self, codec: Codec, volume: str, key: BlockKey, pg: tuple[str, ...],
                           offset: int, length: int) -> bytes:
        policy = codec.policy
        # A range of an uncompressed replica is served as is (its chunks are
        # verified by the datanode); whole blocks are checked end to end.
        ranged = not (offset == 0 and length == -1) and policy.compression == "none"
        order = self._replica_order(pg, list(range(policy.n)))
        if ranged:
            jobs = [(i, _job(self.read_shard, pg[i], volume, key, i, offset, length)) for i in order]
        else:
            jobs = [(i, _job(self.read_shard, pg[i], volume, key, i)) for i in order]
        outcome = await self._race(jobs, 1)
        if not outcome.shards:
            header, shards = await self.read_shards(volume, key, pg=pg)  # searches other nodes
            return _slice(codec.decode(header, shards), offset, length)
        shard = next(iter(outcome.shards.values()))
        codec.check_header(shard.header)
        if ranged and not shard.header.compressed:
            self.stats["range_reads"] += 1
            return bytes(shard.data)
        if ranged:  # compressed after all: the whole stored block is needed
            header, shards = await self.read_shards(volume, key, pg=pg)
            return _slice(codec.decode(header, shards), offset, length)
        return _slice(codec.decode(shard.header, {0: shard.data}), offset, length)

    async def _get_range_ec(self, codec: Codec, volume: str, key: BlockKey, pg: tuple[str, ...],
                            offset: int, length: int, *, whole: bool = False) -> bytearray:
        """A range (``whole``: the whole block, checked against its checksum)
        from the data shards alone, each piece received in its place in one
        buffer (see the module docstring).

        Raises:
            _Fallback: it cannot be served so (read the whole block instead).
        """
        guess = self._headers.get((volume, key)) or codec.expected_header(codec.policy.block_size)
        plan = codec.plan_range(guess, offset, length)
        for _attempt in range(2):
            if not plan:
                raise _Fallback
            # A new buffer each round: a shard read given up on may still land in the old one.
            size = sum(r.length for r in plan)
            buf = self.buffers.take(size) if self.buffers is not None else bytearray(size)
            view = memoryview(buf)
            places, at = [], 0
            for r in plan:
                places.append(view[at : at + r.length])
                at += r.length
            pieces = await self._read_plan(volume, key, pg, plan, places)
            header = _consensus(pieces)
            codec.check_header(header)
            self._remember(volume, key, header)
            real = codec.plan_range(header, offset, length)
            if real == plan:
                for n, place in enumerate(places):
                    data = pieces.shards[n].data
                    if len(data) != len(place):
                        raise _Fallback  # a shard shorter than its header says: rebuild instead
                    if data is not place:
                        place[:] = data  # the reply did not land in place (it should have)
                del view, places
                if whole and not _is_block(buf, header):
                    raise _Fallback  # bytes that are not the block: rebuild (which reports Corrupt)
                return buf
            # The guess was wrong: a short block (a small file, a file's last
            # block) read for the first time. A datanode clips a range at its
            # shard's end, so the replies hold the real ranges already: cut
            # them out instead of asking again (a cache node's cold fill of a
            # small file took two rounds of shard reads, and a guessed block's
            # buffer, for every file).
            del view, places
            allocate = self.buffers.take if self.buffers is not None else bytearray
            cut = _cut(real, plan, pieces, header, allocate) if real else None
            del pieces
            if self.buffers is not None:
                self.buffers.give(buf)  # kept only if nothing, not even a late reply's view, refers to it
            if cut is not None:
                if whole and not _is_block(cut, header):
                    raise _Fallback
                return cut
            plan = real
        raise _Fallback

    async def _read_plan(self, volume: str, key: BlockKey, pg: tuple[str, ...], plan: list[ShardRange],
                         places: list[memoryview]) -> _Outcome:
        if any(self._is_suspect(pg[r.index]) for r in plan):
            raise _Fallback  # a shard on a node that went silent lately: read around it at once
        jobs = [(n, _job(self.read_shard, pg[r.index], volume, key, r.index, r.offset, r.length, places[n]))
                for n, r in enumerate(plan)]
        # No alternates for a given range: a slow shard is hedged by giving up
        # on the range read and rebuilding the block (which hedges to parity).
        with trio.move_on_after(2 * self._hedge_delay()):
            outcome = await self._race(jobs, len(jobs))
            if outcome.errors:
                raise _Fallback
            return outcome
        self.stats["hedged"] += 1
        raise _Fallback


class _Fallback(Exception):
    """A range read could not be served from data shards alone."""


def _check_size(data: bytes | bytearray | memoryview, block_size: int) -> None:
    if len(data) > block_size:
        raise InvalidArgument(f"block of {len(data)} bytes is over the volume's block size {block_size}")


def _job(fn: Callable[..., Awaitable[_Shard]], *args: Any) -> Callable[[], Awaitable[_Shard]]:
    return lambda: fn(*args)


def _is_block(buf: bytearray, header: BlockHeader) -> bool:
    """Whether ``buf``, read whole from the data shards, is the stored block
    ``header`` describes (a compressed one is decoded by the fallback instead)."""
    return not header.compressed and len(buf) == header.stored_len and checksum(buf) == header.checksum


def _cut(real: list[ShardRange], plan: list[ShardRange], pieces: _Outcome, header: BlockHeader,
         allocate: Callable[[int], bytearray]) -> bytearray | None:
    """The bytes of the shard ranges ``real``, cut from the replies to the
    reads of ``plan`` (each range inside one reply from the same shard, with
    the agreed ``header``) into ``allocate(size)``, or None if one of them
    is not all there."""
    parts = []
    for r in real:
        for n, p in enumerate(plan):
            shard = pieces.shards.get(n)
            if (shard is not None and p.index == r.index and shard.header == header
                    and p.offset <= r.offset and r.offset + r.length <= p.offset + len(shard.data)):
                start = r.offset - p.offset
                parts.append(memoryview(shard.data)[start:start + r.length])
                break
        else:
            return None
    out, at = allocate(sum(len(part) for part in parts)), 0
    for part in parts:
        out[at:at + len(part)] = part
        at += len(part)
    return out


def _consensus(outcome: _Outcome) -> BlockHeader:
    """The block header most shards agree on (they all should: keys are immutable)."""
    counts = collections.Counter(s.header for s in outcome.shards.values())
    return counts.most_common(1)[0][0]


def _slice(data: bytes, offset: int, length: int) -> bytes:
    return data[offset:] if length == -1 else data[offset : offset + length]


def _durable(placed: Mapping[int, set[str]], quorum: int) -> bool:
    """Whether a block whose shard ``i`` sits on the nodes ``placed[i]`` is
    durable: ``quorum`` distinct shards stored, and losing any one node still
    leaves ``quorum - 1`` (K for ``ec:K+M``, one copy for replicas). With
    every shard on its own node this is "``quorum`` shards stored"; with
    handoffs a node may hold two shards of a block, and then more are needed.
    """
    held = [nodes for nodes in placed.values() if nodes]
    if len(held) < quorum:
        return False
    for node in set().union(*held):
        if sum(1 for nodes in held if nodes - {node}) < quorum - 1:
            return False
    return True
