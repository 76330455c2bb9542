"""The repair service: the metanode leader brings blocks stored short back to full redundancy.

Theory of operation. A put is acknowledged once ``write_quorum`` shards are
stored (K+1 of K+M, 2 of 3 replicas), so a datanode that is down or slow
leaves a block short. The writer names such blocks in the commit of their
slice (``WriteSlice.short``, ``CompactChunk.short``), which puts them in the
volume's repair queue in the same log entry: the record is exactly as
durable as the data it describes, and a block is queued only if its slice is
committed (a writer that dies before its commit leaves garbage for the
collector, not work for repair).

While this replica leads, every ``interval`` seconds and for each volume it
takes up to ``batch`` queued blocks, oldest first, whose placement group is
all up in the cluster map (a block waiting for a down datanode is skipped,
so it cannot hold up the rest of the queue), and repairs them
(:meth:`~cachefs.backing.repair.Repairer.repair_keys`: one stat per shard
slot, rebuild what is missing, move handed-off copies home). The blocks found
whole leave the queue (``RepairsDone``, a leader-only command); the rest stay
for the next pass, tried again after a backoff that doubles up to
``RETRY_FAILED`` seconds (a datanode the map shows up may still be starting;
a block with fewer than K shards anywhere cannot be rebuilt until one comes
back, and is logged each time). Writes
go through the repairer's byte-rate limit (``--repair-rate``), so repair
leaves bandwidth to clients. Blocks of a slice purged from the trash leave the
queue with it (the collector deleted them).

Every replica exports its copy of the queue's length per volume as
``cachefs_blocks_under_replicated`` (the state is replicated, so they agree).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import trio
from prometheus_client import Gauge

from cachefs.backing.repair import Repairer, RepairReport
from cachefs.errors import CacheFSError
from cachefs.ids import BlockKey
from cachefs.rpc import RpcPool

if TYPE_CHECKING:
    from .service import MetaService

log = logging.getLogger(__name__)

REPAIR_INTERVAL = 2.0
REPAIR_RATE = 100 << 20  # bytes/s written by repair, all datanodes together
BATCH = 256  # blocks per volume per pass
RETRY_FAILED = 60.0

UNDER_REPLICATED = Gauge("cachefs_blocks_under_replicated",
                         "Blocks stored with fewer than all their shards, waiting for repair", ["volume"])


class RepairService:
    """The loop of the module docstring; ``repairer`` reads the cluster map through ``view``."""

    def __init__(self, service: MetaService, repairer: Repairer, *, interval: float = REPAIR_INTERVAL,
                 batch: int = BATCH) -> None:
        self.service = service
        self.repairer = repairer
        self.interval = interval
        self.batch = batch
        self._failed: dict[tuple[str, BlockKey], tuple[int, float]] = {}  # -> (tries, when to try again)

    async def run(self) -> None:
        while True:
            await trio.sleep(self.interval)
            self.export()
            node = self.service.node
            if node is None or not node.is_leader:
                self._failed.clear()
                continue
            try:
                await self.repairer.view.refresh()
                for volume in sorted(self.service.state.volumes):
                    await self.repair_pass(volume)
            except CacheFSError as exc:
                log.warning("repair pass failed, will retry: %s", exc)

    def export(self) -> None:
        for name, vol in list(self.service.state.volumes.items()):
            UNDER_REPLICATED.labels(name).set(len(vol.repairs))

    async def repair_pass(self, volume: str) -> int:
        """Repair up to ``batch`` queued blocks of ``volume``; returns how many left the queue."""
        vol = self.service.state.volumes.get(volume)
        for gone in [k for k in self._failed if k[0] == volume and (vol is None or k[1] not in vol.repairs)]:
            del self._failed[gone]  # left the queue another way (its slice was purged)
        if vol is None or not vol.repairs:
            return 0
        view = self.repairer.view
        up = {n for n, info in view.datanodes.items() if info.state == "up"}
        now = time.monotonic()
        keys = []
        for slice_id, index in vol.repairs:  # no await in this loop: applies cannot change it
            key = BlockKey(slice_id, index)
            if self._failed.get((volume, key), (0, 0.0))[1] > now or not up.issuperset(view.placement(volume, key)):
                continue
            keys.append(key)
            if len(keys) == self.batch:
                break
        if not keys:
            return 0
        report = RepairReport(volume=volume)
        whole = await self.repairer.repair_keys(volume, keys, report)
        for key in set(keys) - set(whole):
            tries = self._failed.get((volume, key), (0, 0.0))[0] + 1
            self._failed[(volume, key)] = (tries, now + min(RETRY_FAILED, self.interval * 2 ** min(tries, 16)))
        for key in whole:
            self._failed.pop((volume, key), None)
        done = await self.service.repairs_done(volume, whole) if whole else 0
        log.info("repair of %s: %d of %d blocks whole (%d shards rebuilt, %d moved), %d still queued",
                 volume, len(whole), len(keys), report.shards_rebuilt, report.shards_moved,
                 len(vol.repairs))
        return done


async def run_repairs(service: MetaService, pool: RpcPool, addrs: list[str], interval: float,
                      rate: int | None) -> None:
    """The repair service of this replica (acting only while it leads)."""
    from cachefs.backing.client import BackingClient
    from cachefs.backing.cluster import MetaClusterView

    from .client import MetaClient

    view = MetaClusterView(MetaClient(pool, addrs, deadline=max(5.0, interval)))
    await RepairService(service, Repairer(BackingClient(pool, view), rate=rate), interval=interval).run()
