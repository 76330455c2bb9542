"""``cachefs metanode``: run one metadata replica (Raft + the namespace state machine).

    cachefs metanode --id 1 --peers 1=10.0.0.1:7100,2=10.0.0.2:7100,3=10.0.0.3:7100 \\
        --data-dir /var/lib/cachefs/meta --secret-file /etc/cachefs/secret

The replica opens its WAL and newest snapshot in ``--data-dir`` (restoring
the exact state it had), serves the metanode RPC methods and Raft's own on
``--listen`` (default: its own entry in ``--peers``), and runs until SIGINT
or SIGTERM. ``--peers`` is a new cluster's first configuration; once the
metanodes change (``cachefs metanode add/remove/replace``, ``members.py``)
the configuration in the log counts. A metanode that joins a running
cluster starts with ``--join`` (``--peers`` then only says where the others
are) and waits as a learner until the leader adds it.

A new cluster can also start from one metanode (``--peers 1=ADDR``: it
elects itself at once) and grow with ``cachefs metanode add``: then no
first election waits for every replica (a new disk of a multi-replica
configuration asks all its peers first, see ``raft/core.py``).

Whichever replica leads also collects garbage every ``--gc-interval``
seconds: the blocks of slices trashed more than ``--gc-grace`` seconds ago
(and before every file open it knows of; nothing while it does not yet know
every session's opens) are deleted from the datanodes, then purged from the
trash (``cachefs/backing/gc.py``; ``MetaService.gc_cutoff``). Once a grace
it also seals the slice ids allocated a grace ago (``SealSlices``) and
deletes the leaked blocks of sealed slices nothing references (uploads
never committed: ``GarbageCollector.sweep``). It repairs the blocks
writes stored short every ``--repair-interval`` seconds, writing at most
``--repair-rate`` bytes/s (``metanode/repairs.py``).
"""

from __future__ import annotations

import collections
import functools
import logging
import signal
import ssl
import time
from pathlib import Path

import click
import trio

from cachefs import sdnotify
from cachefs.commands import check_addr
from cachefs.config import (
    ADDR,
    SIZE,
    DaemonGroup,
    daemon_options,
    load_secret,
    load_tls,
    setup_logging,
    tls_options,
)
from cachefs.credentials import as_credential, metanode_name
from cachefs.errors import CacheFSError, InvalidArgument
from cachefs.logs import with_reload
from cachefs.metrics import MetricsAddr, start_metrics
from cachefs.rpc import Limits, RpcPool, RpcServer, parse_addr

from . import members
from .leases import DEFAULT_TERM
from .namespace import MetaState
from .raft.driver import DriverConfig, RaftNode
from .repairs import REPAIR_INTERVAL, REPAIR_RATE, run_repairs
from .service import NODE_TIMEOUT, SESSION_TIMEOUT, MetaService
from .stats import NAMESPACE

log = logging.getLogger(__name__)

GC_INTERVAL = 60.0
EXPORT_TICK = 1.0  # how soon after close() the leader looks at the export queues
GC_GRACE = 600.0
FULL_SWEEP_EVERY = 6  # leak sweeps (one a grace): every sixth looks at every slice, not only new ones


def parse_peers(text: str) -> dict[int, str]:
    """``1=host:port,2=host:port,...`` -> {1: "host:port", ...}."""
    peers: dict[int, str] = {}
    for part in text.split(","):
        ident, sep, addr = part.strip().partition("=")
        if not sep or not ident.strip().isdigit() or int(ident) < 1:
            raise InvalidArgument(f"peer {part.strip()!r}: expected ID=host:port with ID >= 1")
        if int(ident) in peers:
            raise InvalidArgument(f"peer id {ident} given twice")
        peers[int(ident)] = check_addr(addr.strip())
    if len(peers) % 2 == 0:
        log.warning(
            "%d metanodes: an odd number tolerates as many failures with one fewer", len(peers)
        )
    return peers


