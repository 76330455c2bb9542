"""``cachefs health`` (is one daemon alive?) and ``cachefs status`` (the cluster)."""

from __future__ import annotations

import json
import sys

import click
import trio

from cachefs.config import ADDR, ADDRS, load_secret, load_tls, tls_options
from cachefs.errors import CacheFSError, PermissionDenied
from cachefs.rpc import RpcPool


@click.command()
@click.argument("addr", type=ADDR)
@click.option("--secret-file", envvar="CACHEFS_SECRET_FILE", type=click.Path(dir_okay=False))
@click.option("--insecure", is_flag=True, envvar="CACHEFS_INSECURE")
@click.option("--timeout", type=click.FloatRange(0.1, 60), default=3.0, show_default=True)
@tls_options
def health(addr: str, secret_file: str | None, insecure: bool, timeout: float, tls_cert: str | None,
           tls_key: str | None, tls_ca: str | None) -> None:
    """Ask the daemon at ADDR whether it is alive; exit 0 if it is (for healthchecks)."""
    secret = load_secret(secret_file, insecure)
    _, tls = load_tls(tls_cert, tls_key, tls_ca)

    async def ask() -> dict:
        async with RpcPool(secret=secret, tls=tls) as pool:
            return (await pool.call(addr, "health", timeout=timeout)).result

    try:
        answer = trio.run(ask)
    except CacheFSError as exc:
        click.echo(f"{addr}: unhealthy: {exc}", err=True)
        sys.exit(1)
    click.echo(json.dumps(answer))
    if answer.get("draining"):
        sys.exit(1)


@click.command()
@click.option("--meta", type=ADDRS, required=True, help="Metanode addresses, comma-separated.")
@click.option("--secret-file", envvar="CACHEFS_SECRET_FILE", type=click.Path(dir_okay=False))
@click.option("--insecure", is_flag=True, envvar="CACHEFS_INSECURE")
@click.option("--json", "as_json", is_flag=True, help="Print the cluster map as one JSON object.")
@click.option("--timeout", type=click.FloatRange(0.1, 600), default=10.0, show_default=True,
              help="Give up when no metanode leader answers within this many seconds.")
@tls_options
def status(meta: list[str], secret_file: str | None, insecure: bool, as_json: bool, timeout: float,
           tls_cert: str | None, tls_key: str | None, tls_ca: str | None) -> None:
    """The cluster as the metanodes see it: leader, metanodes (Raft role, term,
    commit index, lag), client sessions (with an admin credential), nodes, volumes."""
    from cachefs.metanode.client import MetaClient
    from cachefs.queries import ClusterMap

    secret = load_secret(secret_file, insecure)
    _, tls = load_tls(tls_cert, tls_key, tls_ca)

    async def fetch() -> tuple[dict, str | None]:
        async with RpcPool(secret=secret, tls=tls) as pool:
            client = MetaClient(pool, meta, deadline=timeout)
            cmap = await client.query(ClusterMap())
            leader = client.leader
            try:
                sessions: list | None = await client.call("meta_sessions", {})
            except PermissionDenied:  # a client credential: no one else's sessions
                sessions = None
            metanodes = await _metanodes(pool, meta, await client.call("meta_status", {}))
            return {**cmap, "metanodes": metanodes, "client_sessions": sessions}, leader

    try:
        cmap, leader = trio.run(fetch)
    except CacheFSError as exc:
        # Exit 2 like any other bad input: the addresses given lead nowhere.
        click.echo(f"Error: cannot read the cluster map from {','.join(meta)}: {exc}", err=True)
        sys.exit(2)
    if as_json:
        click.echo(json.dumps({"leader": leader, **cmap}, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"metanode leader: {leader}")
    mt = Table(title="metanodes")
    for col in ("id", "address", "member", "role", "term", "commit", "applied", "lag"):
        mt.add_column(col)
    for m in cmap["metanodes"]:
        mt.add_row(str(m["id"]), m["addr"] or "?", m["member"], m["role"], str(m["term"]),
                   str(m["commit_index"]), str(m["applied_index"]),
                   "" if m["lag"] is None else str(m["lag"]))
    console.print(mt)
    if cmap["client_sessions"] is not None:
        st = Table(title="client sessions")
        for col in ("session", "volume", "owner", "idle"):
            st.add_column(col)
        for c in cmap["client_sessions"]:
            st.add_row(c["session"], c["volume"], c["owner"], f"{c['idle_s']:.1f}s")
        console.print(st)
    table = Table(title="nodes")
    for col in ("kind", "id", "address", "zone", "state", "used", "capacity"):
        table.add_column(col)
    for kind in ("datanodes", "cachenodes"):
        for n in sorted(cmap.get(kind, []), key=lambda n: str(n["id"])):
            table.add_row(kind[:-1], str(n["id"]), n["addr"], n["zone"], n["state"],
                          f"{n.get('used', 0) / 2**30:.2f} GiB", f"{n.get('capacity', 0) / 2**30:.1f} GiB")
    console.print(table)
    vols = Table(title="volumes")
    for col in ("name", "policy", "compression", "block size"):
        vols.add_column(col)
    for name, v in cmap.get("volumes", {}).items():
        vols.add_row(name, v["policy"], v.get("compression", "none"), str(v.get("block_size")))
    console.print(vols)


async def _metanodes(pool: RpcPool, meta: list[str], leader: dict) -> list[dict]:
    """Each member's own status (any replica answers), with the leader's view
    of its replication lag; members that do not answer show as down."""
    members = {int(i): ("voter", a) for i, a in leader.get("voters", {}).items()}
    members.update({int(i): ("learner", a) for i, a in leader.get("learners", {}).items()})
    progress = {int(i): p for i, p in leader.get("progress", {}).items()}
    out: list[dict] = []

    async def ask(node_id: int, member: str, addr: str | None) -> None:
        row = {"id": node_id, "addr": addr, "member": member, "role": "down", "term": 0,
               "commit_index": 0, "applied_index": 0,
               "lag": 0 if node_id == leader.get("id") else progress.get(node_id, {}).get("lag")}
        if addr:
            try:
                with trio.fail_after(2):
                    st = (await pool.call(addr, "meta_status", {}, timeout=2)).result
                row.update(role=st.get("role", "leader" if st["is_leader"] else "follower"),
                           term=st["term"], commit_index=st["commit_index"],
                           applied_index=st["applied_index"])
            except (CacheFSError, trio.TooSlowError):
                pass
        out.append(row)

    if not members:  # a metanode from before membership changes: the addresses given
        members = {i: ("voter", a) for i, a in enumerate(meta, 1)}
    async with trio.open_nursery() as nursery:
        for node_id, (member, addr) in members.items():
            nursery.start_soon(ask, node_id, member, addr)
    return sorted(out, key=lambda r: r["id"])
