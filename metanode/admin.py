"""``cachefs volume ...``: create, list and delete volumes, set and show directory quotas;
``cachefs dump`` / ``cachefs load``: a volume's metadata backup (``backup.py``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click

from cachefs import commands as C
from cachefs import queries as Q
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
    default="ec:4+2",
    show_default=True,
    help="Redundancy: ec:K+M (erasure coded) or replica:N.",
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
@_meta
@_secret
@_insecure
@tls_options
def create(
    name: str,
    policy: str,
    compression: str,
    block_size: int,
    pg_count: int,
    token_file: str | None,
    open_: bool,
    meta: list[str],
    secret_file: str | None,
    insecure: bool,
    tls_cert: str | None,
    tls_key: str | None,
    tls_ca: str | None,
) -> None:
    """Create volume NAME."""
    token = _access(token_file, open_)
    try:
        policy = check_policy(policy, compression, block_size)
        cmd = C.CreateVolume(name, policy, compression, block_size, pg_count)  # validates all
    except CacheFSError as exc:
        raise click.BadParameter(exc.message, param_hint="NAME/--policy/--block-size") from None
    spec = _run(
        meta, secret_file, insecure, lambda mc: mc.mutate(cmd, token=token), (tls_cert, tls_key, tls_ca)
    )
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
            v["policy"],
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
