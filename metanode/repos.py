"""What the leader does with S3 itself: list lazily linked directories when first read.

A link made with ``--import lazy`` records only itself; its directory and
every directory a listing finds (a common prefix) stay *pending*
(``MetaState.lazy_dirs``) until something reads them. The service's lookup
and directory-read handlers call :meth:`LeaderRepos.list_dir` first for a
pending directory: one delimited listing of it, page by page, each page a
proposed ``ImportObjects`` (its subdirectories become pending in turn), with
one listing per directory however many readers ask at once. A listing cut
off (a cancelled request, a failover) goes on from the directory's cursor
at the next read. S3 calls use this metanode's own AWS credentials, as
every reader's do.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from cachefs import commands as C
from cachefs.repo.importer import import_listing
from cachefs.repo.s3 import S3Store
from cachefs.singleflight import SingleFlight

from .namespace import MetaState

log = logging.getLogger(__name__)


class LeaderRepos:
    def __init__(self, state: MetaState, mutate: Callable[[C.Command[Any]], Awaitable[Any]]) -> None:
        self.state = state
        self._mutate = mutate
        self._stores: dict[tuple[int, str, str, str], S3Store] = {}
        self._listings: SingleFlight[tuple[int, str], dict[str, int]] = SingleFlight()

    def store(self, link: dict[str, Any]) -> S3Store:
        key = (link["id"], link["bucket"], link["endpoint"], link["region"])
        store = self._stores.get(key)
        if store is None:
            store = self._stores[key] = S3Store(
                link["bucket"], name=f"repository link {link['id']} ({link['url']})",
                endpoint=link["endpoint"], region=link["region"],
            )  # fmt: skip
        return store

    async def propose(self, cmd: C.Command[Any]) -> Any:
        return await self._mutate(dataclasses.replace(cmd, now_ns=time.time_ns()))

    async def list_dir(self, volume: str, ino: int) -> None:
        """List directory ``ino`` of ``volume`` if it is a pending directory of a lazy link."""
        entry = self.state.lazy_dirs.get((volume, ino))
        if entry is None:
            return
        await self._listings.run(entry, lambda: self._list(*entry))

    async def _list(self, link_id: int, path: str) -> dict[str, int]:
        link = self.state.links.get(link_id)
        cursor = link.pending.get(path) if link is not None else None
        if link is None or cursor is None:
            return {}  # listed (or unlinked) while this waited
        d = link.to_dict()
        started = time.monotonic()
        totals = await import_listing(self.propose, d, self.store(d), {path: cursor},
                                      descend=lambda _sub, _reply: False)  # fmt: skip
        log.info("repository link %d: listed %r on first read: %d objects, %d new, %d deleted in %.2f s",
                 link_id, path, totals["listed"], totals["created"], totals["deleted"],
                 time.monotonic() - started)  # fmt: skip
        return totals
