"""``cachefs volume ...``: create, list and delete volumes, set and show directory quotas;
``cachefs dump`` / ``cachefs load``: a volume's metadata backup (``backup.py``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click

from cachefs import commands as C
from cachefs import messages as M
from cachefs import queries as Q
from cachefs.backing.objects import ObjectBlocks, ObjectTarget
from cachefs.commands import check_policy
from cachefs.config import SIZE, tls_options
from cachefs.errors import CacheFSError

from . import backup
from .client import MetaClient
from .cliopts import insecure_option as _insecure
from .cliopts import meta_option as _meta
from .cliopts import run_admin as _run
from .cliopts import secret_option as _secret


@click.group()
def volume() -> None:
    """Create and inspect volumes (named namespaces with a storage policy)."""


@volume.command("create")
@click.argument("name")
@click.option(
    "--policy",
    default=None,
    help="Redundancy: ec:K+M (erasure coded) or replica:N.  [default: ec:4+2; with --backing the "
    "store's own, recorded as replica:1]",
)
@click.option(
    "--compression",
    type=click.Choice(["none", "zstd"]),
    default="none",
    show_default=True,
    help="Compress blocks before encoding.",
)
@click.option(
    "--block-size",
    type=SIZE,
    default="4M",
    show_default=True,
    help="Block size (divides the 64 MiB chunk), e.g. 1M, 4M.",
)
@click.option(
    "--pg-count",
    type=click.IntRange(1, 65536),
    default=64,
    show_default=True,
    help="Placement groups of the volume.",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    help="Mounts need the token in this file (the metanodes keep only its hash).",
)
@click.option(
    "--open",
    "open_",
    is_flag=True,
    help="Any client credential for it may mount it (the default without --token-file).",
)
@click.option(
    "--backing",
    default="",
    metavar="s3://BUCKET/PREFIX",
    help="Keep the volume's blocks as objects there instead of on the datanodes (AWS credentials the "
    "standard way on the mounts, cache nodes and metanodes; see cachefs/backing/objects.py).",
)
@click.option("--endpoint", default="", help="With --backing: endpoint URL of an S3-compatible store (default: AWS).")
@click.option("--region", default="", help="With --backing: the store's region.")
@_meta
@_secret
@_insecure
@tls_options
def create(
    name: str,
    policy: str | None,
    compression: str,
    block_size: int,
    pg_count: int,
    token_file: str | None,
    open_: bool,
    backing: str,
    endpoint: str,
    region: str,
    meta: list[str],
    secret_file: str | None,
    insecure: bool,
    tls_cert: str | None,
    tls_key: str | None,
    tls_ca: str | None,
) -> None:
    """Create volume NAME."""
    token = _access(token_file, open_)
    target = None
    try:
        if backing:
            from cachefs.repo.url import S3Url

            if policy not in (None, "replica:1"):
                raise click.UsageError(f"--policy {policy}: with --backing the store keeps the blocks redundant")
            backing = str(S3Url.parse(backing))
            target = ObjectTarget.from_volume({"backing": backing, "endpoint": endpoint, "region": region})
        policy = check_policy(policy or ("replica:1" if backing else "ec:4+2"), compression, block_size)
        cmd = C.CreateVolume(name, policy, compression, block_size, pg_count, backing=backing,
                             backing_endpoint=endpoint, backing_region=region)  # validates all
    except CacheFSError as exc:
        raise click.BadParameter(exc.message, param_hint="NAME/--policy/--block-size/--backing") from None

    async def create(mc: MetaClient) -> Any:
        if target is not None:  # with this machine's credentials: a misconfigured store fails here, not at a write
            await ObjectBlocks().store(name, target).list_page(target.prefix, limit=1)
        return await mc.mutate(cmd, token=token)

    spec = _run(meta, secret_file, insecure, create, (tls_cert, tls_key, tls_ca))
    click.echo(f"created volume {name}: {json.dumps(spec)}")


@volume.command("set")
@click.argument("name")
@click.option(
    "--compression",
    type=click.Choice(["none", "zstd"]),
    help="Compression of blocks written from now on (old blocks keep theirs).",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    help="From now on mounts need the token in this file.",
)
@click.option("--open", "open_", is_flag=True, help="From now on mounts need no token.")
@_meta
@_secret
@_insecure
@tls_options
def set_(
    name: str, compression: str | None, token_file: str | None, open_: bool, meta: list[str],
    secret_file: str | None, insecure: bool,
    tls_cert: str | None, tls_key: str | None, tls_ca: str | None,
) -> None:
    """Change volume NAME's settings (redundancy and block size are fixed)."""
    if compression is None and token_file is None and not open_:
        raise click.UsageError("nothing to set: give --compression, --token-file or --open")
    token = _access(token_file, open_)

    async def change(mc: MetaClient) -> dict:
        out: dict = {}
        if compression is not None:
            out.update(await mc.mutate(C.SetVolumeCompression(name, compression)))
        if token_file is not None or open_:
            out.update(await mc.mutate(C.SetVolumeAccess(name), token=token))
        return out

    spec = _run(meta, secret_file, insecure, change, (tls_cert, tls_key, tls_ca))
    click.echo(f"volume {name}: {json.dumps(spec)}")


