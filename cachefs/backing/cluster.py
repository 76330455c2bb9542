"""The cluster as the backing client sees it: datanodes, volume policies and
placement groups, as a frozen snapshot of the metanodes' cluster map
(:class:`ClusterView`) or one kept fresh from them (:class:`MetaClusterView`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from cachefs.backing.objects import ObjectTarget
from cachefs.backing.placement import pg_of, place_pgs
from cachefs.backing.policy import VolumePolicy
from cachefs.errors import CacheFSError, InvalidArgument, NotFound, Unavailable
from cachefs.ids import BlockKey
from cachefs.queries import ClusterMap

if TYPE_CHECKING:
    from cachefs.metanode.client import MetaClient

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DatanodeInfo:
    id: str
    addr: str
    zone: str
    state: str = "up"
    capacity: int = 0
    used: int = 0
    draining: bool = False  # readable, but out of the placement groups: no new shards


@dataclass(frozen=True, slots=True)
class VolumeInfo:
    name: str
    policy: VolumePolicy
    pgs: tuple[tuple[str, ...], ...]
    target: ObjectTarget | None = None  # its blocks are objects there (and it has no pgs)


class ClusterView:
    """The part of the cluster map the backing client needs, as a frozen snapshot.

    Build it from a metanode ``cluster_map()`` answer (:meth:`from_map`) or,
    without metanodes, from a list of datanodes and volume policies
    (:meth:`build`, which computes the placement groups itself).
    """

    def __init__(self, datanodes: Iterable[DatanodeInfo], volumes: Iterable[VolumeInfo],
                 epoch: int = 0) -> None:
        self.datanodes: dict[str, DatanodeInfo] = {d.id: d for d in datanodes}
        self.volumes: dict[str, VolumeInfo] = {v.name: v for v in volumes}
        self.epoch = epoch

    @classmethod
    def build(cls, datanodes: Iterable[DatanodeInfo], volumes: Mapping[str, tuple[VolumePolicy, int]],
              epoch: int = 0) -> ClusterView:
        nodes = list(datanodes)
        placeable = [(d.id, d.zone, 1.0) for d in nodes if d.state == "up" and not d.draining]
        vols = [VolumeInfo(name, policy, tuple(tuple(pg) for pg in place_pgs(placeable, pg_count, policy.n)))
                for name, (policy, pg_count) in volumes.items()]
        return cls(nodes, vols, epoch)

    @classmethod
    def from_map(cls, cmap: Mapping[str, Any]) -> ClusterView:
        """From the ``cluster_map()`` dict of docs/contracts.md."""
        try:
            nodes = [DatanodeInfo(str(n["id"]), str(n["addr"]), str(n["zone"]), str(n.get("state", "up")),
                                  int(n.get("capacity", 0)), int(n.get("used", 0)), bool(n.get("draining", False)))
                     for n in cmap.get("datanodes", [])]
            pgs = cmap.get("pgs", {})
            vols = [VolumeInfo(name, VolumePolicy.from_volume(v),
                               tuple(tuple(str(n) for n in pg) for pg in pgs.get(name, [])),
                               ObjectTarget.from_volume(v))
                    for name, v in cmap.get("volumes", {}).items()]
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"malformed cluster map: {exc!r}") from exc
        return cls(nodes, vols, int(cmap.get("epoch", 0)))

    def to_map(self) -> dict[str, Any]:
        """The ``cluster_map()`` shape (used for cluster files and tests)."""
        return {
            "epoch": self.epoch,
            "datanodes": [{"id": d.id, "addr": d.addr, "zone": d.zone, "state": d.state,
                           "capacity": d.capacity, "used": d.used, "last_seen": 0, "draining": d.draining}
                          for d in self.datanodes.values()],
            "cachenodes": [],
            "volumes": {v.name: {"policy": str(v.policy), "compression": v.policy.compression,
                                 "block_size": v.policy.block_size, "pg_count": len(v.pgs),
                                 **({"backing": v.target.url, "endpoint": v.target.endpoint,
                                     "region": v.target.region} if v.target else {})}
                        for v in self.volumes.values()},
            "pgs": {v.name: [list(pg) for pg in v.pgs] for v in self.volumes.values()},
        }

    def volume(self, volume: str) -> VolumeInfo:
        info = self.volumes.get(volume)
        if info is None:
            raise NotFound(f"no volume {volume!r} in the cluster map")
        if not info.pgs and info.target is None:
            raise Unavailable(f"volume {volume!r} has no placement groups yet")
        return info

    def policy(self, volume: str) -> VolumePolicy:
        return self.volume(volume).policy

    def target(self, volume: str) -> ObjectTarget | None:
        """The object store that holds the volume's blocks; None: the datanodes
        (placement groups or not). NotFound if the map does not know the volume."""
        info = self.volumes.get(volume)
        if info is None:
            raise NotFound(f"no volume {volume!r} in the cluster map")
        return info.target

    def pgs(self, volume: str) -> tuple[tuple[str, ...], ...]:
        return self.volume(volume).pgs

    def placement(self, volume: str, key: BlockKey) -> tuple[str, ...]:
        info = self.volume(volume)
        if info.target is not None:
            raise InvalidArgument(f"volume {volume!r} keeps its blocks in {info.target.url}, not on datanodes")
        return info.pgs[pg_of(key, len(info.pgs))]


class MetaClusterView:
    """A :class:`ClusterView` kept fresh from the metanodes (``meta``: a
    ``MetaClient``)."""

    def __init__(self, meta: MetaClient) -> None:
        self._meta = meta
        self.current = ClusterView([], [])

    async def refresh(self) -> ClusterView:
        self.current = ClusterView.from_map(await self._meta.query(ClusterMap()))
        return self.current

    async def run(self, interval: float = 5.0) -> None:
        """Refresh forever (start it in a nursery); failures keep the last map."""
        while True:
            try:
                await self.refresh()
            except CacheFSError as exc:
                log.warning("cluster map refresh failed, keeping epoch %d: %s", self.current.epoch, exc)
            await trio.sleep(interval)

    @property
    def datanodes(self) -> dict[str, DatanodeInfo]:
        return self.current.datanodes

    def policy(self, volume: str) -> VolumePolicy:
        return self.current.policy(volume)

    def target(self, volume: str) -> ObjectTarget | None:
        return self.current.target(volume)

    def pgs(self, volume: str) -> tuple[tuple[str, ...], ...]:
        return self.current.pgs(volume)

    def placement(self, volume: str, key: BlockKey) -> tuple[str, ...]:
        return self.current.placement(volume, key)
