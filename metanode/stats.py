"""Prometheus view of one metanode's namespace: inodes, dentries and file
bytes per volume, metadata bytes on disk, sessions, open files and leases
(the Raft gauges live in raft/driver.py).

Read from the metrics thread while trio applies commands: it takes ``len``
of dicts and sets, C-level copies of the volume and holder tables, and
counters kept as they change (a volume's dentries are its root's subtree
count), never iterating a dict the apply loop may be resizing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .namespace import ROOT
from .raft.storage import WAL_NAME

if TYPE_CHECKING:
    from .service import MetaService


class NamespaceCollector:
    """One per process (a registry takes a name once); the daemon sets ``service``."""

    service: MetaService | None = None

    def collect(self):  # type: ignore[no-untyped-def]
        service = self.service
        if service is None:
            return
        state = service.state  # replaced whole when a snapshot is installed
        inodes = GaugeMetricFamily("cachefs_metanode_inodes", "Inodes of a volume in this replica's state",
                                   labels=["volume"])
        dentries = GaugeMetricFamily("cachefs_metanode_dentries",
                                     "Directory entries of a volume (a hard link counts in each directory)",
                                     labels=["volume"])
        used = GaugeMetricFamily("cachefs_metanode_volume_used_bytes", "Bytes of file data a volume holds",
                                 labels=["volume"])
        for name, volume in list(state.volumes.items()):
            inodes.add_metric([name], len(volume.inodes))
            root = volume.inodes.get(ROOT)
            dentries.add_metric([name], root.data.uinodes if root is not None else 0)
            used.add_metric([name], volume.used_bytes)
        yield inodes
        yield dentries
        yield used
        yield from self._disk(service)
        yield from self._leases(service)
        yield GaugeMetricFamily("cachefs_metanode_sessions", "Client sessions (mounts) open",
                                value=len(state.sessions))
        yield GaugeMetricFamily("cachefs_metanode_open_files",
                                "Files some session holds open (known to this replica while it leads)",
                                value=len(service.opens.holders))

    @staticmethod
    def _disk(service: MetaService):  # type: ignore[no-untyped-def]
        """The newest snapshot and the WAL after it: what a restart reads."""
        disk = GaugeMetricFamily("cachefs_metanode_metadata_bytes",
                                 "Bytes of metadata on this replica's disk, by part (snapshot, WAL after it)",
                                 labels=["part"])
        storage = getattr(service.node, "storage", None)  # an in-process test node keeps no disk
        if storage is None:
            yield disk
            return
        snapshot = storage.snapshot
        disk.add_metric(["snapshot"], len(snapshot.data) if snapshot is not None else 0)
        try:
            disk.add_metric(["wal"], (storage.data_dir / WAL_NAME).stat().st_size)
        except OSError:  # being rewritten after a snapshot
            pass
        yield disk

    @staticmethod
    def _leases(service: MetaService):  # type: ignore[no-untyped-def]
        """Leases this replica's lease table knows: all of them while it leads, none otherwise."""
        table = service.leases
        holders = list(table.holders.values())
        held = GaugeMetricFamily("cachefs_metanode_leases", "Metadata leases sessions hold, by state",
                                 labels=["state"])
        held.add_metric(["held"], sum(len(h.held) for h in holders))
        held.add_metric(["revoking"], sum(len(h.revoking) for h in holders))
        yield held
        events = CounterMetricFamily("cachefs_metanode_lease_events",
                                     "Leases granted, revocations begun and grants refused (the inode "
                                     "changing, or a name that could still move to it) while this replica led",
                                     labels=["event"])
        events.add_metric(["granted"], table.granted)
        events.add_metric(["revoked"], table.revoked)
        events.add_metric(["refused_changing"], table.refused_changing)
        events.add_metric(["refused_moving"], table.refused_moving)
        yield events


NAMESPACE = NamespaceCollector()
REGISTRY.register(NAMESPACE)
