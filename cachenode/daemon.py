"""``cachefs cachenode``: run one cache node of a zone's flash group.

The daemon opens the block store (rebuilding its index from disk, so a node
restarted after a crash serves what it had), serves the cache RPC methods,
reads misses through :class:`cachefs.backing.client.BackingClient` using the cluster
map from the metanodes, registers itself in that map and heartbeats its usage.

Metanodes are optional, as for the datanode: without ``--meta`` (tests, a bare
lab) the node serves hits and write-through puts, and a read-through miss
answers ``Unavailable`` since there is no backing storage to read from. With
them, registration is retried in the background and never stops serving.

The cache directory is locked (``flock``) so two nodes can never share one.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import signal
import ssl
import time
from pathlib import Path
from typing import Any

import click
import trio

from cachefs import sdnotify
from cachefs.backing.codec import keep_large_buffers
from cachefs.blockstore import BlockStore
from cachefs.buffers import BufferPool
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
from cachefs.credentials import as_credential
from cachefs.errors import CacheFSError, Unavailable
from cachefs.ids import BlockKey
from cachefs.logs import with_reload
from cachefs.membership import Registrar, persistent_node_id
from cachefs.metrics import MetricsAddr, start_metrics
from cachefs.queries import ClusterMap
from cachefs.rpc import Limits, RpcPool, RpcServer, parse_addr

from .admission import SecondMissAdmission
from .peers import HANDOFF_WINDOW, PeerZones
from .service import CacheLimits, CacheService

log = logging.getLogger(__name__)

LIMITS = CacheLimits()  # the library's defaults are the command line's


class NoBacking:
    """The read-through source of a node started without metanodes."""

    async def get_block(self, volume: str, key: BlockKey) -> bytes:
        raise Unavailable(f"no backing storage configured (no --meta): cannot fill {key.hex()}")


def lock_dir(cache_dir: Path) -> int:
    """Hold an exclusive lock on the cache directory for the life of the process."""
    fd = os.open(cache_dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise click.UsageError(f"--cache-dir {cache_dir} is in use by another cachenode") from None
    return fd


def add_rdma(server: RpcServer, service: CacheService) -> bool:
    """Serve ``rdma_get`` too when this machine has an RDMA device; else TCP only."""
    from cachefs.transport import RdmaUnavailable
    from cachefs.transport.rdma import RdmaResponder, probe_device

    try:
        device = probe_device()
        server.add_service(RdmaResponder(device, service.read_range))
    except RdmaUnavailable as exc:
        log.info("RDMA not available (%s): serving blocks over TCP only", exc)
        return False
    log.info("serving blocks over RDMA on %s as well as TCP", device.name)
    return True


async def serve(
    store: BlockStore,
    *,
    node_id: str,
    zone: str,
    listen: str,
    advertise: str | None,
    secret: bytes | None,
    meta: list[str] | None,
    heartbeat: float,
    limits: CacheLimits,
    admission: SecondMissAdmission | None,
    rdma: bool = True,
    tls: tuple[ssl.SSLContext | None, ssl.SSLContext | None] = (None, None),
    handoff_window: float = HANDOFF_WINDOW,
) -> None:
    """Run the cache node until SIGINT/SIGTERM, then drain calls in flight.

    ``tls`` is load_tls's (server, client) pair: None, None for plain TCP.
    """
    host, port = parse_addr(listen)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        own = as_credential(secret, f"cachenode-{node_id}")
        async with trio.open_nursery() as nursery, RpcPool(secret=own, tls=tls[1]) as pool:
            backing: Any = NoBacking()
            buffers = BufferPool(keep=8)  # fill buffers, shared by the backing client and the service
            meta_client = None
            if meta:
                from cachefs.backing.client import BackingClient
                from cachefs.backing.cluster import MetaClusterView
                from cachefs.metanode.client import MetaClient

                meta_client = MetaClient(
                    pool, meta, client_id=f"cachenode-{node_id}", deadline=max(5.0, heartbeat)
                )
                view = MetaClusterView(meta_client)
                nursery.start_soon(view.run)
                from cachefs.repo.source import RepoBlocks

                # blocks of imported files come from their buckets, the rest from the datanodes
                backing = RepoBlocks(BackingClient(pool, view, zone=zone, buffers=buffers), meta_client.query)
            peers = None
            if meta_client is not None:
                peers = PeerZones(pool, zone, node_id, functools.partial(meta_client.query, ClusterMap()),
                                  handoff_window=handoff_window)  # fmt: skip
                nursery.start_soon(peers.run)
            service = CacheService(
                store, backing, nursery=nursery, limits=limits, admission=admission, node=node_id,
                peers=peers, buffers=buffers,
            )  # fmt: skip
            server = RpcServer(service, name="cachenode", secret=secret, limits=Limits(), tls=tls[0])
            if rdma:
                add_rdma(server, service)
            bound = await nursery.start(server.serve, host, port)
            addr = advertise or f"{host}:{bound}"
            log.info(
                "cachenode %s zone %s serving %s on %s (%d blocks, %d of %d bytes used)",
                node_id,
                zone,
                store.root,
                addr,
                len(store),
                store.used,
                store.capacity,
            )
            sdnotify.serving(nursery, f"cachenode {node_id} zone {zone} serving on {addr}")
            if meta_client is not None:
                registrar = Registrar(
                    meta_client,
                    kind="cachenode",
                    node_id=node_id,
                    addr=addr,
                    zone=zone,
                    capacity=store.capacity,
                    used=lambda: store.used,
                    interval=heartbeat,
                )
                nursery.start_soon(registrar.run)
            async for signum in signals:
                log.info("signal %d: shutting down", signum)
                break
            await server.shutdown(grace=5.0)
            nursery.cancel_scope.cancel()


def _parse_ttl(values: tuple[str, ...]) -> dict[str, float]:
    ttl: dict[str, float] = {}
    for item in values:
        volume, sep, seconds = item.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if not sep or not volume or value <= 0:
            raise click.BadParameter(
                f"{item!r}: use VOLUME=SECONDS, e.g. scratch=3600", param_hint="--ttl"
            )
        ttl[volume] = value
    return ttl


@click.command("cachenode")
@click.option("--zone", required=True, help="Zone (flash group) this cache node serves.")
@click.option(
    "--cache-dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Directory on local flash for cached blocks (created if missing).",
)
@click.option("--capacity", required=True, type=SIZE, help="Bytes of flash to use, e.g. 200G.")
@click.option(
    "--memory",
    type=SIZE,
    default=0,
    show_default=True,
    help="Bytes of memory for the hottest blocks (0: no memory tier).",
)
@click.option(
    "--listen",
    type=ADDR,
    default="127.0.0.1:7400",
    show_default=True,
    help="host:port to serve on.",
)
@click.option(
    "--advertise",
    type=ADDR,
    default=None,
    help="host:port to register in the cluster map (default: the listen address).",
)
@click.option(
    "--meta",
    type=ADDRS,
    default=None,
    help="Metanode addresses (comma separated); omit to run without backing storage.",
)
@click.option(
    "--node-id",
    default=None,
    help="Cache node id (default: generated once, kept in the cache dir).",
)
@click.option(
    "--heartbeat",
    type=click.FloatRange(0.1, 3600),
    default=5.0,
    show_default=True,
    help="Seconds between heartbeats to the metanodes.",
)
@click.option(
    "--ttl",
    multiple=True,
    metavar="VOLUME=SECONDS",
    help="Expire a volume's blocks this long after they were cached (repeatable).",
)
@click.option(
    "--admission/--no-admission",
    default=False,
    show_default=True,
    help="Cache a read-through miss only on its second miss within --admission-window "
    "(scan resistance; warm-up and write-through always cache).",
)
@click.option(
    "--admission-window",
    type=click.FloatRange(1, 86400),
    default=300.0,
    show_default=True,
    help="Seconds within which a second miss admits a block.",
)
@click.option(
    "--max-requests",
    type=click.IntRange(1, 1 << 20),
    default=LIMITS.max_requests,
    show_default=True,
    help="Concurrent get/put requests before answering busy.",
)
@click.option(
    "--max-per-client",
    type=click.IntRange(1, 1 << 20),
    default=LIMITS.max_per_client,
    show_default=True,
    help="Concurrent requests per client connection before answering busy.",
)
@click.option(
    "--max-backing-fetches",
    type=click.IntRange(1, 4096),
    default=LIMITS.max_backing_fetches,
    show_default=True,
    help="Concurrent whole-block fetches from backing storage.",
)
@click.option(
    "--handoff-window",
    type=click.FloatRange(0),
    default=HANDOFF_WINDOW,
    show_default=True,
    help="Seconds after a ring change in this zone in which a miss asks the block's previous owner "
    "first (0: never; the hit rate then drops by the share of keys that moved).",
)
@click.option(
    "--rdma/--no-rdma",
    default=True,
    show_default=True,
    help="Also serve blocks over RDMA when this machine has an RDMA device.",
)
@daemon_options("cachenode")
@tls_options
def command(
    zone: str,
    cache_dir: str,
    capacity: int,
    memory: int,
    listen: str,
    advertise: str | None,
    meta: list[str] | None,
    node_id: str | None,
    heartbeat: float,
    ttl: tuple[str, ...],
    admission: bool,
    admission_window: float,
    max_requests: int,
    max_per_client: int,
    max_backing_fetches: int,
    handoff_window: float,
    rdma: bool,
    secret_file: str | None,
    insecure: bool,
    log_level: str,
    log_format: str,
    log_file: str | None,
    metrics_addr: MetricsAddr, no_metrics: bool,
    tls_cert: str | None,
    tls_key: str | None,
    tls_ca: str | None,
) -> None:
    """Run a cache node: blocks on local flash, read through from backing storage."""
    setup_logging("cachenode", log_level, log_format, log_file, stderr_too=True)
    keep_large_buffers()  # block-sized read and fill buffers: reuse heap memory, no fresh mmaps
    # A read lease broken in the instant between F_SETLEASE and F_SETOWN 0
    # (cachefs/blockstore.py) would raise SIGIO at us, and its default is to die.
    signal.signal(signal.SIGIO, signal.SIG_IGN)
    secret = load_secret(secret_file, insecure, cluster=True)
    tls = load_tls(tls_cert, tls_key, tls_ca)
    if capacity <= 0:
        raise click.BadParameter("must be more than 0 bytes", param_hint="--capacity")
    ttls = _parse_ttl(ttl)
    root = Path(cache_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = lock_dir(root)
        ident = persistent_node_id(root, node_id, "cachenode", "cn")
        started = time.perf_counter()
        store = BlockStore.open(root, capacity, memory_capacity=memory, ttl=ttls)
    except OSError as exc:
        raise click.UsageError(f"--cache-dir {cache_dir}: {exc.strerror}") from None
    except CacheFSError as exc:
        raise click.UsageError(f"--cache-dir {cache_dir}: {exc.message}") from None
    log.info(
        "cache index rebuilt in %.2fs: %d blocks, %d bytes",
        time.perf_counter() - started,
        len(store),
        store.used,
    )
    limits = CacheLimits(
        max_requests=max_requests,
        max_per_client=max_per_client,
        max_backing_fetches=max_backing_fetches,
    )
    start_metrics(None if no_metrics else metrics_addr)
    try:
        trio.run(
            with_reload,
            lambda: serve(
                store,
                node_id=ident,
                zone=zone,
                listen=listen,
                advertise=advertise,
                secret=secret,
                meta=meta,
                heartbeat=heartbeat,
                limits=limits,
                admission=SecondMissAdmission(window=admission_window) if admission else None,
                rdma=rdma,
                tls=tls,
                handoff_window=handoff_window,
            )
        )
    finally:
        os.close(lock)