async def run_gc(
    service: MetaService, pool: RpcPool, addrs: list[str], interval: float, grace: float
) -> None:
    """Collect every volume's trash while this replica leads (see module docstring)."""
    from cachefs.backing.client import BackingClient
    from cachefs.backing.cluster import MetaClusterView
    from cachefs.backing.gc import GarbageCollector

    from .client import MetaClient

    meta = MetaClient(pool, addrs, deadline=max(5.0, interval))
    view = MetaClusterView(meta)
    gc = GarbageCollector(meta, BackingClient(pool, view), grace=grace)
    # (when, next_slice) as this replica applied it: every id below was
    # allocated by then, leader or not, so the marks outlive a failover.
    marks: collections.deque[tuple[float, int]] = collections.deque()
    ready = 0  # the newest mark at least a grace old: the floor to seal at
    swept = trio.current_time()
    since, sweeps = 0, 0  # the floor of the last clean sweep; sweeps done
    while True:
        await trio.sleep(interval)
        now = trio.current_time()
        marks.append((now, service.state.next_slice))
        while marks and marks[0][0] <= now - grace:
            ready = marks.popleft()[1]
        node = service.node
        if node is None or not node.is_leader:
            continue
        try:
            await view.refresh()
            for volume in sorted(service.state.volumes):
                before = service.gc_cutoff(volume, grace)
                if before is None:
                    log.info("gc of %s waits: not every session's opens are known yet", volume)
                    continue
                report = await gc.collect(volume, before_ns=before)
                for err in report.errors:
                    log.warning("gc of %s: %s", volume, err)
            if now - swept >= grace:  # at most once a grace: a sweep lists every datanode
                swept = now
                if ready > service.state.slice_floor:
                    await service.seal_slices(ready)
                floor, clean = service.state.slice_floor, True
                datanodes = [n.addr for n in view.datanodes.values() if n.state == "up"]
                for volume in sorted(service.state.volumes):
                    report = await gc.sweep(volume, datanodes, since=0 if sweeps % FULL_SWEEP_EVERY == 0 else since)
                    for err in report.errors:
                        log.warning("gc of %s: %s", volume, err)
                    clean = clean and not report.errors
                sweeps += 1
                since = floor if clean else since
        except CacheFSError as exc:
            log.warning("gc pass failed, will retry: %s", exc)


async def run_exports(service: MetaService, pool: RpcPool, addrs: list[str], tick: float = EXPORT_TICK) -> None:
    """Work off the export queues of repository links while this replica
    leads (``metanode/exports.py``, ``cachefs/repo/exporter.py``): every
    ``tick``, one batch of each link's due records. A new leader picks up
    the queue where the old one left it: it is replicated state."""
    from cachefs.backing.client import BackingClient
    from cachefs.backing.cluster import MetaClusterView
    from cachefs.repo.exporter import BATCH, Exporter
    from cachefs.repo.source import RepoBlocks

    from .client import MetaClient

    meta = MetaClient(pool, addrs, deadline=30.0)
    view = MetaClusterView(meta)
    blocks = RepoBlocks(BackingClient(pool, view), meta.query)
    exporter = Exporter(meta.query, meta.mutate, blocks, lambda volume: view.policy(volume).block_size)
    while True:
        await trio.sleep(tick)
        node = service.node
        if node is None or not node.is_leader:
            continue
        for link in list(service.state.links.values()):
            if not (link.puts or link.deletes):
                continue
            batch = service.state.repo_exports(link.id, BATCH, time.time_ns())
            if not (batch["puts"] or batch["deletes"]):
                continue  # only failed ones, not due yet
            try:
                await view.refresh()
                counts = await exporter.run_pass(link.to_dict(), batch)
            except CacheFSError as exc:  # the cluster map; each record's errors are its own
                log.warning("exports of repository link %d: pass failed, will retry: %s", link.id, exc)
                continue
            except Exception:  # a bug in an export must not take the replica (and its Raft) down
                log.exception("exports of repository link %d: pass crashed, will retry", link.id)
                continue
            log.info("repository link %d: exported %d, %d failed, %d dropped",
                     link.id, counts["done"], counts["failed"], counts["dropped"])  # fmt: skip


