"""``cachefs info PATH``: where a file's bytes are, as JuiceFS's ``info`` shows it.

For one path: its inode and attributes, then for a regular file every chunk's
slices (in commit order, as the metanodes keep them), every block of each
slice, which datanode holds each shard of the block (its placement-group
member, or a handoff substitute; a ``stat`` of the shard, so its header is
checked, not its data) and which cache nodes hold the block on flash (each
cache node answers ``holds`` for all the blocks at once, without a
read-through and without touching its LRU).

``PATH`` is a path inside a mount (the volume comes from the mount's
``fsname``, the metanode addresses from its pid file), or, with ``--volume``
and ``--meta``, a path inside the volume. Every answer is read, nothing
changes. It needs a credential that may read the volume's metadata and
``stat`` its shards: a client credential of the volume does, as does an admin
one.
"""

from __future__ import annotations

import functools
import json
import os
import stat
from pathlib import Path
from typing import Any

import click
import trio

from cachefs import queries as Q
from cachefs.backing.client import BackingClient
from cachefs.backing.cluster import MetaClusterView
from cachefs.backing.gc import record_block_keys
from cachefs.backing.repair import Repairer
from cachefs.config import ADDRS, load_secret, load_tls, setup_logging, tls_options
from cachefs.errors import CacheFSError
from cachefs.ids import CHUNK_SIZE, BlockKey, is_repo_slice
from cachefs.metanode.client import MetaClient
from cachefs.ring import CacheNodeInfo, CacheRouter
from cachefs.rpc import RpcPool
from cachefs.tasks import run_all

HOLDS_PAGE = 10_000  # cachenode.service.MAX_HOLDS
FSNAME = "cachefs:"  # the mount's fsname is cachefs:VOLUME (client/mount.py fuse_options)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symlink")):
        if test(mode):
            return name
    return "special"


def locate_in_mount(path: str) -> tuple[str, str, list[str]]:
    """``(volume, path inside the volume, metanode addresses)`` of a path inside a cachefs mount."""
    real = os.path.realpath(path)
    best = None
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError as exc:
        raise click.UsageError(f"cannot read /proc/self/mountinfo: {exc}") from None
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        point = fields[4].encode().decode("unicode_escape")
        fstype, source = fields[sep + 1], fields[sep + 2]
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        ours = fstype == "fuse.cachefs" and source.startswith(FSNAME)
        if inside and ours and (best is None or len(point) >= len(best[0])):  # the innermost mount
            best = (point, source[len(FSNAME):])
    if best is None:
        raise click.UsageError(f"{path} is not inside a cachefs mount (give --volume and --meta)")
    point, volume = best
    from cachefs.client.mount import mount_meta_addrs  # only here: it needs the [mount] extra

    meta = mount_meta_addrs(point)
    if not meta:
        raise click.UsageError(f"the mount at {point} does not say which metanodes it uses (give --meta)")
    return volume, "/" + os.path.relpath(real, point).removeprefix("."), meta


async def _cache_holders(pool: RpcPool, cachenodes: list[CacheNodeInfo], volume: str,
                         keys: list[BlockKey]) -> tuple[dict[BlockKey, list[str]], list[str]]:  # fmt: skip
    """Which up cache nodes hold each key, and the errors of those that did not answer."""
    held: dict[BlockKey, list[str]] = {k: [] for k in keys}
    errors: list[str] = []

    async def ask(node: CacheNodeInfo) -> None:
        for start in range(0, len(keys), HOLDS_PAGE):
            page = keys[start:start + HOLDS_PAGE]
            try:
                reply = await pool.call(node.addr, "holds", {"volume": volume, "keys": [k.to_bytes() for k in page]},
                                        timeout=10.0)  # fmt: skip
            except CacheFSError as exc:
                errors.append(f"cache node {node.id}: {exc}")
                return
            for key, has in zip(page, reply.result, strict=True):
                if has:
                    held[key].append(node.id)

    await run_all(functools.partial(ask, n) for n in cachenodes if n.up)
    for ids in held.values():
        ids.sort()
    return held, errors