def _access(token_file: str | None, open_: bool) -> str | None:
    """The token in ``token_file`` (None with --open); one of the two only."""
    if token_file is not None and open_:
        raise click.UsageError("give --token-file or --open, not both")
    if token_file is None:
        return None
    try:
        token = Path(token_file).read_text().strip()
    except OSError as exc:
        raise click.BadParameter(f"cannot read {token_file}: {exc.strerror}", param_hint="--token-file") from None
    if not token:
        raise click.BadParameter(f"{token_file} is empty", param_hint="--token-file")
    return token


@volume.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_meta
@_secret
@_insecure
@tls_options
def list_(as_json: bool, meta: list[str], secret_file: str | None, insecure: bool,
          tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> None:
    """List the volumes with their policy and usage."""
    vols = _run(meta, secret_file, insecure, lambda mc: mc.query(Q.ListVolumes()), (tls_cert, tls_key, tls_ca))
    if as_json:
        click.echo(json.dumps(vols))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="volumes")
    for col in ("name", "policy", "compression", "block size", "PGs", "bytes", "inodes"):
        table.add_column(col)
    for name, v in sorted(vols.items()):
        table.add_row(
            name,
            v.get("backing") or v["policy"],
            v["compression"],
            str(v["block_size"]),
            str(v["pg_count"]),
            "deleted: blocks being collected" if v.get("deleted") else str(v["used_bytes"]),
            "" if v.get("deleted") else str(v["used_inodes"]),
        )
    Console().print(table)


