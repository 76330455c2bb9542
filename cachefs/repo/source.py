"""Blocks of imported files, read from their objects; every other block from backing storage.

:class:`RepoBlocks` sits where a ``BackingClient`` does (the cache node's
miss path, a client reading around the cache tier): blocks of repo slices
(:func:`cachefs.ids.is_repo_slice`) are ranged GETs of exactly that block of
exactly that object version, everything else goes to ``backing``
unchanged. Which object a repo slice is comes from the metanodes
(``RepoObject``) once and is kept: it never changes. One cache node fills
each block once for every reader (the cache service's single-flight fill);
lookups of one slice's object are shared here the same way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from cachefs import queries as Q
from cachefs.errors import NotFound, Stale
from cachefs.ids import BlockKey, is_repo_slice
from cachefs.singleflight import SingleFlight

if TYPE_CHECKING:  # boto3 is imported only when a link is read (start-up of every mount)
    from .s3 import S3Store

MAX_KEPT = 1 << 16  # object answers kept (about 300 bytes each)


class RepoBlocks:
    def __init__(self, backing: Any, query: Callable[[Any], Awaitable[Any]], *,
                 max_calls: int = 16) -> None:  # fmt: skip
        self.backing = backing
        self._query = query
        self._max_calls = max_calls
        self._objects: dict[tuple[str, int], dict[str, Any]] = {}
        self._lookups: SingleFlight[tuple[str, int], dict[str, Any]] = SingleFlight()
        self._stores: dict[int, S3Store] = {}
        self.repo_reads = 0  # own names: ``stats`` and the rest are the backing client's
        self.repo_bytes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backing, name)  # put_block, delete_block, missing...: the backing client's

    async def get_block(self, volume: str, key: BlockKey, offset: int = 0, length: int = -1) -> bytes:
        if not is_repo_slice(key.slice_id):
            return await self.backing.get_block(volume, key, offset, length)
        obj = await self._object(volume, key.slice_id)
        bs = obj["block_size"]
        block_start = key.index * bs
        block_end = min(obj["size"], block_start + bs)
        start = min(block_start + offset, block_end)
        end = block_end if length < 0 else min(block_end, start + length)
        data = await self._store(obj["link"]).get_range(obj["key"], start, end, obj["etag"])
        self.repo_reads += 1
        self.repo_bytes += len(data)
        return data

    async def _object(self, volume: str, slice_id: int) -> dict[str, Any]:
        known = self._objects.get((volume, slice_id))
        if known is not None:
            return known

        async def ask() -> dict[str, Any]:
            try:
                obj = await self._query(Q.RepoObject(volume, slice_id))
            except NotFound as exc:  # the version an open file read was replaced or removed since
                raise Stale(f"imported data of volume {volume!r}: {exc.message}") from None
            if len(self._objects) >= MAX_KEPT:
                self._objects.clear()
            self._objects[(volume, slice_id)] = obj
            return obj

        return await self._lookups.run((volume, slice_id), ask)

    def _store(self, link: dict[str, Any]) -> S3Store:
        store = self._stores.get(link["id"])
        if store is None:
            from .s3 import S3Store

            name = f"repository link {link['id']} ({link['url']})"
            store = self._stores[link["id"]] = S3Store(
                link["bucket"], name=name, endpoint=link["endpoint"], region=link["region"],
                max_calls=self._max_calls,
            )  # fmt: skip
        return store
