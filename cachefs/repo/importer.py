"""A link's listing into the namespace: one ``ImportObjects`` per listing page.

Each page is one log entry carrying its last key as the link's cursor, so an
interrupted import (a killed CLI, a metanode failover) goes on after the
last page that committed; a page committed twice changes nothing the
second time (same keys, same ETags: ``unchanged``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgpack

from cachefs import commands as C

from .s3 import S3Store

Progress = Callable[[dict[str, int]], None]


async def import_listing(
    mutate: Callable[[Any], Awaitable[Any]],
    link: dict[str, Any],
    store: S3Store,
    *,
    page: int = 1000,
    progress: Progress | None = None,
) -> dict[str, int]:
    """List ``link``'s prefix after its cursor; returns the summed replies."""
    prefix = link["prefix"]
    totals = {"created": 0, "updated": 0, "unchanged": 0, "skipped": 0, "listed": 0}
    cursor, token = link["cursor"], ""
    while True:
        objects, token = await store.list_page(prefix, start_after=cursor, token=token, limit=page)
        rows = [
            [o.key[len(prefix) :], o.size, o.mtime_ns, o.etag]
            for o in objects
            if not o.key.endswith("/")  # "directory" markers of S3 consoles
        ]
        if objects:
            cursor = objects[-1].key
        reply = await mutate(
            C.ImportObjects(link["id"], msgpack.packb(rows), cursor=cursor, done=not token)
        )
        for name, n in reply.items():
            totals[name] = totals.get(name, 0) + n
        totals["listed"] += len(objects)
        if progress is not None:
            progress(totals)
        if not token:
            return totals
