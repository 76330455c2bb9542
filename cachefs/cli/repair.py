"""``cachefs repair``: find missing, corrupt or misplaced shards and rebuild them.

The repairer is :class:`cachefs.backing.repair.Repairer`; this wires it to
the cluster map (from the metanodes, or a JSON file) and a backing client.
"""

from __future__ import annotations

import json
import ssl
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
import trio

from cachefs.backing.client import BackingClient
from cachefs.backing.cluster import ClusterView, MetaClusterView
from cachefs.backing.repair import Repairer, RepairReport
from cachefs.config import (
    ADDRS,
    SIZE,
    daemon_options,
    load_secret,
    load_tls,
    setup_logging,
    tls_options,
)
from cachefs.errors import CacheFSError
from cachefs.logs import with_reload
from cachefs.metanode.client import MetaClient
from cachefs.metrics import MetricsAddr, start_metrics
from cachefs.rpc import RpcPool


def _print_progress(report: RepairReport) -> None:
    click.echo(f"repair {report.volume}: pg {report.pgs_done}/{report.pgs_total}, "
               f"{report.blocks_checked} blocks, {report.shards_missing} missing, "
               f"{report.shards_rebuilt} rebuilt, {report.shards_moved} moved, "
               f"{len(report.unrecoverable)} unrecoverable", err=True)


async def run_repair(*, secret: bytes | None, meta: list[str] | None, cluster_map: dict[str, Any] | None,
                     volumes: list[str], scrub: bool, rate: int | None, interval: float,
                     quiet: bool, tls: ssl.SSLContext | None = None,
                     scrub_rate: int | None = None) -> list[RepairReport]:
    """Repair passes over the given volumes (all when empty); one pass unless ``interval``."""
    async with RpcPool(secret=secret, tls=tls) as pool:
        if cluster_map is not None:
            view: Any = ClusterView.from_map(cluster_map)
        else:
            assert meta
            view = MetaClusterView(MetaClient(pool, meta, deadline=30.0))
            await view.refresh()
        client = BackingClient(pool, view)
        repairer = Repairer(client, rate=rate, scrub_rate=scrub_rate,
                            progress=None if quiet else _print_progress)
        while True:
            if isinstance(view, MetaClusterView):
                await view.refresh()
            names = volumes or sorted(view.volumes if isinstance(view, ClusterView) else view.current.volumes)
            reports = [await repairer.repair_volume(name, scrub=scrub) for name in names]
            if interval <= 0:
                return reports
            await trio.sleep(interval)


@click.command("repair")
@click.option("--meta", type=ADDRS, default=None, help="Metanode addresses, to read the cluster map.")
@click.option("--cluster-file", type=click.Path(dir_okay=False),
              help="A cluster map as JSON (the cluster_map() shape) instead of --meta.")
@click.option("--volume", "volumes", multiple=True, help="Volume to repair (repeatable; default all).")
@click.option("--scrub", is_flag=True, help="Re-read and verify every shard first.")
@click.option("--rate", type=SIZE, default="0", help="Write at most this many bytes/s (0: no limit).")
@click.option("--max-rate", type=SIZE, default="0",
              help="Scrub: read at most this many bytes/s, all datanodes together (0: no limit).")
@click.option("--interval", type=click.FloatRange(min=0), default=0.0,
              help="Keep running, one pass every this many seconds (0: one pass and exit).")
@click.option("--json", "as_json", is_flag=True, help="Print the reports as one JSON object.")
@daemon_options("repair")
@tls_options
def command(meta: list[str] | None, cluster_file: str | None, volumes: tuple[str, ...], scrub: bool,
            rate: int, max_rate: int, interval: float, as_json: bool, secret_file: str | None, insecure: bool,
            log_level: str, log_format: str, log_file: str | None, metrics_addr: MetricsAddr, no_metrics: bool,
            tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> None:
    """Find missing, corrupt or misplaced shards and rebuild them.

    Exits 0 when every block is back at full redundancy, 1 otherwise.
    """
    setup_logging("repair", log_level, log_format, log_file, stderr_too=True)
    if bool(meta) == bool(cluster_file):
        raise click.UsageError("give exactly one of --meta or --cluster-file")
    secret = load_secret(secret_file, insecure)
    _, tls = load_tls(tls_cert, tls_key, tls_ca)
    cluster_map = None
    if cluster_file:
        try:
            cluster_map = json.loads(Path(cluster_file).read_text())
        except (OSError, ValueError) as exc:
            raise click.UsageError(f"--cluster-file {cluster_file}: {exc}") from None
    start_metrics(None if no_metrics else metrics_addr)
    try:
        reports = trio.run(with_reload, lambda: run_repair(
            secret=secret, meta=meta, cluster_map=cluster_map, volumes=list(volumes), scrub=scrub,
            rate=rate or None, interval=interval, quiet=as_json, tls=tls, scrub_rate=max_rate or None))
    except CacheFSError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps({"volumes": [asdict(r) | {"healthy": r.healthy} for r in reports]}))
    else:
        for r in reports:
            state = "healthy" if r.healthy else "NOT healthy"
            click.echo(f"{r.volume}: {state}: {r.blocks_checked} blocks checked, "
                       f"{r.shards_corrupt} corrupt, {r.shards_missing} missing, {r.shards_rebuilt} rebuilt, "
                       f"{r.shards_moved} moved, {r.slots_skipped} skipped (node down), "
                       f"{len(r.unrecoverable)} unrecoverable, {r.bytes_written} bytes written")
            for line in r.unrecoverable + r.errors:
                click.echo(f"  {line}")
    sys.exit(0 if all(r.healthy for r in reports) else 1)
