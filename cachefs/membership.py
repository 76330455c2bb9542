"""How a datanode or cache node joins the cluster map and stays in it.

Both kinds of node keep a stable id in their data directory (so a restarted
node is the same node: same ring position, same placement groups), register
with the metanodes and then heartbeat their usage. Failure is soft by design:
errors are logged once per kind and retried on the next tick, because a node
must keep serving whether or not the metadata service is reachable.
Registration is a logged mutation deduplicated by (client id, seq); a fresh
client id per process means a restarted node registers again.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click
import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.errors import CacheFSError, NotFound

if TYPE_CHECKING:
    from cachefs.metanode.client import MetaClient

log = logging.getLogger(__name__)


def persistent_node_id(data_dir: Path, given: str | None, kind: str, prefix: str) -> str:
    """The node id kept in ``data_dir/NODE_ID``, created on first start.

    Raises:
        click.UsageError: ``given`` disagrees with the id the directory has.
    """
    path = data_dir / "NODE_ID"
    if path.exists():
        stored = path.read_text().strip()
        if given and given != stored:
            raise click.UsageError(f"--node-id {given} but {data_dir} belongs to {kind} {stored}")
        return stored
    node_id = given or f"{prefix}-{uuid.uuid4().hex[:12]}"
    tmp = data_dir / "NODE_ID.tmp"
    tmp.write_text(node_id + "\n")
    os.replace(tmp, path)
    return node_id


class Registrar:
    """Registers one node in the cluster map and heartbeats its usage."""

    def __init__(self, meta: MetaClient, *, kind: str, node_id: str, addr: str, zone: str,
                 capacity: int, used: Callable[[], int], interval: float) -> None:
        self.meta = meta
        self.kind = kind
        self.node_id = node_id
        self.addr = addr
        self.zone = zone
        self.capacity = capacity
        self.used = used
        self.interval = interval
        self.registered = False
        self._last_error = ""

    async def tick(self) -> None:
        if not self.registered:
            await self.meta.mutate(
                C.RegisterNode(self.kind, self.node_id, self.addr, self.zone, self.capacity)
            )
            self.registered = True
            log.info("registered as %s %s (%s) in zone %s", self.kind, self.node_id, self.addr, self.zone)
        try:
            await self.meta.query(Q.NodeHeartbeat(self.kind, self.node_id, self.used()))
        except NotFound:
            self.registered = False  # the map forgot us (removed by an operator?): register again
            raise

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
                self._last_error = ""
            except CacheFSError as exc:
                if str(exc) != self._last_error:
                    log.warning("metanodes not reachable for registration/heartbeat: %s", exc)
                    self._last_error = str(exc)
            await trio.sleep(self.interval)
