"""``cachefs tree clone SRC DST`` and ``cachefs tree delete PATH``, in the
Backend.AI FSOp spirit: a metadata-only copy-on-write copy of a directory (a
dataset version), and a delete done by the metanodes.

The metanodes do the copying (``metanode/trees.py``): this command walks the
source tree, one ``CloneDir`` step (up to ``BATCH`` entries, one log entry)
at a time, and shows how many of the source's entries (its inode count,
which the metanodes keep per directory) are done. The copy is built under a
hidden name beside DST (``.DST.cachefs-clone-`` and 8 random hex digits) and renamed to DST
when complete, so DST appears whole or not at all; an interrupted clone
leaves the hidden copy, which the error names.

A delete is one ``DeleteTree`` (the directory leaves the namespace at once);
the leader frees the inodes in batches in the background whether or not this
command waits, which it does (unless ``--background``) polling how many are
left. Blocks are the garbage collector's, as after any unlink.

``SRC`` and ``DST`` are paths inside one cachefs mount, or with ``--volume``
and ``--meta`` paths inside that volume. A client credential of the volume
will do, as for any change inside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import click
import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.config import ADDRS, setup_logging, tls_options
from cachefs.errors import CacheFSError, Exists, InvalidArgument, NotFound
from cachefs.metanode.client import MetaClient
from cachefs.metanode.cliopts import run_admin

from .info import locate_in_mount

CALL_DEADLINE = 30.0  # per metanode call: a clone or purge step of 1,000 entries is one Raft entry

BATCH = 1000  # entries per CloneDir: a few ms of apply on every replica
Progress = Callable[[int, int], None]  # (entries done, entries in all)


def _split(path: str) -> tuple[str, bytes]:
    parent, name = posixpath.split("/" + path.strip("/"))
    return parent, os.fsencode(name)


async def clone_tree(mc: MetaClient, volume: str, src: str, dst: str, progress: Progress | None = None
                     ) -> dict[str, Any]:  # fmt: skip
    """Clone ``src`` as ``dst`` inside ``volume``; what ``--json`` prints.

    Raises:
        CacheFSError: a path is wrong (named), or the metanodes refused a step;
            if the copy was begun, the message names where its part is.
    """
    started = time.monotonic()
    src_parent_path, src_name = _split(src)
    dst_parent_path, dst_name = _split(dst)
    if not src_name:
        raise InvalidArgument("cannot clone the root of a volume: clone a directory in it")
    if not dst_name:
        raise InvalidArgument("the destination must name a new entry, not the root")
    src_parent = await mc.resolve(volume, src_parent_path)
    source = await mc.query(Q.Lookup(volume, src_parent.ino, src_name))
    dst_parent = await mc.resolve(volume, dst_parent_path)
    with contextlib.suppress(NotFound):
        await mc.query(Q.Lookup(volume, dst_parent.ino, dst_name))
        raise Exists(f"{dst} exists")
    out = {"volume": volume, "src": src, "dst": dst, "entries": 1, "bytes": 0}
    if not source.is_dir:
        top = await mc.mutate(C.CloneEntry(volume, src_parent.ino, src_name, dst_parent.ino, dst_name))
        return {**out, "bytes": top["bytes"], "seconds": round(time.monotonic() - started, 3)}
    total = (await mc.query(Q.GetUsage(volume, source.ino))).inodes + 1
    hidden = b"." + dst_name[:200] + b".cachefs-clone-" + secrets.token_hex(4).encode()
    top = await mc.mutate(C.CloneEntry(volume, src_parent.ino, src_name, dst_parent.ino, hidden))
    done = 1
    try:
        todo = [(source.ino, top["ino"])]
        while todo:
            src_ino, copy_ino = todo.pop()
            cookie = 0
            while True:
                step = await mc.mutate(C.CloneDir(volume, src_ino, copy_ino, cookie, BATCH))
                todo.extend((s, d) for s, d in step["dirs"])
                done += step["entries"]
                out["bytes"] += step["bytes"]
                if progress is not None:
                    progress(done, max(total, done))  # the source may grow meanwhile
                cookie = step["cookie"]
                if not cookie:
                    break
        await mc.mutate(C.Rename(volume, dst_parent.ino, hidden, dst_parent.ino, dst_name,
                                 flags=C.RENAME_NOREPLACE))  # fmt: skip
    except CacheFSError as exc:
        where = posixpath.join(dst_parent_path, os.fsdecode(hidden))
        exc.message = f"{exc.message} (the partial copy is {where}: remove it with cachefs tree delete)"
        raise
    return {**out, "entries": done, "seconds": round(time.monotonic() - started, 3)}


async def delete_tree(mc: MetaClient, volume: str, path: str, progress: Progress | None = None, *,
                      background: bool = False, poll: float = 0.2) -> dict[str, Any]:  # fmt: skip
    """Delete directory ``path`` of ``volume``: it leaves the namespace at
    once, and the metanodes free its inodes in the background; unless
    ``background``, wait (showing progress) until they have. What ``--json`` prints."""
    started = time.monotonic()
    parent_path, name = _split(path)
    if not name:
        raise InvalidArgument("cannot delete the root of a volume (cachefs volume delete deletes a volume)")
    parent = await mc.resolve(volume, parent_path)
    begun = await mc.mutate(C.DeleteTree(volume, parent.ino, name))
    total, left = begun["inodes"], begun["inodes"]
    while not background and left:
        if progress is not None:
            progress(total - left, total)
        await trio.sleep(poll)
        rows = [r for r in await mc.query(Q.ListTreeDeletes(volume)) if r["ino"] == begun["ino"]]
        left = rows[0]["left"] if rows else 0
    if progress is not None and not background:
        progress(total, total)
    return {"volume": volume, "path": path, "inodes": total, "done": not left,
            "seconds": round(time.monotonic() - started, 3)}


@contextlib.contextmanager
def _bar(enabled: bool, what: str) -> Iterator[Progress | None]:
    """A progress bar of entries on stderr when it is a terminal."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield None
        return
    with Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TextColumn("entries"), TimeElapsedColumn(),
                  TextColumn("ETA"), TimeRemainingColumn(), console=console) as bar:  # fmt: skip
        task = bar.add_task(what, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _target(paths: tuple[str, ...], volume: str | None, meta: list[str] | None) -> tuple[str, list[str], list[str]]:
    """``(volume, paths inside it, metanode addresses)``: of one mount, or given."""
    if volume:
        if not meta:
            raise click.UsageError("--volume needs --meta")
        return volume, ["/" + p.strip("/") for p in paths], meta
    found = [locate_in_mount(p) for p in paths]  # DST need not exist: realpath resolves what does
    if len({(v, tuple(m)) for v, _inner, m in found}) > 1:
        raise click.UsageError("the paths are in different cachefs volumes or clusters: a clone stays in one volume")
    inners = [inner for _v, inner, _m in found]
    return found[0][0], inners, meta or found[0][2]


_options = [
    click.option("--volume", help="The volume the paths are in (with --meta; default: the mount they are inside)."),
    click.option("--meta", type=ADDRS, envvar="CACHEFS_META", help="Metanode addresses (default: the mount's)."),
    click.option("--json", "as_json", is_flag=True, help="Print one JSON object."),
    click.option("--quiet", "-q", is_flag=True, help="No progress bar."),
    click.option("--secret-file", envvar="CACHEFS_SECRET_FILE", type=click.Path(dir_okay=False),
                 help="A client credential of the volume, an admin one, or the cluster secret."),  # fmt: skip
    click.option("--insecure", is_flag=True, envvar="CACHEFS_INSECURE", help="Talk to an insecure (lab) cluster."),
    click.option("--log-level", default="WARNING", show_default=True),
]


def _with_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_options):
        fn = option(fn)
    return tls_options(fn)


