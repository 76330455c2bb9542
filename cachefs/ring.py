"""Routing blocks to cache nodes: one consistent hash ring per zone.

Theory of operation (CubeFS "flash group" style):

- Every zone in the cluster map gets its own ``uhashring.HashRing`` over the
  cache nodes in that zone that the map says are ``up``. The ring's node name
  is the node *id*, so a node that moves to a new address keeps its keys.
- A node's share of the ring is proportional to its capacity: its weight is
  ``round(WEIGHT_SCALE * capacity / largest capacity in the zone)`` (at least
  1), times ``VNODES`` virtual points. Weights are relative to the largest node
  so that a ring of terabyte nodes stays a few thousand points; the price is
  that adding a node *larger* than every other one reweighs the whole zone.
  Adding or removing any other node moves only about 1/N of the keys.
- ``candidates(key)`` answers, in order: the owner on the caller's own zone's
  ring, then the owner on each other zone's ring (zones in name order). Nodes
  marked down locally (``mark_down``: a timeout or a refused connection) are
  skipped until their back-off period ends; the ring itself is not rebuilt for
  that, so the node gets its keys back when it returns. When every candidate is
  skipped the list is empty and the caller reads backing storage directly:
  a dead cache node slows reads, it never fails them.
- ``update(cluster_map)`` rebuilds the rings when the map's epoch or its cache
  node list changed; marks for nodes still present survive.

The router is a plain object (no IO, no trio); time enters through ``clock``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import xxhash
from uhashring import HashRing

from cachefs.errors import InvalidArgument
from cachefs.ids import BlockKey

VNODES = 40
WEIGHT_SCALE = 16
DEFAULT_BACK_OFF = 10.0
MAX_BACK_OFF = 120.0


def _hash(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode())


@dataclass(frozen=True, slots=True)
class CacheNodeInfo:
    """One cache node as the cluster map lists it."""

    id: str
    addr: str
    zone: str
    capacity: int
    up: bool = True

    @classmethod
    def from_map(cls, node: Mapping[str, Any]) -> CacheNodeInfo:
        try:
            return cls(
                id=str(node["id"]),
                addr=str(node["addr"]),
                zone=str(node["zone"]),
                capacity=int(node.get("capacity", 0)),
                up=node.get("state", "up") == "up",
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"malformed cache node in cluster map: {node!r} ({exc})") from exc


def ring_weights(nodes: Iterable[CacheNodeInfo]) -> dict[str, int]:
    """Integer ring weights proportional to capacity (see module docstring)."""
    nodes = list(nodes)
    if not nodes:
        return {}
    largest = max(n.capacity for n in nodes)
    if largest <= 0:
        return {n.id: 1 for n in nodes}
    return {n.id: max(1, round(WEIGHT_SCALE * max(n.capacity, 0) / largest)) for n in nodes}


def _key_text(key: BlockKey | bytes | str) -> str:
    if isinstance(key, BlockKey):
        return key.hex()
    if isinstance(key, bytes | bytearray):
        return BlockKey.from_bytes(bytes(key)).hex()
    return key


class ZoneRing:
    """The consistent hash ring of one zone."""

    def __init__(self, nodes: Iterable[CacheNodeInfo]) -> None:
        self.nodes = {n.id: n for n in nodes}
        weights = ring_weights(self.nodes.values())
        self._ring = HashRing(
            nodes={nid: {"weight": w, "vnodes": VNODES} for nid, w in weights.items()},
            hash_fn=_hash,
        )

    def owner(self, key: BlockKey | bytes | str) -> CacheNodeInfo | None:
        if not self.nodes:
            return None
        return self.nodes[self._ring.get_node(_key_text(key))]

    def __len__(self) -> int:
        return len(self.nodes)


class CacheRouter:
    """Which cache nodes to ask for a block, in order (see module docstring)."""

    def __init__(
        self,
        cluster_map: Mapping[str, Any],
        my_zone: str,
        *,
        back_off: float = DEFAULT_BACK_OFF,
        max_back_off: float = MAX_BACK_OFF,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.my_zone = my_zone
        self.back_off = back_off
        self.max_back_off = max_back_off
        self._clock = clock
        self._down_until: dict[str, float] = {}
        self._strikes: dict[str, int] = {}
        self._signature: tuple[Any, ...] | None = None
        self.epoch: int | None = None
        self.rings: dict[str, ZoneRing] = {}
        self._zone_order: list[str] = []
        self.update(cluster_map)

    def update(self, cluster_map: Mapping[str, Any]) -> bool:
        """Rebuild the rings if the map changed; returns whether it did."""
        nodes = [CacheNodeInfo.from_map(n) for n in cluster_map.get("cachenodes", [])]
        signature = tuple(sorted((n.id, n.addr, n.zone, n.capacity, n.up) for n in nodes))
        epoch = cluster_map.get("epoch")
        if signature == self._signature:
            self.epoch = epoch
            return False
        by_zone: dict[str, list[CacheNodeInfo]] = {}
        for n in nodes:
            if n.up:
                by_zone.setdefault(n.zone, []).append(n)
        self.rings = {zone: ZoneRing(members) for zone, members in by_zone.items()}
        others = sorted(z for z in self.rings if z != self.my_zone)
        self._zone_order = ([self.my_zone] if self.my_zone in self.rings else []) + others
        live = {n.addr for n in nodes}
        for addr in [a for a in self._down_until if a not in live]:
            self._down_until.pop(addr, None)
            self._strikes.pop(addr, None)
        self._signature = signature
        self.epoch = epoch
        return True

    def owners(self, key: BlockKey | bytes | str) -> list[CacheNodeInfo]:
        """The owner on each zone's ring, own zone first, ignoring down marks."""
        text = _key_text(key)
        found = []
        for zone in self._zone_order:
            node = self.rings[zone].owner(text)
            if node is not None:
                found.append(node)
        return found

    def candidates(self, key: BlockKey | bytes | str) -> list[str]:
        """Addresses to try in order; empty means: go to backing storage."""
        now = self._clock()
        return [n.addr for n in self.owners(key) if self._down_until.get(n.addr, 0.0) <= now]

    def mark_down(self, addr: str) -> None:
        """Skip ``addr`` for a back-off period that doubles on repeated failures.

        Failures count as repeated while they come within ``max_back_off`` of
        the end of the last back-off; a node that then stayed healthy for
        longer starts again from ``back_off`` even if nobody called mark_up.
        """
        now = self._clock()
        if now - self._down_until.get(addr, now) > self.max_back_off:
            self._strikes.pop(addr, None)
        strikes = self._strikes.get(addr, 0)
        period = min(self.back_off * (2**strikes), self.max_back_off)
        self._strikes[addr] = strikes + 1
        self._down_until[addr] = now + period

    def mark_up(self, addr: str) -> None:
        """A call to ``addr`` succeeded: forget its failures."""
        self._down_until.pop(addr, None)
        self._strikes.pop(addr, None)

    def is_down(self, addr: str) -> bool:
        return self._down_until.get(addr, 0.0) > self._clock()
