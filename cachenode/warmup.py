"""``cachefs warmup PATH...``: push the blocks of a tree into the cache tier.

The work is :mod:`cachefs.warming` (resolve the paths through the metanodes,
route each block to its owners, have them fetch it); this module is the
command: a progress bar in the foreground, ``--check``/``--evict``, ``-f
LIST``, ``--pin-ttl``, and ``--background`` with ``warmup status`` and
``warmup cancel`` for jobs the metanode leader runs (:mod:`cachefs.metanode.jobs`).
"""

from __future__ import annotations

import json
import ssl
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import click
import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.config import ADDRS, DURATION, load_secret, load_tls, tls_options
from cachefs.errors import CacheFSError
from cachefs.ring import CacheRouter
from cachefs.rpc import RpcPool
from cachefs.warming import (
    WarmFile,
    WarmupReport,
    ZoneCache,
    check_files,
    resolve_paths,
    warm_files,
)

if TYPE_CHECKING:
    from cachefs.metanode.client import MetaClient


# ---------------------------------------------------------------- the command


async def run_warmup(
    meta: list[str],
    volume: str,
    paths: Sequence[str],
    *,
    secret: bytes | None,
    threads: int,
    zones: Sequence[str] | None,
    quiet: bool = False,
    tls: ssl.SSLContext | None = None,
    check: str | None = None,
    pin_ttl: int = 0,
) -> WarmupReport | dict[str, ZoneCache]:
    """Warm ``paths``; with ``check`` "check" or "evict", report or drop what is cached instead."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    from cachefs.metanode.client import MetaClient

    console = Console(stderr=True, quiet=quiet)
    async with RpcPool(secret=secret, tls=tls) as pool:
        reader = MetaClient(pool, meta, deadline=20.0)
        cmap = await reader.query(Q.ClusterMap())
        vol = cmap.get("volumes", {}).get(volume)
        if vol is None:
            raise click.UsageError(f"no volume {volume!r} in the cluster map")
        router = CacheRouter(cmap, zones[0] if zones else "")
        if not router.rings:
            raise click.UsageError("the cluster map lists no cache nodes that are up")
        unknown = [z for z in zones or () if z not in router.rings]
        if unknown:
            raise click.UsageError(
                f"no cache nodes up in zone {unknown[0]!r} (zones: {', '.join(sorted(router.rings))})"
            )
        with console.status("resolving paths: 0 files") as status:
            count = [0]

            def resolved(_: WarmFile) -> None:
                count[0] += 1
                status.update(f"resolving paths: {count[0]} files")

            files = await resolve_paths(
                reader, volume, paths, int(vol["block_size"]), threads=threads, on_file=resolved
            )
        if check is not None:
            return await check_files(pool, router, volume, files, zones=zones, evict=check == "evict")
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[files]}"),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            copies = len(zones) if zones else len(router.rings)
            task = progress.add_task(
                "warming", total=sum(f.size for f in files) * copies, files=f"0/{len(files)} files"
            )
            done = [0]

            def file_done(_: WarmFile) -> None:
                done[0] += 1
                progress.update(task, files=f"{done[0]}/{len(files)} files")

            report = await warm_files(
                pool,
                router,
                volume,
                files,
                zones=zones,
                threads=threads,
                pin_until=time.time() + pin_ttl if pin_ttl else 0.0,
                on_bytes=lambda n: progress.advance(task, n),
                on_file=file_done,
            )
            progress.update(task, completed=sum(f.size for f in files) * copies)
    return report


def _paths_from(list_file: str | None, paths: Sequence[str]) -> list[str]:
    """PATH arguments, then the lines of ``-f LIST`` (blank lines and ``#`` comments skipped)."""
    out = list(paths)
    if list_file is not None:
        try:
            with open(list_file, encoding="utf-8", errors="surrogateescape") as f:
                out += [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
        except OSError as exc:
            raise click.BadParameter(f"cannot read {list_file}: {exc.strerror}", param_hint="-f") from None
    if not out:
        raise click.UsageError("no paths: give PATH... or -f LIST")
    return out


def _cluster(fn: Any) -> Any:
    """The options every warmup subcommand takes to reach the metanodes."""
    for option in reversed([
        click.option("--meta", type=ADDRS, required=True, envvar="CACHEFS_META",
                     help="Metanode addresses (comma separated)."),
        click.option("--secret-file", envvar="CACHEFS_SECRET_FILE", type=click.Path(dir_okay=False),
                     help="A client credential for the volume (cachefs credential issue) or the cluster "
                          "secret (or set CACHEFS_SECRET)."),
        click.option("--insecure", is_flag=True, envvar="CACHEFS_INSECURE",
                     help="Talk to a cluster that runs without authentication."),
        tls_options,
    ]):  # fmt: skip
        fn = option(fn)
    return fn


def _meta_call(meta: list[str], secret_file: str | None, insecure: bool, tls_files: tuple[str | None, ...],
               go: Callable[[MetaClient], Awaitable[Any]]) -> Any:  # fmt: skip
    from cachefs.metanode.client import MetaClient

    secret = load_secret(secret_file, insecure)
    _, tls = load_tls(*tls_files)

    async def main() -> Any:
        async with RpcPool(secret=secret, tls=tls) as pool:
            return await go(MetaClient(pool, meta, deadline=20.0))

    try:
        return trio.run(main)
    except CacheFSError as exc:
        raise click.ClickException(str(exc)) from None


class _WarmupGroup(click.Group):
    """``cachefs warmup PATH...`` is ``cachefs warmup run PATH...``: anything
    that is not a subcommand's name goes to ``run`` (a path named ``status``
    is ``./status`` or ``/status``)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = ["run", *args]
        return super().parse_args(ctx, args)


@click.group("warmup", cls=_WarmupGroup)
def command() -> None:
    """Warm the cache tier: `cachefs warmup [run] PATH...` prefetches in the
    foreground, `--background` submits a job the metanode leader runs;
    `warmup status` and `warmup cancel` follow and stop jobs."""


def _describe(job: dict[str, Any]) -> str:
    pct = f"{100 * job['progress']:.1f}%"
    eta = f", ETA {job['eta']:.0f}s" if job.get("eta") is not None else ""
    head = (f"job {job['id']} ({job['volume']}): {job['state']} {pct}, {job['files_done']}/{job['files']} files, "
            f"{job['bytes_done'] / (1 << 20):.1f}/{job['bytes_total'] / (1 << 20):.1f} MiB{eta}")  # fmt: skip
    if job["state"] in ("done", "failed"):
        head += f"; {job['fetched']} fetched, {job['cached']} already cached, {job['failed']} failed"
    if job["pin_ttl"]:
        head += f"; pinned for {job['pin_ttl']}s"
    if job["error"]:
        head += f"\n  {job['error']}"
    return head + f"\n  paths: {' '.join(job['paths'][:5])}{' ...' if len(job['paths']) > 5 else ''}"


@command.command("run", context_settings={"auto_envvar_prefix": "CACHEFS_WARMUP"})  # as before it was a group
@click.argument("paths", nargs=-1)
@click.option("-f", "--file", "list_file", type=click.Path(dir_okay=False),
              help="Read paths (inside the volume) from this file, one a line.")
@click.option("--check", is_flag=True, help="Fetch nothing: report what fraction of the paths each zone caches.")
@click.option("--evict", is_flag=True, help="Drop the paths' blocks from the cache nodes instead of warming them.")
@click.option("--background", is_flag=True,
              help="Submit a job that the metanode leader runs (cachefs warmup status / cancel), and return.")
@click.option("--pin-ttl", type=DURATION, default=0,
              help="Keep the warmed blocks from eviction this long (e.g. 12h; default: not pinned).")
@click.option("--json", "as_json", is_flag=True, help="With --background: print the job as one JSON object.")
@click.option("--volume", required=True, help="Volume the paths are in.")
@click.option(
    "--threads",
    type=click.IntRange(1, 1024),
    default=8,
    show_default=True,
    help="Batches of blocks prefetched in parallel.",
)
@click.option(
    "--zone",
    "zones",
    multiple=True,
    help="Warm only this zone's cache nodes (repeatable; default: every zone).",
)
@click.option("--quiet", is_flag=True, help="No progress bar, only the summary.")
@_cluster
def run(
    paths: tuple[str, ...],
    list_file: str | None,
    check: bool,
    evict: bool,
    background: bool,
    pin_ttl: int,
    as_json: bool,
    volume: str,
    meta: list[str],
    threads: int,
    zones: tuple[str, ...],
    secret_file: str | None,
    insecure: bool,
    quiet: bool,
    tls_cert: str | None,
    tls_key: str | None,
    tls_ca: str | None,
) -> None:
    """Prefetch the blocks of PATH... (paths inside the volume) into the cache tier
    (or, with --check, report how much is cached; with --evict, drop it)."""
    if check and evict:
        raise click.UsageError("--check and --evict exclude each other")
    if background and (check or evict):
        raise click.UsageError("--background warms: it excludes --check and --evict")
    if pin_ttl > C.MAX_PIN_TTL:
        raise click.BadParameter(f"at most {C.MAX_PIN_TTL} seconds", param_hint="--pin-ttl")
    all_paths = _paths_from(list_file, paths)
    if background:
        cmd = C.SubmitJob(volume, C.pack_strings(all_paths), C.pack_strings(zones), pin_ttl, threads)
        job = _meta_call(meta, secret_file, insecure, (tls_cert, tls_key, tls_ca), lambda mc: mc.mutate(cmd))
        click.echo(json.dumps(job) if as_json else f"submitted job {job['id']}: cachefs warmup status {job['id']}")
        return
    secret = load_secret(secret_file, insecure)
    _, tls = load_tls(tls_cert, tls_key, tls_ca)
    mode = "check" if check else "evict" if evict else None
    try:
        report = trio.run(
            lambda: run_warmup(
                meta,
                volume,
                all_paths,
                secret=secret,
                threads=threads,
                zones=list(zones) or None,
                quiet=quiet,
                tls=tls,
                check=mode,
                pin_ttl=pin_ttl,
            )
        )
    except CacheFSError as exc:
        raise click.ClickException(str(exc)) from None
    if isinstance(report, dict):
        failed = False
        for zone, z in report.items():
            if evict:
                click.echo(f"zone {zone}: evicted {z.cached_blocks} of {z.blocks} blocks")
            else:
                click.echo(f"zone {zone}: {100 * z.fraction:.1f}% cached ({z.cached_blocks} of {z.blocks} blocks, "
                           f"{z.cached_bytes} of {z.bytes} bytes)")  # fmt: skip
            for line in z.errors[:10]:
                click.echo(f"  {line}", err=True)
            failed |= bool(z.errors)
        if failed:
            sys.exit(1)
        return
    click.echo(report.summary())
    for line in report.errors[:10]:
        click.echo(f"  {line}", err=True)
    if report.failed:
        sys.exit(1)


@command.command("status")
@click.argument("job_id", metavar="[JOB]", type=click.IntRange(1), required=False)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list of jobs (one object with JOB).")
@_cluster
def status(job_id: int | None, as_json: bool, meta: list[str], secret_file: str | None, insecure: bool,
           tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> None:  # fmt: skip
    """Show the warm-up jobs (or job JOB): state, progress, ETA, what was fetched."""
    jobs = _meta_call(meta, secret_file, insecure, (tls_cert, tls_key, tls_ca),
                      lambda mc: mc.query(Q.ListJobs(job_id or 0)))  # fmt: skip
    if job_id and not jobs:
        raise click.ClickException(f"no job {job_id}")
    if as_json:
        click.echo(json.dumps(jobs[0] if job_id else jobs))
        return
    for job in jobs:
        click.echo(_describe(job))
    if not jobs:
        click.echo("no warm-up jobs")


@command.command("cancel")
@click.argument("job_id", metavar="JOB", type=click.IntRange(1))
@_cluster
def cancel(job_id: int, meta: list[str], secret_file: str | None, insecure: bool,
           tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> None:  # fmt: skip
    """Cancel warm-up job JOB (what is cached stays cached)."""

    async def go(mc: MetaClient) -> dict[str, Any]:
        jobs = await mc.query(Q.ListJobs(job_id))
        if not jobs:
            raise click.ClickException(f"no job {job_id}")
        return await mc.mutate(C.CancelJob(jobs[0]["volume"], job_id))

    job = _meta_call(meta, secret_file, insecure, (tls_cert, tls_key, tls_ca), go)
    click.echo(f"job {job_id}: {job['state']}")
