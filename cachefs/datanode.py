"""The datanode: an RPC service over a :class:`~cachefs.shardstore.ShardStore`.

A datanode knows nothing about blocks, policies or placement: it stores,
returns, lists and verifies shards named ``(volume, block key, shard index)``,
each with the small opaque ``meta`` (the block header) its writer gave it.
The backing-storage client (:mod:`cachefs.backing`) and repair
(:mod:`cachefs.repair`) hold all the logic.

Store calls block on disk IO (and fsync), so they run in worker threads
behind a capacity limiter; the trio thread only parses and replies.

The daemon registers itself in the metanodes' cluster map and heartbeats its
usage. Metanodes are optional: without ``--meta`` (tests, a bare lab) the
datanode just serves; with them, registration is retried in the background
until it succeeds and never stops the datanode from serving.
"""

from __future__ import annotations

import logging
import signal
import ssl
import uuid
from pathlib import Path
from typing import Any

import click
import trio
from prometheus_client import Gauge

from cachefs.config import (
    ADDR,
    ADDRS,
    SIZE,
    daemon_options,
    load_secret,
    load_tls,
    setup_logging,
    tls_options,
)
from cachefs.erasure import keep_large_buffers
from cachefs.errors import InvalidArgument
from cachefs.ids import BlockKey
from cachefs.membership import Registrar, persistent_node_id
from cachefs.metrics import start_metrics
from cachefs.rpc import Limits, Reply, RpcPool, RpcServer, parse_addr, rpc_method
from cachefs.shardstore import ShardStore, check_volume

log = logging.getLogger(__name__)

IO_THREADS = 8
SCRUB_PAGE = 256

_CAPACITY = Gauge("cachefs_datanode_capacity_bytes", "Bytes this datanode may store")
_USED = Gauge("cachefs_datanode_used_bytes", "Bytes of shards stored")
_SHARDS = Gauge("cachefs_datanode_shards", "Shards stored")
_CORRUPT = Gauge("cachefs_datanode_corrupt_shards_found", "Corrupt shards detected (and dropped) since start")


def _key_hex(key: bytes) -> str:
    try:
        return BlockKey.from_bytes(key).hex()
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


class DatanodeService:
    """The datanode's RPC methods (see docs/contracts.md, "Backing storage")."""

    def __init__(self, store: ShardStore, node_id: str, zone: str) -> None:
        self.store = store
        self.node_id = node_id
        self.zone = zone
        self._io = trio.CapacityLimiter(IO_THREADS)
        _CAPACITY.set_function(lambda: store.capacity)
        _USED.set_function(lambda: store.used)
        _SHARDS.set_function(lambda: store.shard_count)
        _CORRUPT.set_function(lambda: store.corrupt_found)

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._io)

    @rpc_method
    async def put(self, volume: str, key: bytes, index: int, meta: bytes = b"",
                  payload: Any = None) -> dict:
        """Store shard ``index`` of ``key`` durably (replacing any older copy)."""
        data = payload if payload is not None else b""
        await self._run(self.store.put, volume, _key_hex(key), index, meta, data)
        return {"size": len(data)}

    @rpc_method
    async def get(self, volume: str, key: bytes, index: int, offset: int = 0,
                  length: int = -1) -> Reply:
        """Bytes of one shard (checksums verified); ``meta`` and total size ride along."""
        meta, data, total = await self._run(self.store.get, volume, _key_hex(key), index,
                                            offset, length)
        return Reply({"meta": meta, "size": total}, payload=data)

    @rpc_method
    async def stat(self, volume: str, key: bytes, index: int) -> dict:
        meta, size = await self._run(self.store.stat, volume, _key_hex(key), index)
        return {"meta": meta, "size": size}

    @rpc_method
    async def delete(self, volume: str, key: bytes, index: int = -1) -> dict:
        """Delete one shard, or every shard of the key held here (index -1)."""
        return {"removed": await self._run(self.store.delete, volume, _key_hex(key), index)}

    @rpc_method(name="list")
    async def list_shards(self, volume: str, cursor: str = "", limit: int = 1000) -> dict:
        """A page of ``[key, index, bytes]``; page on with the returned cursor until it is ""."""
        limit = min(max(1, limit), 10_000)
        page, cursor = await self._run(self.store.list, volume, cursor, limit)
        return {"shards": [[BlockKey.from_hex(s.key).to_bytes(), s.index, s.size] for s in page],
                "cursor": cursor}

    @rpc_method
    async def scrub(self, volume: str, cursor: str = "", limit: int = SCRUB_PAGE,
                    max_bytes: int = 0) -> dict:
        """Verify a page of shards end to end; corrupt ones are removed and named.

        ``max_bytes`` (0: no cap) ends the page early once that many bytes
        were read (one shard at least), so a rate-limited scrub reads in
        small steps instead of bursts of ``limit`` shards; ``bytes`` in the
        answer is what was read, for the caller's throttle.
        """
        limit = min(max(1, limit), 10_000)
        page, cursor = await self._run(self.store.list, volume, cursor, limit)
        corrupt = []
        checked = read = 0
        for info in page:
            if not await self._run(self.store.verify, volume, info.key, info.index):
                corrupt.append([BlockKey.from_hex(info.key).to_bytes(), info.index])
            checked += 1
            read += info.size
            if 0 < max_bytes <= read and checked < len(page):
                cursor = self.store.cursor_after(info)
                break
        return {"checked": checked, "corrupt": corrupt, "cursor": cursor, "bytes": read}

    @rpc_method
    async def volumes(self) -> list:
        return await self._run(self.store.volumes)

    @rpc_method
    async def stats(self) -> dict:
        return {"id": self.node_id, "zone": self.zone, **self.store.usage(),
                "corrupt_found": self.store.corrupt_found}


