"""Files of a linked directory out to its bucket: the uploads and deletes the export queue asks for.

The queue is replicated metadata (``metanode/exports.py``); this is the IO
that works it off, run by the metanode leader (``metanode/daemon.py``).
One pass takes a batch of due records: deletes first, then uploads, at
most ``parallel`` at once. An upload reads the file as it is now: its
size, then each chunk's slices, block by block from backing storage (or,
for bytes still the bucket's, from the bucket: :class:`~.source.RepoBlocks`),
and sends it in one PUT, or as a multipart upload of ``part_size`` parts
when it is larger (an upload cut off is aborted). Each record's outcome
goes back as ``ExportDone`` with the generation it was read at, so a file
written during its upload is uploaded again, and a record is only taken
off once the store acknowledged. A kill -9 of the exporter between the
store's acknowledgement and ``ExportDone`` exports the file once more
(the same bytes to the same key): at least once, never lost. One window
is left: a leader deposed in the middle of an upload finishes it, so if the
file was written meanwhile and the new leader uploaded that first, the old
bytes may land last (the queue then says done); ``repo export`` mends it.

Transient errors (throttling, a dead endpoint, a datanode down) are retried
with exponential back-off (tenacity); errors that retrying cannot fix
(credentials, a missing bucket) fail the record at once. A failed record
stays queued with its error for ``repo status``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.errors import CacheFSError, NotFound, Unavailable
from cachefs.ids import CHUNK_SIZE
from cachefs.layout import HOLE, Slice, resolve, segment_blocks

from .s3 import S3Store

log = logging.getLogger(__name__)

PART_SIZE = 16 << 20  # S3 wants parts of at least 5 MiB (but the last)
BATCH = 256  # records per pass


class _Gone(Exception):
    """The file to upload is no more."""


class Exporter:
    def __init__(
        self,
        query: Callable[[Any], Awaitable[Any]],
        mutate: Callable[[Any], Awaitable[Any]],
        blocks: Any,
        block_size: Callable[[str], int],
        *,
        part_size: int = PART_SIZE,
        parallel: int = 4,
        attempts: int = 5,
        backoff: float = 0.5,
    ) -> None:
        self._query = query
        self._mutate = mutate
        self._blocks = blocks  # get_block(volume, key, offset, length), as a BackingClient's
        self._block_size = block_size
        self.part_size = part_size
        self.parallel = parallel
        self._retrying = dict(
            stop=stop_after_attempt(attempts),
            wait=wait_exponential(multiplier=backoff, max=8 * backoff),
            retry=retry_if_exception_type(Unavailable),
            sleep=trio.sleep,
            reraise=True,
        )
        self._stores: dict[tuple[int, str, str, str], S3Store] = {}

    def store(self, link: dict[str, Any]) -> S3Store:
        key = (link["id"], link["bucket"], link["endpoint"], link["region"])
        store = self._stores.get(key)
        if store is None:
            store = self._stores[key] = S3Store(
                link["bucket"], name=f"repository link {link['id']} ({link['url']})",
                endpoint=link["endpoint"], region=link["region"], attempts=2,
            )  # fmt: skip  (few attempts inside boto: tenacity retries the whole export)
        return store

    async def run_pass(self, link: dict[str, Any], batch: dict[str, Any]) -> dict[str, int]:
        """Export one batch of ``RepoExports`` records of ``link``; returns ``{done, failed, dropped}``."""
        counts = {outcome: 0 for outcome in C.EXPORT_OUTCOMES}
        store = self.store(link)

        async def work(rows: list[Any], one: Callable[[Any], Awaitable[tuple[str, str]]],
                       report: Callable[[Any, str, str], C.ExportDone]) -> None:  # fmt: skip
            limiter = trio.CapacityLimiter(self.parallel)

            async def each(row: Any) -> None:
                async with limiter:
                    outcome, error = await one(row)
                    try:
                        reply = await self._mutate(report(row, outcome, error))
                    except CacheFSError as exc:  # a failover: the record stays queued, the next leader has it
                        log.warning("%s: could not record the export %r: %s", store.name, row[:2], exc)
                        return
                    if reply.get("applied"):
                        counts[outcome] += 1

            async with trio.open_nursery() as nursery:
                for row in rows:
                    nursery.start_soon(each, row)

        await work(batch["deletes"], lambda row: self._attempt(store, row[0], lambda: store.delete(row[0])),
                   lambda row, outcome, error: C.ExportDone(link["id"], 0, row[0], row[1], outcome, error))
        await work(batch["puts"], lambda row: self._put(link, store, row),
                   lambda row, outcome, error: C.ExportDone(link["id"], row[0], row[1], row[2], outcome, error))
        return counts

    async def _attempt(self, store: S3Store, key: str, fn: Callable[[], Awaitable[Any]]) -> tuple[str, str]:
        """``(outcome, error)`` of ``fn`` with retries."""
        try:
            async for attempt in AsyncRetrying(**self._retrying):
                with attempt:
                    await fn()
        except CacheFSError as exc:
            log.warning("%s: export of %r failed: %s", store.name, key, exc)
            return "failed", exc.message[:1000]
        return "done", ""

    async def _put(self, link: dict[str, Any], store: S3Store, row: list[Any]) -> tuple[str, str]:
        ino, key = row[0], row[1]
        if not key:
            return "dropped", ""  # hard-linked, moved out of the link or removed: no one key to export to
        volume = link["volume"]

        async def upload() -> None:
            try:
                attr = await self._query(Q.GetAttr(volume, ino))
            except NotFound:
                raise _Gone from None
            await self.upload(store, key, self.read(volume, ino, attr.size), attr.size)

        try:
            return await self._attempt(store, key, upload)
        except _Gone:
            return "dropped", ""  # removed since it was queued

    async def upload(self, store: S3Store, key: str, parts: AsyncIterator[bytes], size: int) -> None:
        """Send ``size`` bytes (as ``parts`` of ``part_size``) to ``key``: one PUT or a multipart upload."""
        if size <= self.part_size:
            await store.put(key, b"".join([p async for p in parts]))
            return
        upload = await store.start_upload(key)
        try:
            etags = []
            async for part in parts:
                etags.append(await store.put_part(key, upload, len(etags) + 1, part))
            await store.finish_upload(key, upload, etags)
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                try:
                    await store.abort_upload(key, upload)
                except CacheFSError as exc:  # the store expires it in the end (lifecycle rules)
                    log.info("%s: could not abort the upload of %r: %s", store.name, key, exc)
            raise

    async def read(self, volume: str, ino: int, size: int) -> AsyncIterator[bytes]:
        """The file's first ``size`` bytes, in pieces of ``part_size``."""
        bs = self._block_size(volume)
        buf = bytearray()
        for chunk in range(-(-size // CHUNK_SIZE)):
            end = min(CHUNK_SIZE, size - chunk * CHUNK_SIZE)
            slices = [s if isinstance(s, Slice) else Slice.from_wire(s)
                      for s in await self._query(Q.ReadChunk(volume, ino, chunk))]  # fmt: skip
            for seg in resolve(slices, 0, end):
                if seg.slice_id == HOLE:
                    buf += bytes(seg.length)
                else:
                    for part in segment_blocks(seg, bs):
                        buf += await self._blocks.get_block(volume, part.key, part.block_off, part.length)
                while len(buf) >= self.part_size:
                    yield bytes(buf[: self.part_size])
                    del buf[: self.part_size]
        if buf:
            yield bytes(buf)