@volume.command("delete")
@click.argument("name")
@click.option("--force", is_flag=True, help="Delete it even while mounted (the mounts' sessions are closed).")
@_meta
@_secret
@_insecure
@tls_options
def delete(name: str, force: bool, meta: list[str], secret_file: str | None, insecure: bool,
           tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> None:  # fmt: skip
    """Delete volume NAME: its files at once, its blocks by the garbage collector.

    Refused while the volume is mounted (sessions open) unless --force. The
    name stays taken until the collector has deleted every block (after the
    grace period; cachefs gc --delete --grace 0 does it now).
    """
    done = _run(meta, secret_file, insecure, lambda mc: mc.mutate(C.DeleteVolume(name, force)),
                (tls_cert, tls_key, tls_ca))  # fmt: skip
    click.echo(f"volume {name} deleted: {done['slices_trashed']} slices to the garbage collector, "
               f"{done['sessions_closed']} sessions closed")


@volume.command("quota")
@click.argument("name")
@click.argument("ino", type=click.IntRange(1))
@click.option("--max-bytes", type=SIZE, default=None, help="Byte limit of the subtree.")
@click.option("--max-inodes", type=click.IntRange(0), default=None, help="Inode limit.")
@click.option("--clear", is_flag=True, help="Remove both limits.")
@_meta
@_secret
@_insecure
@tls_options
def quota(
    name: str,
    ino: int,
    max_bytes: int | None,
    max_inodes: int | None,
    clear: bool,
    meta: list[str],
    secret_file: str | None,
    insecure: bool,
    tls_cert: str | None,
    tls_key: str | None,
    tls_ca: str | None,
) -> None:
    """Show (or set) the usage and quota of directory INO of volume NAME."""

    async def go(mc: MetaClient) -> Any:
        if clear or max_bytes is not None or max_inodes is not None:
            usage = await mc.mutate(C.SetQuota(name, ino, max_bytes, max_inodes))
        else:
            usage = await mc.query(Q.GetUsage(name, ino))
        return usage._asdict()

    click.echo(json.dumps(_run(meta, secret_file, insecure, go, (tls_cert, tls_key, tls_ca))))


# -- quotas by path -----------------------------------------------------------------

_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


class CountType(click.ParamType):
    """An inode count: ``1000000`` or ``1M`` (decimal suffixes K, M, G, T)."""

    name = "COUNT"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().upper()
        digits, suffix = (text[:-1], text[-1]) if text[-1:] in _COUNT_SUFFIX else (text, "")
        try:
            count = int(digits) * _COUNT_SUFFIX[suffix]
        except ValueError:
            self.fail(f"{value!r} is not a count (e.g. 1000000 or 1M)", param, ctx)
        if count < 0:
            self.fail(f"{value!r} is negative", param, ctx)
        return count


def _scope(volume_name: str, path: str, attr: Any, usage: M.Usage) -> dict[str, Any]:
    """A quota scope's usage, in Backend.AI's terms (``QuotaUsage``: used and limit bytes)."""
    return {"volume": volume_name, "path": path, "inode": attr.ino, "used_bytes": usage.bytes,
            "limit_bytes": usage.max_bytes, "used_inodes": usage.inodes, "limit_inodes": usage.max_inodes}


def _show(scope: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(scope))
        return
    limit_b = "unlimited" if scope["limit_bytes"] is None else scope["limit_bytes"]
    limit_i = "unlimited" if scope["limit_inodes"] is None else scope["limit_inodes"]
    click.echo(f"{scope['volume']}:{scope['path']} (inode {scope['inode']}): bytes {scope['used_bytes']} / "
               f"{limit_b}, inodes {scope['used_inodes']} / {limit_i}")


@click.group("quota")
def quota_group() -> None:
    """Quotas by directory: limits on the bytes and inodes of a subtree (EDQUOT past them).

    Every link of a file counts in each directory above it; usage is kept per
    directory by the metanodes as files change, so reading it is O(1).
    """


@quota_group.command("set")
@click.argument("volume_name", metavar="VOLUME")
@click.argument("path")
@click.option("--bytes", "--capacity", "capacity", type=SIZE, default=None,
              help="Byte limit of the subtree (e.g. 10T; --capacity is the same).")
@click.option("--inodes", type=CountType(), default=None, help="Inode limit of the subtree (e.g. 1M).")
@click.option("--json", "as_json", is_flag=True, help="Print the scope as one JSON object.")
@_meta
@_secret
@_insecure
@tls_options
def quota_set(volume_name: str, path: str, capacity: int | None, inodes: int | None, as_json: bool, meta: list[str],
              secret_file: str | None, insecure: bool, tls_cert: str | None, tls_key: str | None,
              tls_ca: str | None) -> None:  # fmt: skip
    """Limit directory PATH of VOLUME (a limit not given stays as it was)."""
    if capacity is None and inodes is None:
        raise click.UsageError("nothing to set: give --bytes, --inodes or both")

    async def go(mc: MetaClient) -> dict[str, Any]:
        attr = await mc.resolve(volume_name, path)
        old = await mc.query(Q.GetUsage(volume_name, attr.ino))
        new = C.SetQuota(volume_name, attr.ino, old.max_bytes if capacity is None else capacity,
                         old.max_inodes if inodes is None else inodes)  # fmt: skip
        return _scope(volume_name, path, attr, await mc.mutate(new))

    _show(_run(meta, secret_file, insecure, go, (tls_cert, tls_key, tls_ca)), as_json)


@quota_group.command("get")
@click.argument("volume_name", metavar="VOLUME")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print the scope as one JSON object.")
@_meta
@_secret
@_insecure
@tls_options
def quota_get(volume_name: str, path: str, as_json: bool, meta: list[str], secret_file: str | None, insecure: bool,
              tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> None:  # fmt: skip
    """Show the usage and limits of directory PATH of VOLUME (a client credential will do)."""

    async def go(mc: MetaClient) -> dict[str, Any]:
        attr = await mc.resolve(volume_name, path)
        return _scope(volume_name, path, attr, await mc.query(Q.GetUsage(volume_name, attr.ino)))

    _show(_run(meta, secret_file, insecure, go, (tls_cert, tls_key, tls_ca)), as_json)


@quota_group.command("list")
@click.argument("volume_name", metavar="VOLUME")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list.")
@_meta
@_secret
@_insecure
@tls_options
def quota_list(volume_name: str, as_json: bool, meta: list[str], secret_file: str | None, insecure: bool,
               tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> None:  # fmt: skip
    """List every directory of VOLUME with a quota, with its usage."""
    rows = _run(meta, secret_file, insecure, lambda mc: mc.query(Q.ListQuotas(volume_name)),
                (tls_cert, tls_key, tls_ca))  # fmt: skip
    scopes = [{"volume": volume_name, **row, "path": os.fsdecode(row["path"])} for row in rows]
    if as_json:
        click.echo(json.dumps(scopes))
        return
    for scope in scopes:
        _show(scope, False)


@quota_group.command("unset")
@click.argument("volume_name", metavar="VOLUME")
@click.argument("path")
@_meta
@_secret
@_insecure
@tls_options
def quota_unset(volume_name: str, path: str, meta: list[str], secret_file: str | None, insecure: bool,
                 tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> None:  # fmt: skip
    """Remove both limits of directory PATH of VOLUME (its usage is still counted)."""

    async def go(mc: MetaClient) -> dict[str, Any]:
        attr = await mc.resolve(volume_name, path)
        return _scope(volume_name, path, attr, await mc.mutate(C.SetQuota(volume_name, attr.ino, None, None)))

    _show(_run(meta, secret_file, insecure, go, (tls_cert, tls_key, tls_ca)), False)


quota_group.add_command(quota_unset, "delete")  # the first name it had


@click.command("dump")
@click.argument("volume_name", metavar="VOLUME")
@click.argument("file", type=click.Path(dir_okay=False, writable=True))
@_meta
@_secret
@_insecure
@tls_options
def dump(
    volume_name: str,
    file: str,
    meta: list[str],
    secret_file: str | None,
    insecure: bool,
    tls_cert: str | None,
    tls_key: str | None,
    tls_ca: str | None,
) -> None:
    """Write a metadata backup of VOLUME to FILE (needs an admin credential).

    The leader takes it from a consistent view of one moment while writers
    go on. Only metadata: the blocks stay on the datanodes (see cachefs load)."""

    async def go(mc: MetaClient) -> bytes:
        reply = await mc.call(
            Q.DumpVolume.NAME, {"a": Q.DumpVolume(volume_name).to_wire()}, full=True, deadline=120.0
        )
        return bytes(reply.payload or b"")

    blob = _run(meta, secret_file, insecure, go, (tls_cert, tls_key, tls_ca))
    try:
        summary = backup.parse(blob, "the leader's dump")  # never write a file load would refuse
    except CacheFSError as exc:
        raise click.ClickException(exc.message) from None
    path = Path(file)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    click.echo(
        f"dumped volume {volume_name}: {len(summary.volume.inodes)} inodes, {len(blob)} bytes to {file}"
    )


@click.command("load")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@_meta
@_secret
@_insecure
@tls_options
def load(
    file: str,
    meta: list[str],
    secret_file: str | None,
    insecure: bool,
    tls_cert: str | None,
    tls_key: str | None,
    tls_ca: str | None,
) -> None:
    """Restore the volume in backup FILE (from cachefs dump) into a cluster
    that has no volume yet, whose datanodes hold the blocks (needs an admin
    credential). A bad or foreign file is refused before it is sent."""
    blob = Path(file).read_bytes()
    try:
        backup.parse(blob, file)
    except CacheFSError as exc:
        raise click.ClickException(exc.message) from None

    async def go(mc: MetaClient) -> Any:
        return await mc.call("restore_volume", {}, payload=blob, deadline=120.0)

    done = _run(meta, secret_file, insecure, go, (tls_cert, tls_key, tls_ca))
    click.echo(
        f"loaded volume {done['volume']}: {done['inodes']} inodes, {done['used_bytes']} bytes used"
    )