# ---------------------------------------------------------------- cluster map

async def serve(store: ShardStore, *, node_id: str, zone: str, listen: str, advertise: str | None,
                secret: bytes | None, meta: list[str] | None, heartbeat: float,
                tls: tuple[ssl.SSLContext | None, ssl.SSLContext | None] = (None, None)) -> None:
    """Run the datanode until SIGINT/SIGTERM, then drain calls in flight.

    ``tls`` is load_tls's (server, client) pair: None, None for plain TCP.
    """
    host, port = parse_addr(listen)
    service = DatanodeService(store, node_id, zone)
    server = RpcServer(service, name="datanode", secret=secret, limits=Limits(), tls=tls[0])
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(server.serve, host, port)
            addr = advertise or f"{host}:{bound}"
            log.info("datanode %s zone %s serving %s on %s (%d shards, %d of %d bytes used)",
                     node_id, zone, store.root, addr, store.shard_count, store.used, store.capacity)
            pool: RpcPool | None = None
            if meta:
                from cachefs.metanode.client import MetaClient

                pool = RpcPool(secret=secret, tls=tls[1])
                await pool.__aenter__()
                client = MetaClient(pool, meta, client_id=f"datanode-{node_id}-{uuid.uuid4().hex[:8]}",
                                    deadline=max(2.0, heartbeat), attempt_timeout=2.0)
                nursery.start_soon(Registrar(client, kind="datanode", node_id=node_id, addr=addr, zone=zone,
                                             capacity=store.capacity, used=lambda: store.used,
                                             interval=heartbeat).run)
            try:
                async for signum in signals:
                    log.info("signal %d: shutting down", signum)
                    break
                await server.shutdown(grace=5.0)
            finally:
                if pool is not None:
                    await pool.__aexit__(None, None, None)
                nursery.cancel_scope.cancel()


@click.command("datanode")
@click.option("--zone", required=True, help="Failure domain (rack, AZ) of this datanode.")
@click.option("--data-dir", required=True, type=click.Path(file_okay=False),
              help="Directory that holds the shards (created if missing).")
@click.option("--capacity", required=True, type=SIZE, help="Bytes this datanode may store, e.g. 500G.")
@click.option("--listen", type=ADDR, default="127.0.0.1:7300", show_default=True,
              help="host:port to serve on (port 0: any free port).")
@click.option("--advertise", type=ADDR, default=None,
              help="host:port to register in the cluster map (default: the listen address).")
@click.option("--meta", type=ADDRS, default=None,
              help="Metanode addresses (comma separated); omit to run without registration.")
@click.option("--node-id", default=None, help="Datanode id (default: generated once, kept in the data dir).")
@click.option("--heartbeat", type=click.FloatRange(0.1, 3600), default=5.0, show_default=True,
              help="Seconds between heartbeats to the metanodes.")
@click.option("--no-fsync", is_flag=True, help="Skip fsync (benchmarks only: not crash safe).")
@daemon_options
@tls_options
def command(zone: str, data_dir: str, capacity: int, listen: str, advertise: str | None,
            meta: list[str] | None, node_id: str | None, heartbeat: float, no_fsync: bool,
            secret_file: str | None, insecure: bool, log_level: str, metrics_port: int,
            tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> None:
    """Run a datanode: store erasure-coded or replicated shards on local disk."""
    setup_logging("datanode", log_level)
    keep_large_buffers()  # 1 MiB shard buffers: reuse heap memory instead of fresh mmaps
    secret = load_secret(secret_file, insecure)
    tls = load_tls(tls_cert, tls_key, tls_ca)
    try:
        check_volume(zone)  # same character rules as volume names: safe in paths and logs
    except InvalidArgument:
        raise click.BadParameter(f"{zone!r}: use 1-64 of [A-Za-z0-9._-]", param_hint="--zone") from None
    root = Path(data_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        ident = persistent_node_id(root, node_id, "datanode", "dn")
        store = ShardStore(root, capacity, durable=not no_fsync)
    except OSError as exc:
        raise click.UsageError(f"--data-dir {data_dir}: {exc.strerror}") from None
    start_metrics(metrics_port)
    trio.run(lambda: serve(store, node_id=ident, zone=zone, listen=listen, advertise=advertise,
                           secret=secret, meta=meta, heartbeat=heartbeat, tls=tls))
