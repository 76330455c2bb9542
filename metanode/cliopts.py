"""The metanode options and runner that admin commands share (``cachefs volume``, ``cachefs repo``, ...)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import click
import trio

from cachefs.config import ADDRS, load_secret, load_tls
from cachefs.errors import CacheFSError
from cachefs.rpc import RpcPool

from .client import MetaClient

meta_option = click.option(
    "--meta",
    type=ADDRS,
    required=True,
    envvar="CACHEFS_META",
    help="Metanode addresses, comma-separated.",
)
secret_option = click.option(
    "--secret-file",
    envvar="CACHEFS_SECRET_FILE",
    type=click.Path(dir_okay=False),
    help="An admin credential (cachefs credential issue; a client one for list and quota reads) or the cluster secret.",
)
insecure_option = click.option(
    "--insecure", is_flag=True, envvar="CACHEFS_INSECURE", help="Talk to an insecure (lab) cluster."
)


def run_admin(
    meta: list[str],
    secret_file: str | None,
    insecure: bool,
    fn: Callable[[MetaClient], Awaitable[Any]],
    tls_files: tuple[str | None, str | None, str | None] = (None, None, None),
    deadline: float = 15.0,
) -> Any:
    """Run ``fn`` with a client of the metanodes at ``meta`` (``deadline``
    per call); a CacheFSError becomes a ClickException (its message, no
    traceback)."""
    secret = load_secret(secret_file, insecure)
    _, tls = load_tls(*tls_files)

    async def go() -> tuple[Any, CacheFSError | None]:
        async with RpcPool(secret=secret, tls=tls) as pool:
            try:  # caught inside the pool's nursery, so it is not wrapped in a group
                return await fn(MetaClient(pool, meta, deadline=deadline)), None
            except CacheFSError as exc:
                return None, exc

    result, error = trio.run(go)
    if error is not None:
        raise click.ClickException(str(error))
    return result
