"""Garbage collection of trashed slices (the ``cachefs gc [--delete|--check]`` command is in cachefs/cli/gc.py).

Theory of operation
-------------------
Overwritten, truncated, compacted and deleted data leaves the namespace as
*trashed slices* (``[slice_id, slice_size, deleted_ns]`` in the metanodes'
trash list). :class:`GarbageCollector` deletes the blocks of every slice that
has been in the trash longer than a grace period from backing storage, then
purges those slices from the trash (``purge_trash``). The order matters: a
crash between the two leaves slices in the trash whose blocks are gone, and
the next run deletes nothing twice but purges them.

Why a grace period: a client that read a chunk's slice list before it changed
may still read the old blocks for a moment (its slice-list cache lives until
the file's version changes or the client reopens it, and a reader that finds
a block gone re-reads the slice list). Ten minutes is far beyond that window,
and sessions that hold unlinked files keep those slices out of the trash
altogether (the metanodes trash them only at the last close).

Leaked blocks: a writer that dies between its puts and its slice commit,
or a compaction that loses its race (``Busy``), leaves blocks that nothing
references and nothing will ever trash. :meth:`GarbageCollector.sweep` lists
the datanodes and asks the metanodes which of the slices found there are
*unreferenced* (``Q.Unreferenced``): below the commit floor and held by no
file and no trash entry; it deletes their shards where they were listed.
Why that cannot delete data anyone will read:

1. The floor is replicated state: once ``SealSlices(F)`` is applied, every
   later ``WriteSlice`` or ``CompactChunk`` of a slice below ``F`` fails
   (``SliceExpired``). References are made only by those commits (and
   trash entries only from references), so a slice below ``F`` that nothing
   holds at one applied index is held at no later index either.
2. ``Unreferenced`` reads one applied state, every file of the volume in one
   go with no await between them, so no rename or commit slips between the
   files it looks at (a walk of the namespace through readdir could miss a
   file renamed from a directory not yet read into one already read).
3. A live client still storing blocks of a sealed slice cannot commit it:
   the writer stores the data again under a new slice id
   (``client/writer.py``), so nothing acknowledged refers to what was
   deleted; a put that lands after the delete is found by the next sweep.

Where the floor stands is only a matter of liveness: the leader seals at the
``next_slice`` it saw ``grace`` seconds before (``metanode/daemon.py``), so
a writer loses a slice id, and stores its data again, only if it held the id
from allocation to commit longer than that (sessions take a fresh batch of
ids once theirs is a minute old, ``client/session.py``).

Both passes take ``delete=False`` to count what they would delete and change
nothing: that is what ``cachefs gc`` does unless given ``--delete`` (the
JuiceFS habit: an operator looks before anything is removed).

``--check`` walks the namespace (readdir + read_chunk), lists every datanode's
shards, and reports *missing* blocks (referenced, with no shard anywhere),
*unreferenced* ones (stored, yet neither referenced nor trashed: writes in
flight, files open but unlinked, or leaks), and of those the *leaked* ones
(below the floor: the next sweep deletes them). It changes nothing.

A volume whose blocks are objects in a store (``--backing s3://``,
:mod:`cachefs.backing.objects`) is collected, checked and swept the same
way, with its prefix's listing in place of the datanodes' and one DELETE
per block.

A deleted volume (``cachefs volume delete``, ``C.DeleteVolume``) is a
tombstone whose trash holds every slice it had: collection and sweeps treat
it as any volume, and the first sweep that finds none of its shards on the
datanodes (and its trash empty) drops the tombstone (``C.DropVolume``).
Shards on a datanode that was down then stay behind; a sweep of a volume
created later under the same name deletes them (they are below the floor
and no file holds them).

The metanode leader runs it in the background (``cachefs metanode
--gc-interval/--gc-grace``, see ``metanode/daemon.py``), with a cutoff that
is also before the oldest file open it knows of, and none at all while it
does not yet know every session's opens (after a failover); ``cachefs gc``
runs one pass on demand.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.backing.objects import ObjectTarget
from cachefs.errors import CacheFSError, NotFound
from cachefs.ids import CHUNK_SIZE, BlockKey, is_repo_slice
from cachefs.layout import HOLE, Slice
from cachefs.tasks import run_all

log = logging.getLogger(__name__)

DEFAULT_GRACE = 600.0
TRASH_PAGE = 1000
LIST_PAGE = 5000
ROOT = 1


@dataclass(slots=True)
class GcReport:
    """What one pass deleted or, with ``deleted`` false, would delete."""

    volume: str
    deleted: bool = True
    slices_purged: int = 0
    blocks_deleted: int = 0
    bytes_freed: int = 0
    leaked_blocks_deleted: int = 0
    volume_dropped: bool = False  # a deleted volume with nothing left: its tombstone is gone
    errors: list[str] = field(default_factory=list)


@dataclass(slots=True)
class CheckReport:
    volume: str
    files: int = 0
    referenced_blocks: int = 0
    stored_blocks: int = 0
    trashed_slices: int = 0
    missing: list[str] = field(default_factory=list)
    unreferenced: list[str] = field(default_factory=list)
    leaked: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def slice_block_keys(slice_id: int, size: int, block_size: int) -> list[BlockKey]:
    """Every block of a slice object of ``size`` bytes."""
    return [BlockKey(slice_id, i) for i in range(math.ceil(size / block_size))]


def record_block_keys(rec: Slice, block_size: int) -> set[BlockKey]:
    """The blocks on the datanodes a slice-list record needs: those covering
    ``[offset, offset+length)`` (none for an imported object's: they are in S3)."""
    if rec.id == HOLE or rec.length <= 0 or is_repo_slice(rec.id):
        return set()
    first = rec.offset // block_size
    last = (rec.offset + rec.length - 1) // block_size
    return {BlockKey(rec.id, i) for i in range(first, last + 1)}


class GarbageCollector:
    """Deletes the blocks of trashed slices after ``grace`` seconds (see module docstring)."""

    def __init__(self, meta: Any, backing: Any, *, grace: float = DEFAULT_GRACE, parallel: int = 16) -> None:
        self.meta = meta
        self.backing = backing
        self.grace = grace
        self._limit = trio.Semaphore(parallel)

    async def _block_size(self, volume: str) -> int:
        cmap = await self.meta.query(Q.ClusterMap())
        try:
            return int(cmap["volumes"][volume]["block_size"])
        except KeyError:
            raise NotFound(f"volume {volume!r} does not exist") from None

    async def _delete(self, volume: str, key: BlockKey, report: GcReport) -> None:
        async with self._limit:
            try:
                await self.backing.delete_block(volume, key)
                report.blocks_deleted += 1
            except NotFound:
                pass  # deleted by an earlier, interrupted run

    async def collect(self, volume: str, before_ns: int | None = None, *, delete: bool = True) -> GcReport:
        """One pass over the trash of ``volume``: slices trashed before
        ``before_ns`` (default: ``grace`` seconds ago). With ``delete`` false,
        count them (up to a page of ``MAX_TRASH_PAGE``) and change nothing."""
        report = GcReport(volume, deleted=delete)
        block_size = await self._block_size(volume)
        before = time.time_ns() - int(self.grace * 1e9) if before_ns is None else before_ns
        if not delete:
            for slice_id, size, _deleted_ns in await self.meta.query(Q.ListTrash(volume, Q.MAX_TRASH_PAGE, before)):
                report.slices_purged += 1
                report.blocks_deleted += len(slice_block_keys(slice_id, size, block_size))
                report.bytes_freed += size
            return report
        while True:
            rows = await self.meta.query(Q.ListTrash(volume, TRASH_PAGE, before))
            if not rows:
                break
            ids = []
            for slice_id, size, _deleted_ns in rows:
                keys = slice_block_keys(slice_id, size, block_size)
                try:
                    await run_all(functools.partial(self._delete, volume, k, report) for k in keys)
                except CacheFSError as exc:
                    report.errors.append(f"slice {slice_id}: {exc}")
                    continue  # stays in the trash for the next run
                ids.append(slice_id)
                report.bytes_freed += size
            if not ids:
                break
            report.slices_purged += await self.meta.mutate(C.PurgeTrash(volume, tuple(ids)))
            if len(rows) < TRASH_PAGE:
                break
        log.info("gc of %s: %d slices, %d blocks, %d bytes freed", volume, report.slices_purged,
                 report.blocks_deleted, report.bytes_freed)  # fmt: skip
        return report

    # ------------------------------------------------------------------ check

    async def check(self, volume: str, datanode_addrs: list[str]) -> CheckReport:
        report = CheckReport(volume)
        block_size = await self._block_size(volume)
        referenced: set[BlockKey] = set()
        dirs = [ROOT]
        while dirs:
            ino = dirs.pop()
            cookie = 0
            while True:
                rows = await self.meta.query(Q.ReadDir(volume, ino, cookie, 1000))
                for _name, attr, next_cookie in rows:
                    cookie = next_cookie
                    if attr.is_dir:
                        dirs.append(attr.ino)
                    elif attr.is_reg:
                        report.files += 1
                        for chunk in range(math.ceil(attr.size / CHUNK_SIZE)):
                            read = Q.ReadChunk(volume, attr.ino, chunk)
                            for piece in await self.meta.query(read):
                                referenced |= record_block_keys(piece, block_size)
                if len(rows) < 1000:
                    break
        trashed: set[int] = set()
        for entry in await self.meta.query(Q.ListTrash(volume, 100_000)):
            trashed.add(entry.slice_id)
        stored: set[BlockKey] = set()
        for keys in (await self._stored(volume, datanode_addrs, report.errors)).values():
            stored |= keys
        referenced_slices = {k.slice_id for k in referenced}
        report.referenced_blocks = len(referenced)
        report.stored_blocks = len(stored)
        report.trashed_slices = len(trashed)
        if not report.errors:  # a datanode we could not list would make everything look missing
            report.missing = sorted(k.hex() for k in referenced - stored)
        loose = {k for k in stored if k.slice_id not in referenced_slices and k.slice_id not in trashed}
        report.unreferenced = sorted(k.hex() for k in loose)
        leaked = await unreferenced(self.meta, volume, {k.slice_id for k in loose})
        report.leaked = sorted(k.hex() for k in loose if k.slice_id in leaked)
        return report

    # ------------------------------------------------------------------ leaks

    async def sweep(self, volume: str, datanode_addrs: list[str], report: GcReport | None = None, *,
                    since: int = 0, delete: bool = True) -> GcReport:
        """Delete the shards of every leaked slice of ``volume`` (see the module docstring)
        with an id of at least ``since``: the floor of the last clean sweep, whose
        leaks are gone and whose other slices can leave only through the trash (so
        each sweep asks the metanodes about new slices only; the leader sweeps
        everything now and then, for puts that landed after a sweep). With
        ``delete`` false, count the leaked shards and change nothing."""
        report = report or GcReport(volume, deleted=delete)
        target = await self._target(volume)
        # Safe to go on past a listing that failed: what is leaked is the metanodes' answer.
        stored = await self._stored(volume, datanode_addrs, report.errors)
        leaked = await unreferenced(
            self.meta, volume, {k.slice_id for keys in stored.values() for k in keys if k.slice_id >= since})

        if not delete:
            report.leaked_blocks_deleted += sum(k.slice_id in leaked for keys in stored.values() for k in keys)
            return report
        if not report.errors and not any(stored.values()):
            report.volume_dropped = await self._drop_if_deleted(volume)

        async def delete_shards(addr: str, key: BlockKey) -> None:
            async with self._limit:
                if target is not None:  # the block's object
                    try:
                        await self.backing.delete_block(volume, key)
                    except CacheFSError as exc:
                        report.errors.append(f"deleting {key.hex()} from {addr}: {exc}")
                    else:
                        report.leaked_blocks_deleted += 1
                    return
                try:
                    reply = await self.backing.pool.call(
                        addr, "delete", {"volume": volume, "key": key.to_bytes(), "index": -1}, timeout=60.0)
                except CacheFSError as exc:
                    report.errors.append(f"deleting {key.hex()} on {addr}: {exc}")
                    return
                if reply.result["removed"]:
                    report.leaked_blocks_deleted += 1

        await run_all(functools.partial(delete_shards, addr, key)
                      for addr, keys in stored.items() for key in sorted(keys) if key.slice_id in leaked)
        if leaked:
            log.info("gc of %s: %d leaked slices, %d of their blocks deleted", volume, len(leaked),
                     report.leaked_blocks_deleted)
        return report

    async def _drop_if_deleted(self, volume: str) -> bool:
        """A deleted volume (``cachefs volume delete``) whose trash is empty and
        of which no datanode that answered holds a shard leaves the cluster."""
        info = (await self.meta.query(Q.ListVolumes())).get(volume, {})
        if not info.get("deleted") or await self.meta.query(Q.ListTrash(volume, 1)):
            return False
        await self.meta.mutate(C.DropVolume(volume))
        log.info("gc: deleted volume %s has no blocks left; it is gone", volume)
        return True

    async def _stored(self, volume: str, datanode_addrs: list[str], errors: list[str]) -> dict[str, set[BlockKey]]:
        """The blocks of ``volume`` where they are stored: each datanode's (by
        address), or for a volume in an object store its prefix's (by URL).
        A listing that fails is left out and reported in ``errors``."""
        target = await self._target(volume)
        stored: dict[str, set[BlockKey]] = {}
        for where in [target.url] if target is not None else datanode_addrs:
            try:
                stored[where] = (await self.backing.objects.inventory(volume, target) if target is not None
                                 else await self._inventory(where, volume))  # fmt: skip
            except CacheFSError as exc:
                errors.append(f"listing {where}: {exc}")
        return stored

    async def _target(self, volume: str) -> ObjectTarget | None:
        """The volume's object store; None for one on the datanodes, or one the
        cluster map no longer has (dropped: only datanodes may hold what is left)."""
        try:
            return await self.backing.object_target(volume)
        except NotFound:
            return None

    async def _inventory(self, addr: str, volume: str) -> set[BlockKey]:
        keys: set[BlockKey] = set()
        cursor = ""
        while True:
            reply = await self.backing.pool.call(
                addr, "list", {"volume": volume, "cursor": cursor, "limit": LIST_PAGE}, timeout=60.0
            )
            for key, _index, _size in reply.result["shards"]:
                keys.add(BlockKey.from_bytes(key))
            cursor = reply.result["cursor"]
            if not cursor:
                return keys


async def unreferenced(meta: Any, volume: str, slice_ids: set[int]) -> set[int]:
    """Which of ``slice_ids`` the metanodes call leaked (below the floor, held by
    no file and no trash entry), asking a page at a time."""
    floor = (await meta.query(Q.Unreferenced(volume, ()))).floor
    ids = sorted(s for s in slice_ids if s < floor)
    out: set[int] = set()
    for start in range(0, len(ids), Q.MAX_UNREFERENCED_ASK):
        page = tuple(ids[start:start + Q.MAX_UNREFERENCED_ASK])
        out.update((await meta.query(Q.Unreferenced(volume, page))).slice_ids)
    return out