@click.group("tree")
def tree() -> None:
    """Operations on whole directory trees, done by the metanodes."""


@tree.command("clone")
@click.argument("src")
@click.argument("dst")
@_with_options
def clone(src: str, dst: str, volume: str | None, meta: list[str] | None, as_json: bool, quiet: bool,
          secret_file: str | None, insecure: bool, log_level: str, tls_cert: str | None, tls_key: str | None,
          tls_ca: str | None) -> None:  # fmt: skip
    """Copy directory (or file) SRC as DST without copying data: the copy shares
    SRC's blocks, and a write to either never changes the other."""
    setup_logging("tree", log_level)
    volume, (inner_src, inner_dst), meta = _target((src, dst), volume, meta)
    with _bar(not quiet and not as_json, "clone") as progress:
        out = run_admin(meta, secret_file, insecure,
                        lambda mc: clone_tree(mc, volume, inner_src, inner_dst, progress),
                        (tls_cert, tls_key, tls_ca), deadline=CALL_DEADLINE)  # fmt: skip
    if as_json:
        click.echo(json.dumps(out))
    else:
        click.echo(f"cloned {src} as {dst}: {out['entries']} entries, {out['bytes']} bytes shared, "
                   f"in {out['seconds']:.1f} s")


@tree.command("delete")
@click.argument("path")
@click.option("--background", is_flag=True, help="Return once PATH is gone from the namespace; "
              "the metanodes free its inodes after (their blocks go through cachefs gc).")  # fmt: skip
