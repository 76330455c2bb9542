"""Release: exported files give their blocks back and read from their objects (as FSx release tasks).

``cachefs repo release VOLUME PATH --older-than 7d`` walks PATH (a linked
directory, one inside it, or a file) and, for each file modified before
the cutoff whose bytes are stored in cachefs, checks that the bucket's
object of its key *is* its content: same size, and an ETag equal to the one
S3 gives those bytes (the MD5 of a single PUT, or of the parts' MD5s for a
multipart upload in the exporter's part size; the content is read through
the backing client, as the exporter reads it). Only then does it propose
``ReleaseFile`` with the version it read: the file's slices go to the trash
(gc deletes their blocks a grace later) and a repo slice of that object
version takes their place, so reads come through the cache tier's
read-through of the bucket. A file written since that version, renamed, or
with an export queued is refused by the state machine and counted, never
released on a stale comparison. An object that changes in the bucket
later is an imported file's case: reads fail ESTALE until ``repo sync``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.errors import Busy, Stale
from cachefs.ids import CHUNK_SIZE, is_repo_slice
from cachefs.layout import Slice

from .exporter import Exporter
from .s3 import S3Store

COUNTS = ("released", "released_bytes", "in_bucket", "differs", "too_new", "refused")
READDIR_PAGE = 1000


async def s3_etag(parts: AsyncIterator[bytes], part_size: int, size: int) -> str:
    """The ETag S3 gives ``size`` bytes uploaded as the exporter uploads them."""
    if size <= part_size:
        return f'"{hashlib.md5(b"".join([p async for p in parts]), usedforsecurity=False).hexdigest()}"'
    digests = [hashlib.md5(p, usedforsecurity=False).digest() async for p in parts]
    return f'"{hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest()}-{len(digests)}"'


class Releaser:
    """One release pass over a link's files (see the module docstring)."""

    def __init__(self, query: Callable[[Any], Awaitable[Any]], mutate: Callable[[Any], Awaitable[Any]],
                 exporter: Exporter, link: dict[str, Any], store: S3Store, *, parallel: int = 4) -> None:  # fmt: skip
        self._query = query
        self._mutate = mutate
        self._exporter = exporter
        self.link = link
        self.store = store
        self._limit = trio.CapacityLimiter(parallel)
        self.counts = dict.fromkeys(COUNTS, 0)

    async def run(self, parent: int, name: bytes, attr: Any, key: str, before_ns: int) -> dict[str, int]:
        """Release the file or the files under the directory ``attr`` (named
        ``name`` in ``parent``, at object ``key``, a directory's ending in "/")
        modified before ``before_ns``."""
        async with trio.open_nursery() as nursery:
            await self._visit(nursery, parent, name, attr, key, before_ns)
        return self.counts

    async def _visit(self, nursery: trio.Nursery, parent: int, name: bytes, attr: Any, key: str,
                     before_ns: int) -> None:  # fmt: skip
        if attr.is_reg:
            nursery.start_soon(self._one, parent, name, attr, key, before_ns)
            return
        if not attr.is_dir:
            return
        volume, cookie = self.link["volume"], 0
        while True:
            rows = await self._query(Q.ReadDir(volume, attr.ino, cookie, READDIR_PAGE))
            for child, child_attr, next_cookie in rows:
                cookie = next_cookie
                try:
                    sub = key + child.decode() + ("/" if child_attr.is_dir else "")
                except UnicodeDecodeError:
                    continue  # no S3 key can name it: never exported
                await self._visit(nursery, attr.ino, child, child_attr, sub, before_ns)
            if len(rows) < READDIR_PAGE:
                return

    async def _one(self, parent: int, name: bytes, attr: Any, key: str, before_ns: int) -> None:
        if attr.mtime_ns >= before_ns:
            self.counts["too_new"] += 1
            return
        volume = self.link["volume"]
        async with self._limit:
            if await self._in_bucket(volume, attr):
                self.counts["in_bucket"] += 1
                return
            obj = await self.store.head(key)
            if obj is None or obj.size != attr.size or obj.etag != await s3_etag(
                    self._exporter.read(volume, attr.ino, attr.size), self._exporter.part_size, attr.size):
                self.counts["differs"] += 1
                return
            cmd = C.ReleaseFile(volume, self.link["id"], parent, name, attr.ino, attr.version, obj.etag)
            try:
                reply = await self._mutate(cmd)
            except (Stale, Busy):  # written, renamed or queued for export since we looked
                self.counts["refused"] += 1
                return
        if reply["released"]:
            self.counts["released"] += 1
            self.counts["released_bytes"] += reply["released"]
        else:
            self.counts["in_bucket"] += 1  # released meanwhile, by another pass

    async def _in_bucket(self, volume: str, attr: Any) -> bool:
        """Whether every slice of the file is a repo slice (its bytes are read from the bucket already)."""
        for chunk in range(math.ceil(attr.size / CHUNK_SIZE)):
            for s in await self._query(Q.ReadChunk(volume, attr.ino, chunk)):
                if not is_repo_slice((s if isinstance(s, Slice) else Slice.from_wire(s)).id):
                    return False
        return True