async def run_jobs(
    service: MetaService, pool: RpcPool, addrs: list[str], node_id: int,
    *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:  # fmt: skip
    """Run the warm-up jobs while this replica leads (``metanode/jobs.py``); a
    failed round waits until a dead cache node shows as down."""
    from .client import MetaClient
    from .jobrunner import JobRunner

    runner = JobRunner(lambda: service.state.jobs, service.mutate, MetaClient(pool, addrs, deadline=20.0), pool,
                       node_id, retry_wait=service.node_timeout + 2)  # fmt: skip
    await runner.run(lambda: service.node is not None and service.node.is_leader, task_status=task_status)


async def serve(
    node_id: int,
    peers: dict[int, str],
    data_dir: Path,
    listen: str,
    secret: bytes | None,
    session_timeout: float,
    node_timeout: float,
    snapshot_entries: int = DriverConfig().snapshot_entries,
    read_lease: bool = True,
    gc_interval: float = GC_INTERVAL,
    gc_grace: float = GC_GRACE,
    repair_interval: float = REPAIR_INTERVAL,
    repair_rate: int = REPAIR_RATE,
    tls: tuple[ssl.SSLContext | None, ssl.SSLContext | None] = (None, None),
    join: bool = False,
    lease_term: float = DEFAULT_TERM,
) -> None:
    """Run the replica until SIGINT/SIGTERM; ``tls`` is load_tls's (server, client) pair."""
    host, port = parse_addr(listen)
    state = MetaState()
    service = MetaService(
        state, session_timeout=session_timeout, node_timeout=node_timeout, read_lease=read_lease,
        lease_term=lease_term,
    )
    NAMESPACE.service = service
    server = RpcServer(service, name="metanode", secret=secret, limits=Limits(), tls=tls[0])
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        # Its own server credential names it, so peers can check Raft's src.
        own = as_credential(secret, metanode_name(node_id))
        async with RpcPool(secret=own, tls=tls[1]) as pool, trio.open_nursery() as nursery:
            node = await RaftNode.create(
                node_id,
                peers,
                data_dir,
                state,
                pool,
                nursery=nursery,
                server=server,
                driver_config=DriverConfig(snapshot_entries=snapshot_entries),
                join=join,
            )
            service.node = node
            await nursery.start(server.serve, host, port)
            await nursery.start(service.run_housekeeping)
            await nursery.start(service.run_repo_polls)
            await nursery.start(service.run_tree_deletes)
            ours = [peers[node_id], *(a for i, a in sorted(peers.items()) if i != node_id)]
            await nursery.start(run_jobs, service, pool, ours, node_id)
            if gc_interval > 0:
                nursery.start_soon(run_gc, service, pool, ours, gc_interval, gc_grace)
            nursery.start_soon(run_exports, service, pool, ours)
            if repair_interval > 0:
                nursery.start_soon(
                    run_repairs, service, pool, ours, repair_interval, repair_rate or None
                )
            log.info(
                "metanode %d serving on %s (peers %s), applied index %d, %d volumes",
                node_id,
                listen,
                peers,
                state.applied_index,
                len(state.volumes),
            )
            sdnotify.serving(nursery, f"metanode {node_id} serving on {listen}")
            async for signum in signals:
                log.info("signal %d: shutting down", signum)
                break
            await server.shutdown(grace=2.0)
            node.close()
            nursery.cancel_scope.cancel()


@click.group("metanode", cls=DaemonGroup, run_requires=("node_id", "peers", "data_dir"))
@click.option(
    "--id",
    "node_id",
    type=click.IntRange(1),
    help="This replica's id (one of the ids in --peers). Required to run one.",
)
@click.option(
    "--peers",
    help="Every replica as ID=host:port, comma separated, this one included. Required "
    "to run one.",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    help="Directory for the WAL and snapshots (created if missing). Required to run one.",
)
@click.option(
    "--join",
    is_flag=True,
    help="Join a running cluster: wait as a learner until `cachefs metanode add` adds "
    "this replica (--peers then only says where the others are).",
)
@click.option(
    "--listen",
    type=ADDR,
    default=None,
    help="host:port to serve on (default: this replica's address in --peers).",
)
@click.option(
    "--session-timeout",
    type=click.FloatRange(1, 86400),
    default=SESSION_TIMEOUT,
    show_default=True,
    help="Seconds without a heartbeat before a client session ends.",
)
@click.option(
    "--node-timeout",
    type=click.FloatRange(1, 86400),
    default=NODE_TIMEOUT,
    show_default=True,
    help="Seconds without a heartbeat before a node shows as down.",
)
@click.option(
    "--lease-term",
    type=click.FloatRange(1, 600),
    default=DEFAULT_TERM,
    show_default=True,
    help="Seconds a client's metadata lease lasts without a renewal: the longest a frozen or "
    "cut-off mount can delay another's change, and a new leader's wait for leases it does "
    "not know (shorter: more renewals).",
)
@click.option(
    "--snapshot-entries",
    type=click.IntRange(100),
    default=DriverConfig().snapshot_entries,
    show_default=True,
    help="Applied log entries between snapshots (the WAL is cut at each).",
)
@click.option(
    "--read-lease/--no-read-lease",
    default=True,
    show_default=True,
    help="Serve reads under a leader lease (half an election timeout) instead of a "
    "heartbeat round per read.",
)
@click.option(
    "--gc-interval",
    type=click.FloatRange(0, 86400),
    default=GC_INTERVAL,
    show_default=True,
    help="Seconds between garbage collection passes on the leader (0: never; "
    "`cachefs gc` still works).",
)
@click.option(
    "--gc-grace",
    type=click.FloatRange(0, 86400 * 30),
    default=GC_GRACE,
    show_default=True,
    help="Seconds a trashed slice's blocks are kept before the collector deletes them.",
)
@click.option(
    "--repair-interval",
    type=click.FloatRange(0, 86400),
    default=REPAIR_INTERVAL,
    show_default=True,
    help="Seconds between passes of the leader's repair service over the blocks writes "
    "stored short (0: never; `cachefs repair` still works).",
)
@click.option(
    "--repair-rate",
    type=SIZE,
    default=str(REPAIR_RATE),
    show_default=True,
    help="Bytes/s the repair service writes at most, all datanodes together (0: no limit).",
)
@daemon_options("metanode")
@tls_options
@click.pass_context
def command(
    ctx: click.Context,
    node_id: int | None,
    peers: str | None,
    data_dir: str | None,
    join: bool,
    listen: str | None,
    session_timeout: float,
    node_timeout: float,
    lease_term: float,
    snapshot_entries: int,
    read_lease: bool,
    gc_interval: float,
    gc_grace: float,
    repair_interval: float,
    repair_rate: int,
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
    """Run a metanode: one replica of the namespace and cluster map (or, with a
    subcommand, change which metanodes there are)."""
    if ctx.invoked_subcommand is not None:
        return
    ctx.command.check_run(ctx)  # type: ignore[attr-defined]
    assert node_id is not None and peers is not None and data_dir is not None
    setup_logging("metanode", log_level, log_format, log_file, stderr_too=True)
    secret = load_secret(secret_file, insecure, cluster=True)
    tls = load_tls(tls_cert, tls_key, tls_ca)
    try:
        peer_map = parse_peers(peers)
    except InvalidArgument as exc:
        raise click.BadParameter(exc.message, param_hint="--peers") from None
    if node_id not in peer_map:
        raise click.BadParameter(
            f"--id {node_id} is not one of the ids in --peers "
            f"({', '.join(map(str, sorted(peer_map)))})",
            param_hint="--id",
        )
    root = Path(data_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.UsageError(f"--data-dir {data_dir}: {exc.strerror}") from None
    start_metrics(None if no_metrics else metrics_addr)
    trio.run(with_reload, functools.partial(
        serve,
        node_id,
        peer_map,
        root,
        listen or peer_map[node_id],
        secret,
        session_timeout,
        node_timeout,
        snapshot_entries,
        read_lease,
        gc_interval,
        gc_grace,
        repair_interval,
        repair_rate,
        tls,
        join,
        lease_term,
    ))


for _sub in members.COMMANDS:
    command.add_command(_sub)
