"""What the leader does with S3 itself: list lazily linked directories when
first read, and poll the links made with ``--auto-import``.

A link made with ``--import lazy`` records only itself; its directory and
every directory a listing finds (a common prefix) stay *pending*
(``MetaState.lazy_dirs``) until something reads them. The service's lookup
and directory-read handlers call :meth:`LeaderRepos.list_dir` first for a
pending directory: one delimited listing of it, page by page, each page a
proposed ``ImportObjects`` (its subdirectories become pending in turn), with
one listing per directory however many readers ask at once. A listing cut
off (a cancelled request, a failover) goes on from the directory's cursor
at the next read.

``--auto-import``: :meth:`LeaderRepos.run_polls` lists each such link again
every ``auto_import`` seconds while this metanode leads (what ``repo sync``
does: new, changed and deleted objects), one poll per link at a time and
at most ``parallel`` links at once, the first one interval after the link
or the leadership began. A failed poll is logged naming the link and tried
again at the next interval. S3 calls use this metanode's own AWS
credentials, as every reader's do.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from cachefs import commands as C
from cachefs.errors import CacheFSError
from cachefs.repo.importer import import_listing, sync_link
from cachefs.singleflight import SingleFlight

from .namespace import MetaState

if TYPE_CHECKING:  # boto3 is imported only when a link is used (start-up of every metanode)
    from cachefs.repo.s3 import S3Store

log = logging.getLogger(__name__)


class LeaderRepos:
    def __init__(self, state: MetaState, mutate: Callable[[C.Command[Any]], Awaitable[Any]]) -> None:
        self.state = state
        self._mutate = mutate
        self._stores: dict[tuple[int, str, str, str], S3Store] = {}
        self._listings: SingleFlight[tuple[int, str], dict[str, int]] = SingleFlight()
        self._polled: dict[int, float] = {}  # link id -> when its last poll ended (trio clock)
        self._polling: set[int] = set()

    def store(self, link: dict[str, Any]) -> S3Store:
        key = (link["id"], link["bucket"], link["endpoint"], link["region"])
        store = self._stores.get(key)
        if store is None:
            from cachefs.repo.s3 import S3Store

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

    async def run_polls(
        self,
        leading: Callable[[], bool],
        *,
        tick: float = 1.0,
        parallel: int = 2,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Poll every ``--auto-import`` link while ``leading()`` (see the module docstring)."""
        limiter = trio.CapacityLimiter(parallel)
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                await trio.sleep(tick)
                if not leading():
                    self._polled.clear()  # a new leadership starts every link's interval again
                    continue
                now = trio.current_time()
                for link in list(self.state.links.values()):
                    if link.auto_import <= 0 or link.id in self._polling:
                        continue
                    if now - self._polled.setdefault(link.id, now) >= link.auto_import:
                        self._polling.add(link.id)
                        nursery.start_soon(self._poll, link.id, limiter)

    async def _poll(self, link_id: int, limiter: trio.CapacityLimiter) -> None:
        try:
            async with limiter:
                link = self.state.links.get(link_id)
                if link is None:
                    return
                d = link.to_dict()
                totals = await sync_link(self.propose, d, self.store(d), dict(link.pending))
                if totals["created"] or totals["updated"] or totals["deleted"]:
                    log.info("repository link %d (%s): auto-import: %d new, %d changed, %d deleted",
                             link_id, d["url"], totals["created"], totals["updated"], totals["deleted"])  # fmt: skip
        except CacheFSError as exc:
            log.warning("repository link %d: auto-import poll failed (next in %d s): %s",
                        link_id, self.state.links[link_id].auto_import if link_id in self.state.links else 0, exc)  # fmt: skip
        finally:
            self._polling.discard(link_id)
            self._polled[link_id] = trio.current_time()
