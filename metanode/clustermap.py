"""The cluster map: datanodes, cache nodes, volume policies and placement groups.

Theory of operation. Joins, leaves and volume creation are log commands
(``RegisterNode``, ``RemoveNode``, ``CreateVolume``), applied identically on
every replica; each bumps ``epoch`` and recomputes the placement groups of
every volume, so clients can tell a newer map from an older one. A datanode
marked *draining* (``DrainNode``) is left out of the placement groups but
stays in the map, readable, until repair has moved its shards and it is
removed (datanode/drain.py). Heartbeats
are *soft* state: the leader records ``used`` and ``last_seen`` in memory
only (a log entry per beat would swamp the log) and derives ``state`` from
how long ago a node was last heard. A new leader starts every node's clock
afresh, which gives each node one timeout of grace after a failover.

Placement groups follow Ceph: a volume has ``pg_count`` groups, each an
ordered list of ``width`` distinct datanodes (``width`` is N for
``replica:N`` and K+M for ``ec:K+M``), spread across zones where the zones
allow. A block picks its group by hashing its key. The computation lives
behind :func:`compute_pgs` so the placement module can replace it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cachefs.backing.placement import place_pgs
from cachefs.backing.policy import VolumePolicy
from cachefs.errors import Exists, InvalidArgument, NotFound

KINDS = ("datanode", "cachenode")


@dataclass(slots=True)
class Node:
    id: str
    addr: str
    zone: str
    capacity: int
    # soft state, kept on the leader only
    used: int = 0
    last_seen: float = 0.0
    down: bool = False
    draining: bool = False  # hard state: out of the placement groups (datanodes only)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "addr": self.addr,
            "zone": self.zone,
            "capacity": self.capacity,
            "used": self.used,
            "state": "down" if self.down else "up",
            "last_seen": self.last_seen,
            "draining": self.draining,
        }


@dataclass(slots=True)
class VolumeSpec:
    """``backing``: ``s3://bucket/prefix/`` when the volume keeps its blocks as
    objects there (with the store's endpoint and region) instead of on the
    datanodes; such a volume has no placement groups."""

    policy: str
    compression: str
    block_size: int
    pg_count: int
    backing: str = ""
    endpoint: str = ""
    region: str = ""

    @property
    def width(self) -> int:
        """Datanodes a block of it needs (none when it lives in an object store)."""
        return 0 if self.backing else VolumePolicy.parse(self.policy).n

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "policy": self.policy,
            "compression": self.compression,
            "block_size": self.block_size,
            "pg_count": self.pg_count,
        }
        if self.backing:
            out.update(backing=self.backing, endpoint=self.endpoint, region=self.region)
        return out

    def row(self) -> list[Any]:
        """Its fields for snapshots and dumps (the backing ones only when set:
        older rows have four fields)."""
        head = [self.policy, self.compression, self.block_size, self.pg_count]
        return [*head, self.backing, self.endpoint, self.region] if self.backing else head


def compute_pgs(
    nodes: list[tuple[str, str, float]],
    pg_count: int,
    width: int,
    previous: list[list[str]] | None = None,
) -> list[list[str]]:
    """Placement groups for a volume; [] while there are fewer datanodes than ``width``.

    The one place the cluster map computes placement: it delegates to
    :func:`cachefs.backing.placement.place_pgs` (rendezvous hashing with zone spread,
    keeping the positions of nodes that stay).
    """
    if len(nodes) < width:
        return []
    return place_pgs(nodes, pg_count, width, previous)


@dataclass(slots=True)
class ClusterMap:
    epoch: int = 0
    datanodes: dict[str, Node] = field(default_factory=dict)
    cachenodes: dict[str, Node] = field(default_factory=dict)
    volumes: dict[str, VolumeSpec] = field(default_factory=dict)
    pgs: dict[str, list[list[str]]] = field(default_factory=dict)

    def _nodes(self, kind: str) -> dict[str, Node]:
        if kind == "datanode":
            return self.datanodes
        if kind == "cachenode":
            return self.cachenodes
        raise InvalidArgument(f"kind must be datanode or cachenode, got {kind!r}")

    # -- log-driven changes (deterministic) ---------------------------------------

    def register(self, kind: str, node_id: str, addr: str, zone: str, capacity: int) -> int:
        """Join, or update a known node's address/zone/capacity; returns the epoch."""
        nodes = self._nodes(kind)
        node = nodes.get(node_id)
        if node is None:
            nodes[node_id] = Node(node_id, addr, zone, capacity)
        elif (node.addr, node.zone, node.capacity) == (addr, zone, capacity):
            return self.epoch  # a re-registration after a restart changes nothing
        else:
            node.addr, node.zone, node.capacity = addr, zone, capacity
        self.epoch += 1
        if kind == "datanode":
            self._place_all()
        return self.epoch

    def remove(self, kind: str, node_id: str) -> int:
        nodes = self._nodes(kind)
        if node_id not in nodes:
            raise NotFound(f"no {kind} {node_id}")
        del nodes[node_id]
        self.epoch += 1
        if kind == "datanode":
            self._place_all()
        return self.epoch

    def set_draining(self, node_id: str, draining: bool) -> dict[str, Any]:
        """Take datanode ``node_id`` out of the placement groups, or put it back."""
        node = self.datanodes.get(node_id)
        if node is None:
            raise NotFound(f"no datanode {node_id}")
        if node.draining == draining:
            return node.to_dict()
        if draining:
            left = sum(1 for n in self.datanodes.values() if not n.draining and n.id != node_id)
            for name, spec in sorted(self.volumes.items()):
                if spec.width > left:
                    raise InvalidArgument(f"draining {node_id} would leave {left} datanodes, and volume "
                                          f"{name!r} ({spec.policy}) needs {spec.width}")  # fmt: skip
        node.draining = draining
        self.epoch += 1
        self._place_all()
        return node.to_dict()

    def add_volume(self, name: str, spec: VolumeSpec) -> None:
        if name in self.volumes:
            raise Exists(f"volume {name!r} exists")
        self.volumes[name] = spec
        self.epoch += 1
        self._place(name)

    def remove_volume(self, name: str) -> None:
        self.volumes.pop(name, None)
        self.pgs.pop(name, None)
        self.epoch += 1

    def set_compression(self, name: str, compression: str) -> dict[str, Any]:
        spec = self.volumes.get(name)
        if spec is None:
            raise NotFound(f"no volume {name!r}")
        if spec.backing and compression != "none":
            raise InvalidArgument(f"volume {name!r} keeps its blocks in {spec.backing} as they are: "
                                  "it cannot compress them")
        if spec.compression != compression:
            spec.compression = compression
            self.epoch += 1
        return spec.to_dict()

    def _place(self, name: str) -> None:
        spec = self.volumes[name]
        if spec.backing:
            self.pgs[name] = []  # its blocks are objects in a store, not shards on datanodes
            return
        nodes = [(n.id, n.zone, float(max(n.capacity, 1))) for n in self.datanodes.values() if not n.draining]
        nodes.sort()
        self.pgs[name] = compute_pgs(nodes, spec.pg_count, spec.width, self.pgs.get(name))

    def _place_all(self) -> None:
        for name in self.volumes:
            self._place(name)

    # -- soft state (leader only, no log entry) -----------------------------------

    def heartbeat(self, kind: str, node_id: str, used: int, now: float) -> None:
        node = self._nodes(kind).get(node_id)
        if node is None:
            raise NotFound(f"no {kind} {node_id}; register first")
        node.used = used
        node.last_seen = now
        node.down = False

    def refresh_liveness(self, now: float, timeout: float) -> None:
        """Mark nodes silent for ``timeout`` seconds down; a fresh leader calls
        :meth:`reset_liveness` first so nobody is down merely for its election."""
        for nodes in (self.datanodes, self.cachenodes):
            for node in nodes.values():
                node.down = now - node.last_seen > timeout

    def reset_liveness(self, now: float) -> None:
        for nodes in (self.datanodes, self.cachenodes):
            for node in nodes.values():
                node.last_seen = max(node.last_seen, now)
                node.down = False

    # -- views and persistence ------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The ``cluster_map()`` RPC answer (see docs/contracts.md)."""
        return {
            "epoch": self.epoch,
            "datanodes": [n.to_dict() for n in self.datanodes.values()],
            "cachenodes": [n.to_dict() for n in self.cachenodes.values()],
            "volumes": {name: spec.to_dict() for name, spec in self.volumes.items()},
            "pgs": {name: [list(pg) for pg in pgs] for name, pgs in self.pgs.items()},
        }

    def capacity(self) -> tuple[int, int]:
        """(total capacity, reported used) of the datanodes, in bytes."""
        return (
            sum(n.capacity for n in self.datanodes.values()),
            sum(n.used for n in self.datanodes.values()),
        )

    def dump(self) -> list[Any]:
        """The hard (replicated) state only, for snapshots."""
        return [
            self.epoch,
            [[n.id, n.addr, n.zone, n.capacity, n.draining] for n in self.datanodes.values()],
            [[n.id, n.addr, n.zone, n.capacity] for n in self.cachenodes.values()],
            [[name, *s.row()] for name, s in self.volumes.items()],
            [[name, pgs] for name, pgs in self.pgs.items()],
        ]

    @classmethod
    def load(cls, raw: list[Any]) -> ClusterMap:
        epoch, datanodes, cachenodes, volumes, pgs = raw
        return cls(
            epoch=epoch,
            datanodes={n[0]: Node(*n[:4], draining=len(n) > 4 and bool(n[4])) for n in datanodes},  # older: no flag
            cachenodes={n[0]: Node(*n) for n in cachenodes},
            volumes={v[0]: VolumeSpec(*v[1:]) for v in volumes},
            pgs={name: [list(pg) for pg in groups] for name, groups in pgs},
        )
