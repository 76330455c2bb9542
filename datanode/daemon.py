"""The datanode daemon: serve a shard store, register in the cluster map.

Metanodes are optional: without ``--meta`` (tests, a bare lab) the datanode
just serves; with them, registration is retried in the background until it
succeeds and never stops the datanode from serving.
"""

from __future__ import annotations

import logging
import signal
import ssl
import uuid
from pathlib import Path

import click
import trio

from cachefs import sdnotify
from cachefs.backing.codec import keep_large_buffers
from cachefs.config import (
    ADDR,
    ADDRS,
    SIZE,
    DaemonGroup,
    daemon_options,
    load_secret,
    load_tls,
    setup_logging,
    tls_options,
)
from cachefs.credentials import as_credential
from cachefs.errors import InvalidArgument
from cachefs.logs import with_reload
from cachefs.membership import Registrar, persistent_node_id
from cachefs.metrics import MetricsAddr, start_metrics
from cachefs.rpc import Limits, RpcPool, RpcServer, parse_addr

from .drain import drain_command, remove_command
from .service import DatanodeService
from .shardstore import ShardStore, check_volume

log = logging.getLogger(__name__)


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
            sdnotify.serving(nursery, f"datanode {node_id} zone {zone} serving on {addr}")
            pool: RpcPool | None = None
            if meta:
                from cachefs.metanode.client import MetaClient

                pool = RpcPool(secret=as_credential(secret, f"datanode-{node_id}"), tls=tls[1])
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


@click.group("datanode", cls=DaemonGroup, run_requires=("zone", "data_dir", "capacity"))
@click.option("--zone", help="Failure domain (rack, AZ) of this datanode. Required to run one.")
@click.option("--data-dir", type=click.Path(file_okay=False),
              help="Directory that holds the shards (created if missing). Required to run one.")
@click.option("--capacity", type=SIZE, help="Bytes this datanode may store, e.g. 500G. Required to run one.")
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
@daemon_options("datanode")
@tls_options
@click.pass_context
def command(ctx: click.Context, zone: str | None, data_dir: str | None, capacity: int | None, listen: str,
            advertise: str | None,
            meta: list[str] | None, node_id: str | None, heartbeat: float, no_fsync: bool,
            secret_file: str | None, insecure: bool, log_level: str, log_format: str, log_file: str | None,
            metrics_addr: MetricsAddr, no_metrics: bool, tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> None:
    """Run a datanode: store erasure-coded or replicated shards on local disk (or,
    with a subcommand, drain one or remove it from the cluster map)."""
    if ctx.invoked_subcommand is not None:
        return
    ctx.command.check_run(ctx)  # type: ignore[attr-defined]
    assert zone is not None and data_dir is not None and capacity is not None
    setup_logging("datanode", log_level, log_format, log_file, stderr_too=True)
    keep_large_buffers()  # 1 MiB shard buffers: reuse heap memory instead of fresh mmaps
    secret = load_secret(secret_file, insecure, cluster=True)
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
    start_metrics(None if no_metrics else metrics_addr)
    trio.run(with_reload, lambda: serve(store, node_id=ident, zone=zone, listen=listen, advertise=advertise,
                                        secret=secret, meta=meta, heartbeat=heartbeat, tls=tls))


command.add_command(drain_command)
command.add_command(remove_command)