@_with_options
def delete(path: str, background: bool, volume: str | None, meta: list[str] | None, as_json: bool, quiet: bool,
           secret_file: str | None, insecure: bool, log_level: str, tls_cert: str | None, tls_key: str | None,
           tls_ca: str | None) -> None:  # fmt: skip
    """Delete directory PATH and everything in it, on the metanodes: PATH is
    gone at once, its inodes are freed in batches (progress shown), and the
    blocks no other file holds go to the garbage collector."""
    setup_logging("tree", log_level)
    volume, (inner,), meta = _target((path,), volume, meta)
    with _bar(not quiet and not as_json and not background, "delete") as progress:
        out = run_admin(meta, secret_file, insecure,
                        lambda mc: delete_tree(mc, volume, inner, progress, background=background),
                        (tls_cert, tls_key, tls_ca), deadline=CALL_DEADLINE)  # fmt: skip
    if as_json:
        click.echo(json.dumps(out))
    elif out["done"]:
        click.echo(f"deleted {path}: {out['inodes']} inodes, in {out['seconds']:.1f} s")
    else:
        click.echo(f"{path} is gone; the metanodes are freeing its {out['inodes']} inodes in the background")


@tree.command("status")
@click.argument("path", required=False)
@_with_options
def status(path: str | None, volume: str | None, meta: list[str] | None, as_json: bool, quiet: bool,
           secret_file: str | None, insecure: bool, log_level: str, tls_cert: str | None, tls_key: str | None,
           tls_ca: str | None) -> None:  # fmt: skip
    """The tree deletes still going on in the volume (of the mount PATH is in, or --volume)."""
    del quiet
    setup_logging("tree", log_level)
    if not volume and path is None:
        raise click.UsageError("give a PATH inside a mount, or --volume and --meta")
    volume, _inner, meta = _target((path or "/",), volume, meta)
    rows = run_admin(meta, secret_file, insecure, lambda mc: mc.query(Q.ListTreeDeletes(volume)),
                     (tls_cert, tls_key, tls_ca), deadline=CALL_DEADLINE)  # fmt: skip
    if as_json:
        click.echo(json.dumps(rows))
        return
    if not rows:
        click.echo(f"{volume}: no tree deletes in progress")
    for r in rows:
        click.echo(f"{volume}: tree {r['ino']}: {r['inodes'] - r['left']} of {r['inodes']} inodes freed, "
                   f"{r['left']} left (since {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(r['since_ns'] / 1e9))} UTC)")
