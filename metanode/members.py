"""``cachefs metanode add/remove/replace``: change the metanodes, one at a time.

Each step is one Raft configuration change on the leader
(``raft/membership.py``), so the cluster serves throughout:

* ``add ADDR``: the new metanode joins as a learner (start it with
  ``--join``; the leader sends it the log or a snapshot), and the leader
  makes it a voter once it has caught up. The command waits for that.
* ``remove ID``: it stops counting at once; a removed leader steps down once
  the change commits. Stop the removed process afterwards.
* ``replace ID ADDR``: ``add ADDR``, wait until it votes, then ``remove ID``:
  the number of voters never drops, so one more failure is never fatal.

Every step needs an admin credential, and is idempotent (a retry after a
lost answer changes nothing twice).
"""

from __future__ import annotations

import json
from typing import Any

import click
import trio

from cachefs.config import ADDR, tls_options
from cachefs.errors import InvalidArgument, TimedOut

from .admin import _insecure, _meta, _run, _secret
from .client import MetaClient

_wait_timeout = click.option(
    "--timeout", type=click.FloatRange(1, 86400), default=600.0, show_default=True,
    help="Seconds to wait for the new metanode to catch up and become a voter.")
_as_json = click.option("--json", "as_json", is_flag=True, help="Print the members as JSON.")


async def _wait_voter(client: MetaClient, node_id: int, timeout: float) -> dict[str, Any]:
    """Poll the leader until ``node_id`` votes.

    Raises:
        TimedOut: still a learner after ``timeout`` seconds.
    """
    with trio.move_on_after(timeout):
        while True:
            members = await client.call("meta_status", {})
            if str(node_id) in members.get("voters", {}):
                return members
            await trio.sleep(0.25)
    raise TimedOut(f"metanode {node_id} is still a learner after {timeout:.0f}s: is it running "
                   f"(cachefs metanode --id {node_id} --join ...) and can it reach the leader?")


async def _add(client: MetaClient, addr: str, node_id: int, wait: bool,
               timeout: float) -> dict[str, Any]:
    added = await client.call("metanode_add", {"addr": addr, "node_id": node_id})
    new = added["id"]
    click.echo(f"metanode {new} ({addr}) is a learner; start it with: cachefs metanode --id "
               f"{new} --join --peers {_peers_arg(added, new, addr)} --data-dir DIR", err=True)
    if not wait:
        return added
    members = await _wait_voter(client, new, timeout)
    click.echo(f"metanode {new} caught up and votes", err=True)
    return {**members, "id": new}


def _peers_arg(members: dict[str, Any], new: int, addr: str) -> str:
    every = {**members.get("voters", {}), **members.get("learners", {}), str(new): addr}
    return ",".join(f"{i}={a}" for i, a in sorted(every.items(), key=lambda kv: int(kv[0])) if a)


def _show(members: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(members))
        return
    for kind in ("voters", "learners"):
        for i, a in sorted(members.get(kind, {}).items(), key=lambda kv: int(kv[0])):
            click.echo(f"{i}\t{a}\t{kind[:-1]}")


@click.command("add")
@click.argument("addr", type=ADDR)
@click.option("--id", "node_id", type=click.IntRange(1), default=None,
              help="The new metanode's id (default: one above every id the leader knows).")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until the new metanode has caught up and votes.")
@_wait_timeout
@_as_json
@_meta
@_secret
@_insecure
@tls_options
def add(addr: str, node_id: int | None, wait: bool, timeout: float, as_json: bool,
        meta: list[str], secret_file: str | None, insecure: bool, tls_cert: str | None,
        tls_key: str | None, tls_ca: str | None) -> None:
    """Add the metanode at ADDR (a learner until it has caught up)."""
    members = _run(meta, secret_file, insecure,
                   lambda c: _add(c, addr, node_id or 0, wait, timeout),
                   (tls_cert, tls_key, tls_ca))
    _show(members, as_json)


@click.command("remove")
@click.argument("node_id", metavar="ID", type=click.IntRange(1))
@_as_json
@_meta
@_secret
@_insecure
@tls_options
def remove(node_id: int, as_json: bool, meta: list[str], secret_file: str | None,
           insecure: bool, tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> None:
    """Remove metanode ID (then stop its process)."""
    members = _run(meta, secret_file, insecure,
                   lambda c: c.call("metanode_remove", {"node_id": node_id}),
                   (tls_cert, tls_key, tls_ca))
    _show(members, as_json)


@click.command("replace")
@click.argument("node_id", metavar="ID", type=click.IntRange(1))
@click.argument("addr", type=ADDR)
@click.option("--id", "new_id", type=click.IntRange(1), default=None,
              help="The new metanode's id (default: one above every id the leader knows).")
@_wait_timeout
@_as_json
@_meta
@_secret
@_insecure
@tls_options
def replace(node_id: int, addr: str, new_id: int | None, timeout: float, as_json: bool,
            meta: list[str], secret_file: str | None, insecure: bool, tls_cert: str | None,
            tls_key: str | None, tls_ca: str | None) -> None:
    """Replace metanode ID with the one at ADDR: add it, wait until it votes, remove ID."""

    async def go(client: MetaClient) -> dict[str, Any]:
        now = await client.call("meta_status", {})
        if str(node_id) not in {**now.get("voters", {}), **now.get("learners", {})}:
            raise InvalidArgument(f"metanode {node_id} is not a member (voters "
                                  f"{sorted(now.get('voters', {}), key=int)})")
        await _add(client, addr, new_id or 0, True, timeout)
        return await client.call("metanode_remove", {"node_id": node_id})

    _show(_run(meta, secret_file, insecure, go, (tls_cert, tls_key, tls_ca)), as_json)


COMMANDS = (add, remove, replace)
