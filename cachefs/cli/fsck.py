"""``cachefs fsck VOLUME``: metadata invariants on the leader, then every needed block's shards.

The check is :class:`cachefs.backing.fsck.Fsck`; this wires it to a
metanode client, a backing client and a repairer. It needs an admin
credential (the leader's invariant check, the datanodes' scrub and listing);
for a volume whose blocks are objects, AWS credentials that may list and
get its prefix instead of the datanodes' scrub.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Any

import click
import trio

from cachefs.backing.client import BackingClient
from cachefs.backing.cluster import MetaClusterView
from cachefs.backing.fsck import DamagedFile, Fsck, FsckReport
from cachefs.backing.repair import Repairer
from cachefs.config import ADDRS, load_secret, load_tls, setup_logging, tls_options
from cachefs.errors import CacheFSError
from cachefs.metanode.client import MetaClient
from cachefs.rpc import RpcPool

SHOWN = 50  # lines of each list in the text report


def _files(title: str, rows: list[DamagedFile]) -> None:
    click.echo(f"  {title}: {len(rows)} files")
    for f in rows[:SHOWN]:
        spans = ", ".join(f"{off}+{length}" for off, length in f.ranges[:8])
        more = f" and {len(f.ranges) - 8} more" if len(f.ranges) > 8 else ""
        click.echo(f"    {' '.join(f.paths)} (inode {f.ino}): {len(f.blocks)} blocks, bytes {spans}{more}")


def _print(r: FsckReport, repair: bool) -> None:
    what = f"objects in {r.store}" if r.store else "shards"
    click.echo(f"{r.volume}: {'healthy' if r.healthy else 'NOT healthy'}: {r.files} files, {r.blocks} blocks, "
               f"{r.shards_checked} {what} verified ({r.shards_corrupt} corrupt)")  # fmt: skip
    click.echo(f"  metadata: {len(r.metadata)} problems" + "".join(f"\n    {p}" for p in r.metadata[:SHOWN]))
    if r.store:
        _files("lost (no object, or one failing its checksum)", r.lost)
        click.echo(f"  orphans (objects of leaked slices; cachefs gc --delete removes them): {r.orphan_blocks}"
                   + "".join(f"\n    {k}" for k in r.orphans[:SHOWN]))  # fmt: skip
        if repair:
            _files("detached (the lost ranges are holes now: they read as zeros)", r.detached)
        for err in r.errors:
            click.echo(f"  error: {err}", err=True)
        return
    if r.datanodes_down:
        click.echo(f"  datanodes down or not answering: {', '.join(r.datanodes_down)}")
    click.echo(f"  short blocks (readable, fewer shards than the policy): {len(r.short)}")
    _files("lost (fewer than K shards anywhere)", r.lost)
    if r.unavailable:
        _files("unavailable (fewer than K shards on the datanodes that answered)", r.unavailable)
    if repair:
        click.echo(f"  repair: {r.shards_rebuilt} shards rebuilt")
        _files("detached (the lost ranges are holes now: they read as zeros)", r.detached)
    for err in r.errors:
        click.echo(f"  error: {err}", err=True)


@click.command("fsck")
@click.argument("volume")
@click.option("--meta", type=ADDRS, required=True, envvar="CACHEFS_META", help="Metanode addresses (host:port,...).")
@click.option("--repair", is_flag=True,
              help="Rebuild short blocks; turn the byte ranges of lost blocks into holes and name their files.")
@click.option("--no-verify", is_flag=True, help="Only list shards (objects); do not re-read their checksums.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option("--secret-file", envvar="CACHEFS_SECRET_FILE", type=click.Path(dir_okay=False),
              help="An admin credential (cachefs credential issue) or the cluster secret (or set CACHEFS_SECRET).")
@click.option("--insecure", is_flag=True, envvar="CACHEFS_INSECURE", help="Talk to an insecure (lab) cluster.")
@click.option("--log-level", default="WARNING", show_default=True)
@tls_options
def command(volume: str, meta: list[str], repair: bool, no_verify: bool, as_json: bool, secret_file: str | None,
            insecure: bool, log_level: str, tls_cert: str | None, tls_key: str | None,
            tls_ca: str | None) -> None:  # fmt: skip
    """Check a volume: metadata invariants, then that every block files need has enough intact shards
    (for a volume in an object store: an object with the right checksum; orphans are listed).

    Exits 0 when the volume is healthy, 1 when anything was found (also after --repair fixed it).
    """
    setup_logging("fsck", log_level)
    secret = load_secret(secret_file, insecure)
    _, tls = load_tls(tls_cert, tls_key, tls_ca)

    async def run() -> FsckReport:
        async with RpcPool(secret=secret, tls=tls) as pool:
            mc = MetaClient(pool, meta, deadline=60.0)
            view = MetaClusterView(mc)
            await view.refresh()
            return await Fsck(mc, Repairer(BackingClient(pool, view))).run(volume, verify=not no_verify,
                                                                           repair=repair)

    try:
        report = trio.run(run)
    except CacheFSError as exc:
        raise click.ClickException(f"fsck of {volume}: {exc}") from None
    if as_json:
        out: dict[str, Any] = asdict(report) | {"healthy": report.healthy}
        click.echo(json.dumps(out))
    else:
        _print(report, repair)
    sys.exit(0 if report.healthy else 1)