async def describe(pool: RpcPool, meta_addrs: list[str], volume: str, path: str) -> dict[str, Any]:
    """Everything ``cachefs info`` prints, as its ``--json`` object."""
    meta = MetaClient(pool, meta_addrs, deadline=15.0)
    attr = await meta.resolve(volume, path)
    out: dict[str, Any] = {"volume": volume, "path": path, "inode": attr.ino, "type": _kind(attr.mode),
                           "size": attr.size, "mode": f"{stat.S_IMODE(attr.mode):04o}", "nlink": attr.nlink,
                           "uid": attr.uid, "gid": attr.gid, "version": attr.version, "errors": []}  # fmt: skip
    if not attr.is_reg:
        return out
    view = MetaClusterView(meta)
    await view.refresh()
    cmap = await meta.query(Q.ClusterMap())
    policy = view.policy(volume)
    block_size = policy.block_size
    out.update(policy=str(policy), block_size=block_size, chunks=[])
    backing = BackingClient(pool, view)
    repairer = Repairer(backing)
    router = CacheRouter(cmap, my_zone="")
    cachenodes = [CacheNodeInfo.from_map(n) for n in cmap.get("cachenodes", [])]
    blocks: list[tuple[BlockKey, dict[str, Any]]] = []
    for chunk in range((attr.size + CHUNK_SIZE - 1) // CHUNK_SIZE):
        slices = []
        for rec in await meta.query(Q.ReadChunk(volume, attr.ino, chunk)):
            row: dict[str, Any] = {"id": rec.id, "pos": rec.pos, "length": rec.length, "offset": rec.offset,
                                   "blocks": []}  # fmt: skip
            if is_repo_slice(rec.id):
                row["repo"] = True  # an imported object: its bytes are in S3, not on the datanodes
            for key in sorted(record_block_keys(rec, block_size)):
                block: dict[str, Any] = {"key": key.hex(), "index": key.index}
                row["blocks"].append(block)
                blocks.append((key, block))
            slices.append(row)
        out["chunks"].append({"index": chunk, "slices": slices})

    async def shards(key: BlockKey, block: dict[str, Any]) -> None:
        pg = view.placement(volume, key)
        held = await repairer.holdings(volume, key, pg, policy.n, ())
        block["shards"] = [{"index": i, "placed": pg[i], "held_by": sorted(held.get(i, ()))}
                           for i in range(policy.n)]  # fmt: skip
        block["shards_held"] = sum(bool(held.get(i)) for i in range(policy.n))

    async def stored_object(key: BlockKey, block: dict[str, Any]) -> None:
        assert target is not None
        try:
            block["object"] = await backing.objects.stat(volume, target, key)
        except CacheFSError as exc:
            out["errors"].append(str(exc))
            return
        if block["object"] is None:
            out["errors"].append(f"block {key.hex()}: no object {target.object_key(key)!r} in {target.url}")

    target = view.target(volume)
    if target is not None:  # one object per block (volume create --backing), no shards
        out["backing"] = target.url
    owned = [(key, block) for key, block in blocks if not is_repo_slice(key.slice_id)]
    await run_all(functools.partial(shards if target is None else stored_object, key, block)
                  for key, block in owned)  # fmt: skip
    holders, errors = await _cache_holders(pool, cachenodes, volume, [k for k, _ in blocks])
    out["errors"].extend(errors)
    for key, block in blocks:
        block["cache_owners"] = [n.id for n in router.owners(key)]
        block["cached_on"] = holders[key]
    return out


def _where(block: dict[str, Any]) -> str:
    """Where a block's bytes are stored: its shards, its object, or (imported) the linked bucket."""
    if "shards" in block:
        return "shards " + ", ".join(f"{sh['index']}:{'+'.join(sh['held_by']) or 'MISSING'}" for sh in block["shards"])
    if "object" in block:
        obj = block["object"]
        return "object MISSING" if obj is None else f"object {obj['key']} ({obj['size']} bytes, " \
            f"checksum {obj['checksum'] or 'NONE'})"
    return "in the linked bucket"


def _print(info: dict[str, Any]) -> None:
    click.echo(f"{info['path']} (volume {info['volume']})")
    click.echo(f"  inode {info['inode']}, {info['type']}, size {info['size']}, mode {info['mode']}, "
               f"nlink {info['nlink']}, uid {info['uid']}, gid {info['gid']}, version {info['version']}")
    if info["type"] != "file":
        return
    click.echo(f"  policy {info['policy']}, block size {info['block_size']}"
               + (f", blocks in {info['backing']}" if "backing" in info else ""))
    for chunk in info["chunks"]:
        click.echo(f"  chunk {chunk['index']}: {len(chunk['slices'])} slices")
        for s in chunk["slices"]:
            where = " (S3 object)" if s.get("repo") else ""
            click.echo(f"    slice {s['id']}: pos {s['pos']}, length {s['length']}, offset {s['offset']}{where}")
            for b in s["blocks"]:
                cached = ",".join(b["cached_on"]) or "-"
                click.echo(f"      block {b['key']}: {_where(b)}; cached on {cached} "
                           f"(owners {','.join(b['cache_owners']) or '-'})")
    for err in info["errors"]:
        click.echo(f"  error: {err}", err=True)


@click.command("info")
@click.argument("path")
@click.option("--volume", help="The volume PATH is in (with --meta; default: the mount PATH is inside).")
@click.option("--meta", type=ADDRS, envvar="CACHEFS_META", help="Metanode addresses (default: the mount's).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--secret-file", envvar="CACHEFS_SECRET_FILE", type=click.Path(dir_okay=False),
              help="A credential that may read the volume (client or admin) or the cluster secret.")  # fmt: skip
@click.option("--insecure", is_flag=True, envvar="CACHEFS_INSECURE", help="Talk to an insecure (lab) cluster.")
@click.option("--log-level", default="WARNING", show_default=True)
@tls_options
def command(path: str, volume: str | None, meta: list[str] | None, as_json: bool, secret_file: str | None,
            insecure: bool, log_level: str, tls_cert: str | None, tls_key: str | None,
            tls_ca: str | None) -> None:  # fmt: skip
    """Show a file's inode, slices, blocks, and where each block's shards and cached copies are."""
    setup_logging("info", log_level)
    if volume:
        if not meta:
            raise click.UsageError("--volume needs --meta")
        inner = "/" + path.strip("/")
    else:
        volume, inner, found = locate_in_mount(path)
        meta = meta or found
    secret = load_secret(secret_file, insecure)
    _, tls = load_tls(tls_cert, tls_key, tls_ca)

    async def run() -> dict[str, Any]:
        async with RpcPool(secret=secret, tls=tls) as pool:
            return await describe(pool, meta, volume, inner)

    try:
        info = trio.run(run)
    except CacheFSError as exc:
        raise click.ClickException(f"{path}: {exc}") from None
    if as_json:
        click.echo(json.dumps(info))
    else:
        _print(info)
    if info["errors"]:
        raise SystemExit(1)
