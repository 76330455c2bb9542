"""``cachefs repo ...``: link S3 prefixes into volumes (data repositories).

``link`` checks the bucket can be listed with this machine's AWS
credentials before it records anything, then imports the whole listing
(``--import full``), printing progress. Running it again for the same
directory and URL goes on with the import where it stopped.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click
import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.config import DURATION, tls_options
from cachefs.errors import CacheFSError, Exists, NotADirectory, NotFound
from cachefs.metanode.client import MetaClient
from cachefs.metanode.cliopts import insecure_option, meta_option, run_admin, secret_option
from cachefs.repo.importer import COUNTS, import_listing, sync_link
from cachefs.repo.s3 import S3Store
from cachefs.repo.url import S3Url

ROOT = 1


async def resolve(meta: MetaClient, volume: str, path: str, *, create: bool = False) -> int:
    """The inode of directory ``path`` of ``volume`` (made, with its parents, if ``create``)."""
    ino = ROOT
    for part in [p for p in path.split("/") if p]:
        name = C.check_name(part.encode())
        try:
            attr = await meta.query(Q.Lookup(volume, ino, name))
        except CacheFSError as exc:
            if not create or exc.code != "ENOENT":
                raise
            attr = await meta.mutate(C.Mkdir(volume, ino, name, 0o755, 0, 0))
        if not attr.mode & 0o040000:
            raise NotADirectory(f"{path!r}: {part!r} is not a directory")
        ino = attr.ino
    return ino


async def link_at(meta: MetaClient, volume: str, ino: int) -> dict[str, Any]:
    for link in await meta.query(Q.ListRepoLinks()):
        if link["volume"] == volume and link["ino"] == ino:
            return link
    raise NotFound(f"no repository link at that directory (inode {ino}) of volume {volume!r}")


def _progress(totals: dict[str, int]) -> None:
    print(f"\rlisted {totals['listed']:,} objects in {totals['dirs']:,} directories: {totals['created']:,} new, "
          f"{totals['updated']:,} changed, {totals['deleted']:,} deleted, {totals['skipped']:,} skipped",
          end="", file=sys.stderr)  # fmt: skip


@click.group()
def repo() -> None:
    """Link S3 buckets into volumes: their objects become files, read through the cache tier."""


@repo.command("link")
@click.argument("volume")
@click.argument("path")
@click.argument("url")
@click.option("--endpoint", default="", help="Endpoint URL of an S3-compatible store (default: AWS).")
@click.option("--region", default="", help="The bucket's region (default: the AWS configuration's).")
@click.option("--import", "import_mode", type=click.Choice(["full", "lazy"]), default="full", show_default=True,
              help="full: list the whole prefix now; lazy: the metanode leader lists each directory when "
                   "it is first looked up or read (with its own AWS credentials).")  # fmt: skip
@click.option("--auto-import", is_flag=True,
              help="The metanode leader polls the bucket and imports new, changed and deleted objects.")
@click.option("--poll-interval", type=click.IntRange(1, C.MAX_POLL_INTERVAL), default=300, show_default=True,
              help="Seconds between --auto-import polls.")
@click.option("--auto-export", "auto_export", default="", metavar="new,changed,deleted",
              help="The metanode leader exports files written here to the bucket after close(): new files, "
                   "changed imported ones, and deletes (only if named).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True)
@meta_option
@secret_option
@insecure_option
@tls_options
def link(volume: str, path: str, url: str, endpoint: str, region: str, import_mode: str, auto_import: bool,
         poll_interval: int, auto_export: str, as_json: bool,
         meta: list[str], secret_file: str | None, insecure: bool, tls_cert: str | None,
         tls_key: str | None, tls_ca: str | None) -> None:  # fmt: skip
    """Link directory PATH of VOLUME to URL (s3://BUCKET/PREFIX) and import its listing."""
    try:
        target = S3Url.parse(url)
        poll = poll_interval if auto_import else 0
        auto_export = C.parse_auto_export(auto_export)
        C.LinkRepo(volume, ROOT, target.bucket, target.prefix, endpoint, region, import_mode, poll, auto_export)
    except CacheFSError as exc:
        raise click.BadParameter(exc.message, param_hint="URL/--endpoint/--region/--auto-export") from None

    async def go(mc: MetaClient) -> dict[str, Any]:
        ino = await resolve(mc, volume, path, create=True)
        existing = [
            lk for lk in await mc.query(Q.ListRepoLinks()) if lk["volume"] == volume and lk["ino"] == ino
        ]
        if existing and (existing[0]["url"], existing[0]["endpoint"]) != (str(target), endpoint):
            raise Exists(f"{path} is linked to {existing[0]['url']} already (link {existing[0]['id']})")
        name = f"repository link to {target}" if not existing else f"repository link {existing[0]['id']} ({target})"
        store = S3Store(target.bucket, name=name, endpoint=endpoint, region=region)
        await store.check()  # wrong credentials or bucket: refused before anything is recorded
        lk = existing[0] if existing else await mc.mutate(
            C.LinkRepo(volume, ino, target.bucket, target.prefix, endpoint, region, import_mode, poll, auto_export)
        )  # fmt: skip
        store.name = f"repository link {lk['id']} ({target})"
        pending = await mc.query(Q.RepoPending(lk["id"]))  # a new link: its own directory
        if lk["import_mode"] == "lazy":
            return {**lk, "import": dict.fromkeys(COUNTS, 0)}  # listed when read
        totals = await import_listing(mc.mutate, lk, store, pending, progress=None if as_json else _progress)
        if not as_json:
            print(file=sys.stderr)
        return {**lk, "import": totals}

    result = run_admin(meta, secret_file, insecure, go, (tls_cert, tls_key, tls_ca))
    if as_json:
        click.echo(json.dumps(result))
    else:
        t = result["import"]
        if result["import_mode"] == "lazy":
            click.echo(f"linked {volume}:{path} to {result['url']} (link {result['id']}): "
                       "each directory is listed when it is first read")  # fmt: skip
            return
        click.echo(f"linked {volume}:{path} to {result['url']} (link {result['id']}): "
                   f"{t['created']} files imported, {t['updated']} changed, {t['skipped']} skipped")  # fmt: skip


@repo.command("list")
@click.option("--json", "as_json", is_flag=True)
@meta_option
@secret_option
@insecure_option
@tls_options
def list_(as_json: bool, meta: list[str], secret_file: str | None, insecure: bool, tls_cert: str | None,
          tls_key: str | None, tls_ca: str | None) -> None:  # fmt: skip
    """List the repository links."""
    links = run_admin(meta, secret_file, insecure, lambda mc: mc.query(Q.ListRepoLinks()), (tls_cert, tls_key, tls_ca))
    if as_json:
        click.echo(json.dumps(links))
        return
    for lk in links:
        state = "imported" if lk["imported_ns"] else f"importing ({lk['pending']} directories to list)"
        click.echo(f"{lk['id']}\t{lk['volume']}\tino {lk['ino']}\t{lk['url']}\t{lk['endpoint'] or 'aws'}\t"
                   f"{lk['objects']} objects\t{state}")  # fmt: skip


@repo.command("status")
@click.argument("volume")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True)
@meta_option
@secret_option
@insecure_option
@tls_options
def status(volume: str, path: str, as_json: bool, meta: list[str], secret_file: str | None, insecure: bool,
           tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> None:  # fmt: skip
    """Show the link of directory PATH of VOLUME."""

    async def go(mc: MetaClient) -> dict[str, Any]:
        lk = await link_at(mc, volume, await resolve(mc, volume, path))
        queue = await mc.query(Q.RepoExports(lk["id"]))
        failed = [[row[0], row[2]] for row in queue["deletes"] if row[2]]
        failed += [[row[1] or f"inode {row[0]}", row[4]] for row in queue["puts"] if row[4]]
        return {**lk, "failed_exports": failed}

    lk = run_admin(meta, secret_file, insecure, go, (tls_cert, tls_key, tls_ca))
    if as_json:
        click.echo(json.dumps(lk))
    else:
        failures = lk.pop("failed_exports")
        for key, value in lk.items():
            click.echo(f"{key}: {value}")
        for name, error in failures:
            click.echo(f"export of {name} failed: {error}")


@repo.command("sync")
@click.argument("volume")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True)
@meta_option
@secret_option
@insecure_option
@tls_options
def sync(volume: str, path: str, as_json: bool, meta: list[str], secret_file: str | None, insecure: bool,
         tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> None:  # fmt: skip
    """List the link of PATH again (for a lazy link, the directories listed so far):
    new objects become files, changed ones get a new
    content version, and the files of objects deleted from the bucket go (one
    that is open keeps reading what is cached; other blocks of it then fail
    with EIO naming the object). Local files are never touched."""

    async def go(mc: MetaClient) -> dict[str, int]:
        lk = await link_at(mc, volume, await resolve(mc, volume, path))
        store = S3Store(lk["bucket"], name=f"repository link {lk['id']} ({lk['url']})",
                        endpoint=lk["endpoint"], region=lk["region"])  # fmt: skip
        return await sync_link(mc.mutate, lk, store, await mc.query(Q.RepoPending(lk["id"])))

    totals = run_admin(meta, secret_file, insecure, go, (tls_cert, tls_key, tls_ca))
    if as_json:
        click.echo(json.dumps(totals))
    else:
        click.echo(f"synced {volume}:{path}: {totals['created']} new, {totals['updated']} changed, "
                   f"{totals['deleted']} deleted, {totals['unchanged']} unchanged, {totals['skipped']} skipped")  # fmt: skip


@repo.command("export")
@click.argument("volume")
@click.argument("path")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until the metanode leader has exported the queue (exit 1 if any export failed).")
@click.option("--timeout", type=click.FloatRange(1), default=3600.0, show_default=True, help="Seconds to wait.")
@click.option("--json", "as_json", is_flag=True)
@meta_option
@secret_option
@insecure_option
@tls_options
def export(volume: str, path: str, wait: bool, timeout: float, as_json: bool, meta: list[str],
           secret_file: str | None, insecure: bool, tls_cert: str | None, tls_key: str | None,
           tls_ca: str | None) -> None:  # fmt: skip
    """Export the files under PATH (a linked directory or one inside it) of VOLUME to the bucket:
    every file whose content is not the bucket's is queued, failed exports are tried again,
    and the metanode leader uploads them (multipart for large files)."""

    async def go(mc: MetaClient) -> dict[str, Any]:
        lk, inside = await link_above(mc, volume, path)
        queued = await mc.mutate(C.QueueExports(lk["id"], inside))
        counts = await mc.query(Q.RepoExports(lk["id"], 1))
        with trio.move_on_after(timeout if wait else 0):
            while counts["pending"]:
                if not as_json:
                    print(f"\rexporting {counts['pending']:,} pending, {counts['failed']:,} failed, "
                          f"{counts['done']:,} done", end="", file=sys.stderr)  # fmt: skip
                await trio.sleep(0.5)
                counts = await mc.query(Q.RepoExports(lk["id"], 1))
        if not as_json and wait:
            print(file=sys.stderr)
        return {"link": lk["id"], **queued, **{k: counts[k] for k in ("pending", "failed", "done")}}

    result = run_admin(meta, secret_file, insecure, go, (tls_cert, tls_key, tls_ca))
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(f"{volume}:{path}: {result['queued']} files queued, {result['retried']} failed exports retried; "
                   f"now {result['pending']} pending, {result['failed']} failed, {result['done']} done")  # fmt: skip
    if wait and (result["failed"] or result["pending"]):
        sys.exit(1)


@repo.command("release")
@click.argument("volume")
@click.argument("path")
@click.option("--older-than", type=DURATION, required=True,
              help="Release only files last modified at least this long ago (e.g. 7d, 12h, 0).")
@click.option("--json", "as_json", is_flag=True)
@meta_option
@secret_option
@insecure_option
@tls_options
def release(volume: str, path: str, older_than: int, as_json: bool, meta: list[str], secret_file: str | None,
            insecure: bool, tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> None:  # fmt: skip
    """Release the exported files under PATH (a linked directory, one inside it, or a file) of VOLUME:
    each whose object in the bucket is its content gives its blocks back to gc and reads from the
    bucket through the cache tier from then on (cachefs/repo/release.py). Files written since their
    export, or with one queued, keep their blocks."""
    from cachefs.backing.client import BackingClient
    from cachefs.backing.cluster import MetaClusterView
    from cachefs.repo.exporter import Exporter
    from cachefs.repo.release import Releaser
    from cachefs.repo.source import RepoBlocks

    async def go(mc: MetaClient) -> dict[str, Any]:
        lk, inside = await link_above(mc, volume, path)
        parent, name, attr = lk["ino"], b"", await mc.query(Q.GetAttr(volume, lk["ino"]))
        for part in [p for p in inside.split("/") if p]:
            parent, name = attr.ino, C.check_name(part.encode())
            attr = await mc.query(Q.Lookup(volume, parent, name))
        key = lk["prefix"] + inside.strip("/") + ("/" if attr.is_dir and inside.strip("/") else "")
        view = MetaClusterView(mc)
        await view.refresh()
        blocks = RepoBlocks(BackingClient(mc.pool, view), mc.query)
        exporter = Exporter(mc.query, mc.mutate, blocks, lambda v: view.policy(v).block_size)
        store = S3Store(lk["bucket"], name=f"repository link {lk['id']} ({lk['url']})",
                        endpoint=lk["endpoint"], region=lk["region"])  # fmt: skip
        releaser = Releaser(mc.query, mc.mutate, exporter, lk, store)
        return {"link": lk["id"], **await releaser.run(parent, name, attr, key, time.time_ns() - older_than * 10**9)}

    result = run_admin(meta, secret_file, insecure, go, (tls_cert, tls_key, tls_ca))
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(f"{volume}:{path}: {result['released']} files released ({result['released_bytes']:,} bytes for gc), "
                   f"{result['in_bucket']} read from the bucket already, {result['differs']} differ from their "
                   f"object, {result['too_new']} too new, {result['refused']} changed meanwhile")  # fmt: skip


async def link_above(mc: MetaClient, volume: str, path: str) -> tuple[dict[str, Any], str]:
    """The link of directory ``path`` or of the directory holding it, and
    ``path`` relative to the link's directory."""
    parts = [p for p in path.split("/") if p]
    links = {lk["ino"]: lk for lk in await mc.query(Q.ListRepoLinks()) if lk["volume"] == volume}
    ino, found = ROOT, None
    for i, part in enumerate([None, *parts]):
        if part is not None:
            ino = (await mc.query(Q.Lookup(volume, ino, C.check_name(part.encode())))).ino
        if ino in links:
            found = (links[ino], "/".join(parts[i:]))
    if found is None:
        raise NotFound(f"{path!r} of volume {volume!r} is not in a linked directory")
    return found


@repo.command("unlink")
@click.argument("volume")
@click.argument("path")
@meta_option
@secret_option
@insecure_option
@tls_options
def unlink(volume: str, path: str, meta: list[str], secret_file: str | None, insecure: bool,
           tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> None:  # fmt: skip
    """Remove the link of directory PATH of VOLUME (its files stay; their S3 data is no longer read)."""

    async def go(mc: MetaClient) -> dict[str, Any]:
        lk = await link_at(mc, volume, await resolve(mc, volume, path))
        return await mc.mutate(C.UnlinkRepo(lk["id"]))

    lk = run_admin(meta, secret_file, insecure, go, (tls_cert, tls_key, tls_ca))
    click.echo(f"unlinked {volume}:{path} from {lk['url']} (link {lk['id']})")
