"""``cachefs gc``: report what garbage there is; ``--delete`` deletes it; ``--check`` audits block storage.

Reporting by default is the JuiceFS habit: an operator sees how many trashed
slices (past the grace period) and leaked blocks a pass would delete, and
asks for the deletion with ``--delete``. The metanode leader deletes on its
own schedule anyway (``cachefs metanode --gc-interval``).

The collector is :class:`cachefs.backing.gc.GarbageCollector`; this wires it
to a metanode client and a backing client.
"""

from __future__ import annotations

import functools
import ssl

import click
import trio

from cachefs.backing.client import BackingClient
from cachefs.backing.cluster import MetaClusterView
from cachefs.backing.gc import DEFAULT_GRACE, CheckReport, GarbageCollector, GcReport
from cachefs.config import ADDRS, load_secret, load_tls, setup_logging, tls_options
from cachefs.errors import CacheFSError
from cachefs.metanode.client import MetaClient
from cachefs.queries import ClusterMap
from cachefs.rpc import RpcPool


async def run_gc(meta_addrs: list[str], volumes: tuple[str, ...], *, secret: bytes | None, grace: float,
                 check: bool, delete: bool = False, tls: ssl.SSLContext | None = None,
                 ) -> list[GcReport | CheckReport]:  # fmt: skip
    async with RpcPool(secret=secret, tls=tls) as pool:
        meta = MetaClient(pool, meta_addrs)
        view = MetaClusterView(meta)
        await view.refresh()
        gc = GarbageCollector(meta, BackingClient(pool, view), grace=grace)
        cmap = await meta.query(ClusterMap())
        names = list(volumes) or sorted(cmap["volumes"])
        addrs = [n["addr"] for n in cmap["datanodes"] if n.get("state", "up") == "up"]
        if check:
            return [await gc.check(v, addrs) for v in names]
        return [await gc.sweep(v, addrs, await gc.collect(v, delete=delete), delete=delete) for v in names]


@click.command("gc")
@click.option("--meta", type=ADDRS, required=True, help="Metanode addresses (host:port,...).")
@click.option("--volume", "volumes", multiple=True, help="Volume to collect (repeatable; default: all).")
@click.option("--grace", type=click.FloatRange(0), default=DEFAULT_GRACE, show_default=True,
              help="Seconds a slice stays in the trash before its blocks are deleted.")  # fmt: skip
@click.option("--delete", is_flag=True, help="Delete what the report lists (without it, gc changes nothing).")
@click.option("--check", is_flag=True, help="Change nothing; walk the namespace and report missing and unreferenced blocks.")
@click.option("--secret-file", envvar="CACHEFS_SECRET_FILE", type=click.Path(dir_okay=False),
              help="An admin credential (cachefs credential issue) or the cluster secret (or set CACHEFS_SECRET).")  # fmt: skip
@click.option("--insecure", is_flag=True, envvar="CACHEFS_INSECURE", help="Talk to an insecure (lab) cluster.")
@click.option("--log-level", default="WARNING", show_default=True)
@tls_options
def command(meta: list[str], volumes: tuple[str, ...], grace: float, delete: bool, check: bool, secret_file: str | None,
            insecure: bool, log_level: str, tls_cert: str | None, tls_key: str | None,
            tls_ca: str | None) -> None:  # fmt: skip
    """Report the trashed slices and leaked blocks a pass would delete; --delete deletes them
    (--check audits block storage instead)."""
    if delete and check:
        raise click.UsageError("--delete and --check exclude each other (--check changes nothing)")
    setup_logging("gc", log_level)
    secret = load_secret(secret_file, insecure)
    _, tls = load_tls(tls_cert, tls_key, tls_ca)
    try:
        reports = trio.run(functools.partial(run_gc, meta, volumes, secret=secret, grace=grace, check=check,
                                                     delete=delete, tls=tls))
    except CacheFSError as exc:
        raise click.ClickException(str(exc)) from None
    failed = False
    for r in reports:
        if isinstance(r, CheckReport):
            click.echo(f"{r.volume}: {r.files} files, {r.referenced_blocks} referenced blocks, "
                       f"{r.stored_blocks} stored, {r.trashed_slices} trashed slices")  # fmt: skip
            click.echo(f"  missing: {len(r.missing)}" + "".join(f"\n    {k}" for k in r.missing[:50]))
            click.echo(f"  unreferenced (writes in flight, open unlinked files, or leaks): {len(r.unreferenced)}"
                       + "".join(f"\n    {k}" for k in r.unreferenced[:50]))  # fmt: skip
            click.echo(f"  leaked (never committed, sealed: the next sweep deletes them): {len(r.leaked)}"
                       + "".join(f"\n    {k}" for k in r.leaked[:50]))  # fmt: skip
            failed |= bool(r.missing)
        elif r.deleted:
            click.echo(f"{r.volume}: purged {r.slices_purged} slices, deleted {r.blocks_deleted} blocks, "
                       f"freed {r.bytes_freed} bytes, deleted {r.leaked_blocks_deleted} leaked blocks")  # fmt: skip
            if r.volume_dropped:
                click.echo(f"  {r.volume} was deleted and has no blocks left: it is gone")
        else:
            click.echo(f"{r.volume}: would purge {r.slices_purged} slices, delete {r.blocks_deleted} blocks, "
                       f"free {r.bytes_freed} bytes, delete {r.leaked_blocks_deleted} leaked blocks "
                       f"(nothing deleted: run with --delete)")  # fmt: skip
        for err in r.errors:
            click.echo(f"  error: {err}", err=True)
        failed |= bool(r.errors)
    if failed:
        raise SystemExit(1)
