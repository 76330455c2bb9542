"""Placement groups: which datanodes hold the shards of a block.

A volume has a fixed number of placement groups (PGs, as in Ceph). A block
goes to PG ``pg_of(key)``; PG ``p`` is an ordered list of ``width`` distinct
datanodes and shard ``i`` of every block in the PG lives on the ``i``-th of
them. The lists are computed here and kept in the cluster map, so readers never
recompute placement on their own.

Theory of operation (weighted rendezvous hashing with a zone constraint):

1. Zone quotas. Each zone gets a share of the ``width`` slots by water-filling:
   zones take one slot each in turn, in an order ranked per PG by rendezvous
   hash of ``(pg, zone)``, skipping zones that have no node left, until the
   width is reached. So every zone holds ``floor`` or ``ceil`` of
   ``width / zones`` slots when it has the nodes, and the zones that get the
   extra slot vary from PG to PG, spreading load.
2. Nodes. Inside a zone the PG takes the nodes with the highest weighted
   rendezvous score ``-weight / ln(h(pg, node))`` (Schindelhauer/Resch's
   logarithmic method: a node's share is proportional to its weight).
3. Order. With a previous layout, every node that stays in the PG keeps its
   position (its shards need not move); newcomers fill the freed positions.
   A fresh PG interleaves zones so consecutive shards sit in different zones.

Rendezvous scores of the nodes already present do not change when a node
joins or leaves, so only the PGs where the newcomer wins (or the leaver was
chosen) change, and in those only one slot: movement stays at the minimum
unless the zone quotas themselves shift (a zone with too few nodes).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import xxhash

from cachefs.errors import InvalidArgument
from cachefs.ids import BlockKey

Node = tuple[str, str, float]  # (node id, zone, weight)


def _unit(*parts: str | int) -> float:
    """A hash of ``parts`` mapped into the open interval (0, 1)."""
    h = xxhash.xxh3_64_intdigest("\x1f".join(str(p) for p in parts).encode())
    return (h + 0.5) / 2.0**64


def _score(pg: int, node_id: str, weight: float) -> float:
    return -weight / math.log(_unit("node", pg, node_id))


def pg_of(key: BlockKey | bytes, pg_count: int) -> int:
    """The placement group of a block key (a stable hash of its 12-byte form)."""
    if pg_count < 1:
        raise InvalidArgument(f"pg_count must be at least 1, got {pg_count}")
    raw = key.to_bytes() if isinstance(key, BlockKey) else bytes(key)
    return xxhash.xxh3_64_intdigest(raw, seed=0x5047) % pg_count


def _zone_quotas(pg: int, zone_sizes: dict[str, int], width: int) -> dict[str, int]:
    order = sorted(zone_sizes, key=lambda z: _unit("zone", pg, z), reverse=True)
    quotas = dict.fromkeys(order, 0)
    placed = 0
    while placed < width:
        progress = False
        for zone in order:
            if placed < width and quotas[zone] < zone_sizes[zone]:
                quotas[zone] += 1
                placed += 1
                progress = True
        if not progress:  # pragma: no cover - excluded by the width check below
            raise InvalidArgument("not enough datanodes for the placement width")
    return quotas


def _check_nodes(nodes: Iterable[Node]) -> list[Node]:
    out: list[Node] = []
    seen: set[str] = set()
    for node in nodes:
        node_id, zone, weight = node
        if node_id in seen:
            raise InvalidArgument(f"datanode {node_id!r} listed twice")
        if not weight > 0 or not math.isfinite(weight):
            raise InvalidArgument(f"datanode {node_id!r} has weight {weight!r}; it must be > 0")
        seen.add(node_id)
        out.append((str(node_id), str(zone), float(weight)))
    return sorted(out)


def place_pg(pg: int, nodes: Sequence[Node], width: int, previous: Sequence[str] | None = None) -> list[str]:
    """The ordered datanode ids of one PG; see the module docstring."""
    by_zone: dict[str, list[tuple[float, str]]] = {}
    for node_id, zone, weight in nodes:
        by_zone.setdefault(zone, []).append((_score(pg, node_id, weight), node_id))
    quotas = _zone_quotas(pg, {z: len(v) for z, v in by_zone.items()}, width)
    chosen_by_zone: dict[str, list[str]] = {}
    for zone, scored in by_zone.items():
        scored.sort(reverse=True)
        chosen_by_zone[zone] = [node_id for _, node_id in scored[: quotas[zone]]]
    # Interleave zones (zone rank order, then score order) for fresh positions.
    zone_order = sorted(chosen_by_zone, key=lambda z: _unit("zone", pg, z), reverse=True)
    interleaved: list[str] = []
    for rank in range(width):
        for zone in zone_order:
            if rank < len(chosen_by_zone[zone]):
                interleaved.append(chosen_by_zone[zone][rank])
    if previous is None or len(previous) != width:
        return interleaved
    chosen = set(interleaved)
    result: list[str | None] = [n if n in chosen else None for n in previous]
    if len({n for n in result if n is not None}) != sum(n is not None for n in result):
        return interleaved  # a malformed previous layout (duplicates): start afresh
    kept = {n for n in result if n is not None}
    newcomers = iter(n for n in interleaved if n not in kept)
    return [n if n is not None else next(newcomers) for n in result]


def place_pgs(
    nodes: Iterable[Node],
    pg_count: int,
    width: int,
    previous: Sequence[Sequence[str]] | None = None,
) -> list[list[str]]:
    """Compute ``pg_count`` placement groups of ``width`` distinct datanodes.

    ``nodes`` are ``(id, zone, weight)``; pass only nodes that should hold
    data (up, not draining). ``previous`` is the layout currently in the
    cluster map: nodes that stay keep their positions, so a join or leave
    moves as few shards as possible.

    Raises:
        InvalidArgument: fewer nodes than ``width``, a bad weight or count.
    """
    if pg_count < 1:
        raise InvalidArgument(f"pg_count must be at least 1, got {pg_count}")
    if width < 1:
        raise InvalidArgument(f"placement width must be at least 1, got {width}")
    checked = _check_nodes(nodes)
    if len(checked) < width:
        raise InvalidArgument(
            f"placement needs at least {width} datanodes, only {len(checked)} available"
        )
    out = []
    for pg in range(pg_count):
        prev = previous[pg] if previous is not None and pg < len(previous) else None
        out.append(place_pg(pg, checked, width, prev))
    return out


def handoff_order(key: BlockKey | bytes, index: int, node_ids: Iterable[str], pg: Sequence[str]) -> list[str]:
    """Where shard ``index`` of ``key`` goes when its PG slot cannot take it.

    Every datanode but ``pg[index]``, nodes outside the PG first (a shard
    there keeps every shard on a distinct node), then the other PG members;
    within each group by rendezvous score over ``(key, index, node)``. It
    depends only on the key and the node ids, never on which nodes are up, so
    a reader finds a handed-off shard among the first few entries that the
    writer could have used (the writer skips those that are down).
    """
    raw = (key.to_bytes() if isinstance(key, BlockKey) else bytes(key)).hex()
    home = pg[index] if 0 <= index < len(pg) else None
    members = set(pg)
    others = [n for n in node_ids if n != home]
    return sorted(others, key=lambda n: (n in members, -_unit("handoff", raw, index, n)))
