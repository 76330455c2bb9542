"""``cachefs datanode drain ADDR`` and ``cachefs datanode remove ADDR``: take a
datanode out of service without losing redundancy on the way.

Theory of operation
-------------------

Draining is two steps, each safe to interrupt and to run again:

1. ``DrainNode`` (a log command) marks the datanode *draining* in the cluster
   map: the placement groups are computed again without it (nodes that stay
   keep their positions, so only its slots move), and puts never hand a
   shard off to it. It stays up and serving: every shard it holds is still
   read from it, so nothing is degraded meanwhile.
2. Repair passes (:class:`cachefs.backing.repair.Repairer`, what ``cachefs
   repair`` runs) over every volume: each shard now *misplaced* on the
   draining node is copied to its new placement-group member, and then
   deleted from the draining node. After each pass the node is asked how
   many shards it still holds; the drain is done at zero (``--passes``
   bounds the passes: writes that raced the map change, or a node that was
   briefly down, are picked up by the next one).

Then the daemon can be stopped and ``cachefs datanode remove`` takes it out
of the map (a running datanode would register itself again, so remove
refuses one that answers, and one that was not drained, unless ``--force``).
``cachefs datanode drain ADDR --undo`` puts a draining node back.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click
import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.backing.client import BackingClient
from cachefs.backing.cluster import MetaClusterView
from cachefs.backing.repair import LIST_PAGE, Repairer
from cachefs.config import ADDRS, SIZE, load_secret, load_tls, tls_options
from cachefs.errors import CacheFSError, NotFound
from cachefs.rpc import RpcPool

if TYPE_CHECKING:
    from cachefs.metanode.client import MetaClient


def find_datanode(cmap: dict[str, Any], which: str) -> dict[str, Any]:
    """The datanode of the map whose address or id is ``which``."""
    for node in cmap.get("datanodes", []):
        if which in (node["addr"], node["id"]):
            return node
    known = ", ".join(f"{n['id']} ({n['addr']})" for n in cmap.get("datanodes", [])) or "none"
    raise NotFound(f"no datanode {which!r} in the cluster map (datanodes: {known})")


async def shards_on(pool: RpcPool, addr: str, volumes: list[str]) -> int:
    """How many shards of ``volumes`` the datanode at ``addr`` holds."""
    total = 0
    for volume in volumes:
        cursor = ""
        while True:
            page = (await pool.call(addr, "list", {"volume": volume, "cursor": cursor, "limit": LIST_PAGE},
                                    timeout=60.0)).result  # fmt: skip
            total += len(page["shards"])
            cursor = page["cursor"]
            if not cursor:
                break
    return total


async def drain(pool: RpcPool, meta: MetaClient, which: str, *, passes: int, rate: int | None,
                progress: Any = None) -> dict[str, Any]:  # fmt: skip
    """Mark the datanode draining, then repair until it holds no shard (see the module docstring)."""
    node = find_datanode(await meta.query(Q.ClusterMap()), which)
    await meta.mutate(C.DrainNode(node["id"], True))
    view = MetaClusterView(meta)
    repairer = Repairer(BackingClient(pool, view), rate=rate)
    out: dict[str, Any] = {"node": node["id"], "addr": node["addr"], "state": "draining", "passes": 0,
                           "shards_moved": 0, "shards_left": None, "errors": []}  # fmt: skip
    for _ in range(passes):
        await view.refresh()  # the placement groups without the node
        volumes = sorted(view.current.volumes)
        for volume in volumes:
            report = await repairer.repair_volume(volume)
            out["shards_moved"] += report.shards_moved
            out["errors"] += report.errors + report.unrecoverable
        out["passes"] += 1
        out["shards_left"] = await shards_on(pool, node["addr"], volumes)
        if progress is not None:
            progress(out)
        if out["shards_left"] == 0:
            out["state"] = "drained"
            break
    return out


def _meta_run(meta: list[str], secret_file: str | None, insecure: bool, tls_files: tuple[str | None, ...],
              go: Any) -> Any:  # fmt: skip
    from cachefs.metanode.client import MetaClient

    secret = load_secret(secret_file, insecure)
    _, tls = load_tls(*tls_files)

    async def main() -> Any:
        async with RpcPool(secret=secret, tls=tls) as pool:
            return await go(pool, MetaClient(pool, meta, deadline=30.0))

    try:
        return trio.run(main)
    except CacheFSError as exc:
        raise click.ClickException(str(exc)) from None


def _admin(fn: Any) -> Any:
    for option in reversed([
        click.option("--meta", type=ADDRS, required=True, envvar="CACHEFS_META",
                     help="Metanode addresses (comma separated)."),
        click.option("--secret-file", envvar="CACHEFS_SECRET_FILE", type=click.Path(dir_okay=False),
                     help="An admin credential or the cluster secret (or set CACHEFS_SECRET)."),
        click.option("--insecure", is_flag=True, envvar="CACHEFS_INSECURE",
                     help="Talk to a cluster that runs without authentication."),
        tls_options,
    ]):  # fmt: skip
        fn = option(fn)
    return fn


@click.command("drain")
@click.argument("which", metavar="ADDR")
@click.option("--passes", type=click.IntRange(1, 100), default=5, show_default=True,
              help="Repair passes at most before giving up (each moves what the last one missed).")
@click.option("--rate", type=SIZE, default="0", help="Write at most this many bytes/s (0: no limit).")
@click.option("--undo", is_flag=True, help="Put a draining datanode back into the placement groups.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as one JSON object.")
@_admin
def drain_command(which: str, passes: int, rate: int, undo: bool, as_json: bool, meta: list[str],
                  secret_file: str | None, insecure: bool, tls_cert: str | None, tls_key: str | None,
                  tls_ca: str | None) -> None:  # fmt: skip
    """Move every shard off the datanode at ADDR (or with id ADDR), so that it
    can be stopped and removed. Exits 0 once it holds no shard, 1 otherwise."""
    tls_files = (tls_cert, tls_key, tls_ca)
    if undo:
        async def back(pool: RpcPool, mc: MetaClient) -> dict[str, Any]:
            node = find_datanode(await mc.query(Q.ClusterMap()), which)
            return await mc.mutate(C.DrainNode(node["id"], False))

        node = _meta_run(meta, secret_file, insecure, tls_files, back)
        click.echo(json.dumps(node) if as_json else f"datanode {node['id']} ({node['addr']}) is back in placement")
        return

    def shown(out: dict[str, Any]) -> None:
        click.echo(f"drain {out['node']}: pass {out['passes']}: {out['shards_moved']} shards moved, "
                   f"{out['shards_left']} left", err=True)  # fmt: skip

    out = _meta_run(meta, secret_file, insecure, tls_files,
                    lambda pool, mc: drain(pool, mc, which, passes=passes, rate=rate or None,
                                           progress=None if as_json else shown))  # fmt: skip
    if as_json:
        click.echo(json.dumps(out))
    elif out["state"] == "drained":
        click.echo(f"datanode {out['node']} ({out['addr']}) is drained: stop it, then "
                   f"`cachefs datanode remove {out['addr']}`")  # fmt: skip
    else:
        click.echo(f"datanode {out['node']} still holds {out['shards_left']} shards after {out['passes']} passes")
    for line in out["errors"][:10]:
        click.echo(f"  {line}", err=True)
    sys.exit(0 if out["state"] == "drained" else 1)


@click.command("remove")
@click.argument("which", metavar="ADDR")
@click.option("--force", is_flag=True, help="Remove it even if it was not drained or still answers.")
@_admin
def remove_command(which: str, force: bool, meta: list[str], secret_file: str | None, insecure: bool,
                   tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> None:  # fmt: skip
    """Take the datanode at ADDR (or with id ADDR) out of the cluster map: drain
    it first and stop its daemon (a running one registers itself again)."""

    async def go(pool: RpcPool, mc: MetaClient) -> dict[str, Any]:
        node = find_datanode(await mc.query(Q.ClusterMap()), which)
        if not force:
            if not node.get("draining"):
                raise click.ClickException(f"datanode {node['id']} is not drained: "
                                           f"`cachefs datanode drain {node['addr']}` first (or --force)")  # fmt: skip
            try:
                await pool.call(node["addr"], "stats", timeout=2.0)
            except CacheFSError:
                pass  # stopped, as it should be
            else:
                raise click.ClickException(f"datanode {node['id']} still answers at {node['addr']}: stop it first "
                                           "(it would register itself again), or --force")  # fmt: skip
        await mc.mutate(C.RemoveNode("datanode", node["id"]))
        return node

    node = _meta_run(meta, secret_file, insecure, (tls_cert, tls_key, tls_ca), go)
    click.echo(f"datanode {node['id']} ({node['addr']}) removed")
