"""Prometheus view of one metanode's namespace: inodes and metadata bytes per
volume, sessions and open files (the Raft gauges live in raft/driver.py).

Read from the metrics thread while trio applies commands: it takes ``len``
of dicts and one C-level copy of the volume table, never iterating a dict
the apply loop may be resizing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily

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
        used = GaugeMetricFamily("cachefs_metanode_volume_used_bytes", "Bytes of file data a volume holds",
                                 labels=["volume"])
        for name, volume in list(state.volumes.items()):
            inodes.add_metric([name], len(volume.inodes))
            used.add_metric([name], volume.used_bytes)
        yield inodes
        yield used
        yield GaugeMetricFamily("cachefs_metanode_sessions", "Client sessions (mounts) open",
                                value=len(state.sessions))
        yield GaugeMetricFamily("cachefs_metanode_open_files",
                                "Files some session holds open (known to this replica while it leads)",
                                value=len(service.opens.holders))


NAMESPACE = NamespaceCollector()
REGISTRY.register(NAMESPACE)
