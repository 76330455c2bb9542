"""The other zones' cache nodes, as one cache tier with this one.

Every zone has its own ring (:mod:`cachefs.ring`), and a client asks the
owner on its own zone's ring first. Left at that, the tier's capacity is one
zone's: with every client in one zone, the other zones' nodes hold nothing,
and a working set larger than one zone thrashes while they stand empty. So
the zones cooperate, in two places (issue 20, "the whole group's capacity";
CubeFS serves from any member of a flash group):

- a miss asks the key's owner in the *next* zone (the first other zone in
  name order with a live owner) with the ``peek`` policy (answer from the
  cache or ``CacheMiss``, never fill) before it goes to backing storage; a
  block found there is served and not stored here (admission knows that
  another zone holds it: one copy in the tier, not two);
- a fill that would evict here while that owner has room (per the cluster
  map's ``used``, plus what this node sent it since) is put there instead.

So one zone's nodes fill first, the next zone's take the overflow, and the
second pass over a working set between one zone's capacity and the tier's
finds every block in the tier.

A peek is one more round trip on the miss path, before backing storage: a
cold read (blocks no zone holds yet) pays it on every block for nothing. So
a peer that missed ``PEEK_PATIENCE`` peeks in a row (since its last hit or
since we last placed a block on it) is asked only on one miss in
``PEEK_SAMPLE`` after that, which is how it is found holding blocks again;
a hit or a placement makes it asked every time again. A peer that does not answer within
``PEEK_TIMEOUT`` is marked down in the router (with back-off) and skipped: a
cut zone costs one timeout, then reads go to backing storage as before.

A warm-up knows better than the map which node holds a block: it has just
put it on the first zone's owner. Its prefetches to the other zones name
that node (``source``), and their fills ask it first (:meth:`PeerZones.get_from`),
with the patience of a bulk copy (``COPY_TIMEOUT``) rather than a read's,
whatever the map of the moment says about zones and liveness. A source
must be a cache node of the cluster map: a client cannot point a cache
node at an address of its choosing.

Ring changes in the node's own zone (a node joins, or leaves the ring):
consistent hashing moves about 1/N of the keys to new owners, which hold
none of them, and left at that the hit rate drops by that share at once and
recovers only as backing storage refills them. So for ``handoff_window``
seconds after a change of its zone's members, a fill first asks the key's
owner on the ring *before* the change (``peek``, with the same patience as
the next zone), and a block found there is stored here: it moves to its new
owner on first read instead of being fetched again (the fill behind a
``wait`` read, which is what clients send). A node's first map counts as
such a change (the ring before is the map without it): that is a node
joining. The keys that did not move have this node as their owner before,
so they cost nothing; nor do owners the map shows empty (``used`` 0: a
cluster starting cold, where every node's first map looks like a join).
A change also makes every peer worth asking again (its run of misses is
forgotten). Blocks handed over are stored as warm-up blocks are
(past admission): the previous owner had admitted them.

The cluster map is refreshed every ``MAP_REFRESH`` seconds.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from cachefs.errors import CacheFSError, CacheMiss, ConnectionLost, TimedOut, Unreachable
from cachefs.ids import BlockKey
from cachefs.ring import CacheRouter
from cachefs.rpc import RpcPool

log = logging.getLogger(__name__)

PEEK_TIMEOUT = 1.0
PEEK_PATIENCE = 32  # peeks missed in a row before a peer is asked only now and then
PEEK_SAMPLE = 16  # then one miss in this many still asks it
PUT_TIMEOUT = 10.0
COPY_TIMEOUT = 10.0  # a warm-up's copy from the node it names: throughput, not latency
MAP_REFRESH = 5.0
HANDOFF_WINDOW = 1800.0  # seconds after a ring change in which fills ask the previous owner
_DOWN = (Unreachable, ConnectionLost, TimedOut)


class PeerZones:
    """Looks up and places blocks on the next zone's owners (see module docstring)."""

    def __init__(
        self,
        pool: RpcPool,
        zone: str,
        node_id: str,
        cluster_map: Callable[[], Awaitable[Mapping[str, Any]]],
        *,
        handoff_window: float = HANDOFF_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.handoff_window = handoff_window
        self._clock = clock
        self._members: frozenset[str] | None = None  # up nodes of our zone in the last map
        self._last_map: Mapping[str, Any] = {}
        self._previous: CacheRouter | None = None  # the rings before the last change of our zone's
        self._previous_until = -math.inf
        self._previous_empty: set[str] = set()
        self.zone = zone
        self.node_id = node_id
        self._cluster_map = cluster_map
        self.router = CacheRouter({}, zone)
        self._known: set[str] = set()  # every other cache node of the map, up or not
        self._room: dict[str, int] = {}  # addr -> free bytes, as the map said less what we sent
        self._missed: dict[str, int] = {}  # addr -> misses in a row (peeked or skipped), see above
        self._refreshed_at = -math.inf
        self.stats = {"peer_zones": 0, "peer_hits": 0, "peer_misses": 0, "peer_errors": 0, "peer_puts": 0,
                      "peeks_skipped": 0, "sources_refused": 0, "handoff_hits": 0, "handoff_misses": 0, "zone_nodes": 0}  # fmt: skip

    def update(self, cmap: Mapping[str, Any]) -> None:
        nodes = cmap.get("cachenodes", [])
        members = frozenset(str(n["id"]) for n in nodes if n.get("zone") == self.zone and n.get("state", "up") == "up")
        if members != self._members and self.handoff_window > 0 and self.node_id in members:
            # our first map: the ring as it was before we joined; else the map before this one
            before = ({**cmap, "cachenodes": [n for n in nodes if n.get("id") != self.node_id]}
                      if self._members is None else self._last_map)  # fmt: skip
            self._previous = CacheRouter(before, self.zone)
            self._previous_until = self._clock() + self.handoff_window
            # an owner the map shows empty has nothing to hand over (a cluster starting cold)
            self._previous_empty = {str(n["addr"]) for n in before.get("cachenodes", []) if n.get("used", 1) == 0}
            self._missed.clear()  # a ring change makes every peer worth asking again
        self.stats["zone_nodes"] = len(members)
        self._members, self._last_map = members, dict(cmap)  # a copy: a caller may reuse its dict
        self.router.update(cmap)
        self._known = {str(n["addr"]) for n in cmap.get("cachenodes", []) if n.get("id") != self.node_id}
        self.stats["peer_zones"] = len(set(self.router.rings) - {self.zone})
        self._room = {
            str(n["addr"]): int(n.get("capacity", 0)) - int(n.get("used", 0))
            for n in cmap.get("cachenodes", [])
            if n.get("state", "up") == "up"
        }

    async def run(self) -> None:
        """Keep the rings fresh (start in the service's nursery)."""
        while True:
            await self._refresh()
            await trio.sleep(MAP_REFRESH)

    async def _refresh(self) -> None:
        self._refreshed_at = trio.current_time()
        try:
            self.update(await self._cluster_map())
        except CacheFSError as exc:
            log.info("cache node %s: cluster map refresh failed: %s", self.node_id, exc)

    async def _peer_known(self) -> None:
        """A map without another zone yet (nodes still registering at start-up)
        is asked again, at most once a second, instead of after MAP_REFRESH."""
        if len(self.router.rings) < 2 and trio.current_time() - self._refreshed_at > 1.0:
            await self._refresh()

    def _next_owner(self, key: BlockKey) -> str | None:
        """The owner of ``key`` in the first other zone that has a live one."""
        for node in self.router.owners(key):
            if node.zone != self.zone and node.id != self.node_id and not self.router.is_down(node.addr):
                return node.addr
        return None

    def _patient(self, addr: str) -> bool:
        """Whether to peek ``addr`` now (see the module docstring: a peer that
        keeps missing is asked on one miss in ``PEEK_SAMPLE``)."""
        missed = self._missed.get(addr, 0)
        if missed >= PEEK_PATIENCE and missed % PEEK_SAMPLE:
            self._missed[addr] = missed + 1
            self.stats["peeks_skipped"] += 1
            return False
        return True

    async def get(self, volume: str, key: BlockKey) -> Any:
        """The block from the next zone's owner if it holds it, else None."""
        await self._peer_known()
        addr = self._next_owner(key)
        if addr is None or not self._patient(addr):
            return None
        return await self._peek(addr, volume, key, PEEK_TIMEOUT)

    def _previous_owner(self, key: BlockKey) -> str | None:
        """The owner of ``key`` in our zone before its last ring change, if that
        was not us and is within the handoff window."""
        previous = self._previous
        if previous is None or self._clock() > self._previous_until:
            return None
        ring = previous.rings.get(self.zone)
        node = ring.owner(key) if ring is not None else None
        if node is None or node.id == self.node_id or node.addr in self._previous_empty:
            return None
        if previous.is_down(node.addr) or self.router.is_down(node.addr):
            return None
        return node.addr

    async def get_previous(self, volume: str, key: BlockKey) -> Any:
        """The block from its owner before our zone's last ring change, if it
        holds it (the block moved to us), else None."""
        addr = self._previous_owner(key)
        if addr is None or not self._patient(addr):
            return None
        held = await self._peek(addr, volume, key, PEEK_TIMEOUT, router=self._previous)
        self.stats["handoff_hits" if held is not None else "handoff_misses"] += 1
        return held

    async def get_from(self, addr: str, volume: str, key: BlockKey) -> Any:
        """The block from the cache node ``addr`` (a warm-up's source) if it
        holds it, else None; None at once if ``addr`` is no other cache node."""
        if not self.is_peer(addr):
            await self._refresh()  # a node that registered since the last refresh
            if not self.is_peer(addr):
                self.stats["sources_refused"] += 1
                log.info("cache node %s: prefetch source %r is no cache node of the map", self.node_id, addr)
                return None
        return await self._peek(addr, volume, key, COPY_TIMEOUT)

    def is_peer(self, addr: str) -> bool:
        return addr in self._known

    async def _peek(self, addr: str, volume: str, key: BlockKey, timeout: float,
                    router: CacheRouter | None = None) -> Any:  # fmt: skip
        """``router``: where a peer that does not answer is marked down (a
        previous owner may be in no current map)."""
        missed = self._missed.get(addr, 0)
        args = {"volume": volume, "key": key.to_bytes(), "policy": "peek"}
        try:
            reply = await self.pool.call(addr, "get", args, timeout=timeout)
        except CacheMiss:
            self._missed[addr] = missed + 1
            self.stats["peer_misses"] += 1
            return None
        except _DOWN as exc:
            self.stats["peer_errors"] += 1
            log.info("peer cache node %s is not answering (%s); reading around it", addr, exc)
            (router or self.router).mark_down(addr)
            return None
        except CacheFSError as exc:
            self.stats["peer_errors"] += 1
            log.info("peer cache node %s failed %s: %s", addr, key.hex(), exc)
            return None
        self._missed[addr] = 0
        self.stats["peer_hits"] += 1
        return reply.payload

    async def place(self, volume: str, key: BlockKey, data: Any) -> bool:
        """Put a block this node has no room for on the next zone's owner, if
        that one has room; False: keep it here after all."""
        await self._peer_known()
        addr = self._next_owner(key)
        if addr is None or self._room.get(addr, 0) < len(data):
            return False
        self._room[addr] -= len(data)
        try:
            await self.pool.call(
                addr, "put", {"volume": volume, "key": key.to_bytes()}, payload=data,
                timeout=PUT_TIMEOUT,
            )  # fmt: skip
        except _DOWN:
            self.router.mark_down(addr)
            return False
        except CacheFSError as exc:
            log.info("placing %s on peer cache node %s failed: %s", key.hex(), addr, exc)
            return False
        self._missed[addr] = 0  # it holds a block now: worth asking again
        self.stats["peer_puts"] += 1
        return True
