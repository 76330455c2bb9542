"""Blocks of a volume kept in an object store: one object per block.

A volume created with ``--backing s3://BUCKET/PREFIX/`` keeps no shards on
the datanodes: block ``(slice, index)`` is the object ``PREFIX`` +
``BlockKey.hex()``, written in one PUT and acknowledged once the store has
acknowledged it (the store keeps it durable, as the datanodes' write quorum
does for the others). Blocks are immutable, so their objects are never
rewritten and reads need no ETag condition. :class:`ObjectBlocks` is what
:class:`~cachefs.backing.client.BackingClient` hands such a volume's puts,
gets and deletes to, so the client, the cache tier (whose nodes fill their
misses from here) and gc go through the one seam they always use.

Integrity: each object carries the block's checksum in its user metadata
(``cachefs-checksum``); whole-block reads (the cache tier's fills) check it,
and a mismatch is ``Corrupt``, never wrong bytes. Range reads (a client
reading around the cache tier) are served as the store returns them.

Credentials come the standard AWS way on each machine (environment, shared
credentials file, profile); the metadata holds only bucket, prefix, endpoint
and region. Least privilege, per daemon, on ``arn:aws:s3:::BUCKET/PREFIX*``:
mounts need ``s3:PutObject`` and ``s3:GetObject`` (they write blocks, and
read around the cache tier when it is down); cache nodes ``s3:GetObject``
only; the metanodes ``s3:DeleteObject`` and ``s3:ListBucket`` on the prefix
(the leader's gc deletes trashed and leaked blocks); ``cachefs volume
create`` lists the prefix once to check the store answers. Datanodes need
nothing. Every error names the volume and its store.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cachefs.checksum import checksum
from cachefs.errors import Corrupt, InvalidArgument
from cachefs.ids import BlockKey

if TYPE_CHECKING:  # boto3 is imported only when such a volume is used
    from cachefs.repo.s3 import S3Store

CHECKSUM = "cachefs-checksum"  # user metadata: the block's checksum, hex
LIST_PAGE = 1000


@dataclass(frozen=True, slots=True)
class ObjectTarget:
    """Where a volume's blocks are: ``s3://bucket/prefix`` at ``endpoint`` ("" = AWS)."""

    bucket: str
    prefix: str  # "" or ending in "/"
    endpoint: str = ""
    region: str = ""

    @classmethod
    def from_volume(cls, spec: dict[str, Any]) -> ObjectTarget | None:
        """From a cluster-map volume entry; None for a volume on the datanodes."""
        url = spec.get("backing") or ""
        if not url:
            return None
        bucket, _, prefix = str(url).removeprefix("s3://").partition("/")
        if not bucket:
            raise InvalidArgument(f"malformed backing {url!r} in the cluster map")
        return cls(bucket, prefix, str(spec.get("endpoint", "")), str(spec.get("region", "")))

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def object_key(self, key: BlockKey) -> str:
        return self.prefix + key.hex()


class ObjectBlocks:
    """put/get/delete/list the blocks of object-store volumes (see the module docstring)."""

    def __init__(self, *, max_calls: int = 16) -> None:
        self._max_calls = max_calls
        self._stores: dict[tuple[str, ObjectTarget], S3Store] = {}

    def store(self, volume: str, target: ObjectTarget) -> S3Store:
        """The bucket's client for ``volume``, whose errors name the volume."""
        store = self._stores.get((volume, target))
        if store is None:
            from cachefs.repo.s3 import S3Store

            store = self._stores[(volume, target)] = S3Store(
                target.bucket, name=f"volume {volume!r} ({target.url})", endpoint=target.endpoint,
                region=target.region, max_calls=self._max_calls,
            )  # fmt: skip
        return store

    async def put(self, volume: str, target: ObjectTarget, key: BlockKey, data: bytes | bytearray | memoryview) -> None:
        await self.store(volume, target).put(
            target.object_key(key), bytes(data), what=f"storing block {key.hex()}",
            metadata={CHECKSUM: f"{checksum(data):x}"},
        )  # fmt: skip

    async def get(self, volume: str, target: ObjectTarget, key: BlockKey, offset: int = 0,
                  length: int = -1) -> bytes:  # fmt: skip
        """Bytes ``[offset, offset+length)`` of a block (length -1: to its end).

        Raises:
            NotFound: no object of that block (a store's NoSuchKey).
            Corrupt: a whole block whose bytes fail its checksum.
        """
        end = -1 if length < 0 else offset + length
        if length == 0:
            return b""
        data, meta = await self.store(volume, target).get(target.object_key(key), offset, end,
                                                          what=f"getting block {key.hex()}")  # fmt: skip
        if offset == 0 and length < 0 and meta.get(CHECKSUM) and meta[CHECKSUM] != f"{checksum(data):x}":
            raise Corrupt(f"volume {volume!r}: block {key.hex()} in {target.url} fails its checksum")
        return data

    async def delete(self, volume: str, target: ObjectTarget, key: BlockKey) -> None:
        """Delete a block's object (one that is not there is deleted already, as S3 says)."""
        await self.store(volume, target).delete(target.object_key(key))

    async def pages(self, volume: str, target: ObjectTarget) -> AsyncIterator[list[BlockKey]]:
        """The blocks stored under the volume's prefix, a listing page (``LIST_PAGE`` objects) at a time."""
        store = self.store(volume, target)
        token = ""
        while True:
            objects, _, token = await store.list_page(target.prefix, token=token, limit=LIST_PAGE)
            keys = []
            for obj in objects:
                try:
                    keys.append(BlockKey.from_hex(obj.key[len(target.prefix):]))
                except ValueError:
                    pass  # not a block of ours: left alone
            yield keys
            if not token:
                return

    async def inventory(self, volume: str, target: ObjectTarget) -> set[BlockKey]:
        """Every block stored under the volume's prefix (what gc's sweep looks at)."""
        return {key async for page in self.pages(volume, target) for key in page}

    async def stat(self, volume: str, target: ObjectTarget, key: BlockKey) -> dict[str, Any] | None:
        """A block's object as ``cachefs info`` shows it (one HEAD, no data); None if it is missing."""
        found = await self.store(volume, target).head_meta(target.object_key(key),
                                                           what=f"looking up block {key.hex()}")  # fmt: skip
        if found is None:
            return None
        info, meta = found
        return {"key": info.key, "size": info.size, "checksum": meta.get(CHECKSUM, "")}

    async def verify(self, volume: str, target: ObjectTarget, key: BlockKey) -> str:
        """Read a block's whole object and check it against the checksum in its
        metadata: "" when it matches, else what is wrong (fsck's check).

        Raises:
            NotFound: no object of that block.
        """
        data, meta = await self.store(volume, target).get(target.object_key(key),
                                                          what=f"verifying block {key.hex()}")  # fmt: skip
        if not meta.get(CHECKSUM):
            return f"block {key.hex()} in {target.url} has no {CHECKSUM} metadata"
        if meta[CHECKSUM] != f"{checksum(data):x}":
            return f"block {key.hex()} in {target.url} fails its checksum"
        return ""
