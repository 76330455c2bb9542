"""Checking one volume end to end (the ``cachefs fsck`` command is in cachefs/cli/fsck.py).

Theory of operation
-------------------
1. Metadata: the metanode leader checks the volume's invariants
   (``metanode/invariants.py``) on its applied state (``Q.CheckVolume``).
2. Files: a walk of the namespace from the root (readdir, read_chunk) keeps
   each regular file's paths and the blocks its bytes are read from: the
   *visible* parts of its chunks (``layout.resolve``), so a block that newer
   writes cover entirely is neither needed nor checked. Imported (S3)
   slices live in S3 and are skipped.
3. Shards: with ``verify`` every datanode that is up scrubs its shards of the
   volume (the datanodes' own verify path: every checksum read end to end; a
   corrupt shard is removed there, as any read of it would remove it, so it
   counts as missing), then every datanode lists what it holds.
4. The verdict on each needed block, from ``h``, the distinct shard indices
   held anywhere: ``h == n`` whole; ``k <= h < n`` *short* (readable, repair
   rebuilds it); ``h < k`` *lost*. A lost block is *unavailable* instead
   while a datanode is down or did not answer the listing: its shards may be
   there. Losses are reported as the files (paths) and byte ranges they
   took, never as bare keys.
5. ``repair``: short blocks are rebuilt at once (``Repairer.repair_keys``,
   the path ``cachefs repair`` takes for named blocks). Lost blocks are
   *detached*: each byte range of a file that such a block served becomes a
   hole (``Fallocate`` PUNCH_HOLE|KEEP_SIZE, which sends the records it
   covers to the trash), so reads return zeros instead of EIO, and the file
   is named in the report. Nothing is detached while a datanode is down or
   unlisted (it may hold the shards). Just before punching, the chunk is
   read again and only the ranges the lost slice still serves are punched,
   so a write since the walk is kept; a write landing between that read and
   the punch would be cut too, so run ``--repair`` with the damaged files'
   writers stopped.

A volume whose blocks are objects in a store (``--backing s3://``) has no
shards: steps 3 and 4 are :mod:`cachefs.backing.fsck_objects` (its prefix's
listing, each object checked against the checksum in its metadata, orphans
named); missing or corrupt blocks are lost and detached as above.

The walk and the listing are not one snapshot: a file written during the
check may show blocks as missing that were stored after its datanode was
listed. Every lost block is therefore looked up once more, with a ``stat``
of each shard slot, before it is reported.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.backing.fsck_objects import check_objects
from cachefs.backing.repair import Repairer, RepairReport
from cachefs.errors import CacheFSError
from cachefs.ids import CHUNK_SIZE, BlockKey, is_repo_slice
from cachefs.layout import HOLE, resolve, segment_blocks
from cachefs.tasks import run_all

log = logging.getLogger(__name__)

ROOT = 1
READDIR_PAGE = 1000
PUNCH = C.FALLOC_FL_PUNCH_HOLE | C.FALLOC_FL_KEEP_SIZE


@dataclass(slots=True)
class DamagedFile:
    """A file with bytes on blocks that are lost (or unavailable)."""

    ino: int
    paths: list[str]
    blocks: list[str] = field(default_factory=list)  # block keys, hex
    ranges: list[list[int]] = field(default_factory=list)  # [offset, length] of the file


@dataclass(slots=True)
class FsckReport:
    volume: str
    store: str = ""  # a volume whose blocks are objects: its s3:// URL (fsck_objects.py)
    metadata: list[str] = field(default_factory=list)
    files: int = 0
    blocks: int = 0
    shards_checked: int = 0  # objects read and checked, for a volume in a store
    shards_corrupt: int = 0
    datanodes_down: list[str] = field(default_factory=list)
    short: list[str] = field(default_factory=list)
    lost: list[DamagedFile] = field(default_factory=list)
    unavailable: list[DamagedFile] = field(default_factory=list)
    shards_rebuilt: int = 0
    detached: list[DamagedFile] = field(default_factory=list)
    orphan_blocks: int = 0  # a volume in a store: objects of leaked slices (gc's sweep deletes them)
    orphans: list[str] = field(default_factory=list)  # their keys, hex (the first 1,000)
    errors: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not (self.metadata or self.short or self.lost or self.unavailable or self.errors)


@dataclass(slots=True)
class _File:
    paths: list[str]
    parts: list[tuple[BlockKey, int, int]] = field(default_factory=list)  # key, file offset, length


class Fsck:
    """One check of one volume (see module docstring)."""

    def __init__(self, meta: Any, repairer: Repairer) -> None:
        self.meta = meta
        self.repairer = repairer

    @property
    def view(self) -> Any:
        return self.repairer.view

    async def run(self, volume: str, *, verify: bool = True, repair: bool = False) -> FsckReport:
        report = FsckReport(volume)
        report.metadata = await self.meta.query(Q.CheckVolume(volume))
        await self.view.refresh()
        policy = self.view.policy(volume)
        files = await self._walk(volume, policy.block_size, report)
        needed = {key for f in files.values() for key, _off, _len in f.parts}
        report.blocks = len(needed)
        if (target := self.view.target(volume)) is not None:
            report.store = target.url
            verdict = await check_objects(self.meta, self.repairer.client.objects, volume, target, needed,
                                          verify=verify)  # fmt: skip
            report.shards_checked, report.shards_corrupt = verdict.verified, len(verdict.corrupt)
            report.orphan_blocks, report.orphans = verdict.orphan_blocks, verdict.orphans
            report.errors.extend(verdict.corrupt + verdict.errors)
            report.lost = self._damaged(files, verdict.lost)
            if repair and report.lost:
                await self._detach(volume, verdict.lost, report)
            return report

        scratch = RepairReport(volume=volume)
        if verify:
            await self.repairer.scrub(volume, scratch)
        holdings = await self.repairer.inventory(volume, scratch)
        report.shards_checked, report.shards_corrupt = scratch.shards_scrubbed, scratch.shards_corrupt
        report.errors.extend(scratch.errors)
        up = {n.id for n in self.view.datanodes.values() if n.state == "up"}
        unlisted = {n for n in up if any(e.startswith(f"listing {n}: ") for e in scratch.errors)}
        report.datanodes_down = sorted((set(self.view.datanodes) - up) | unlisted)

        short, lost = [], []
        for key in sorted(needed):
            have = {i for i, nodes in holdings.get(key, {}).items() if nodes and 0 <= i < policy.n}
            if len(have) < policy.k:
                lost.append(key)
            elif len(have) < policy.n:
                short.append(key)
        lost = await self._still_lost(volume, lost, policy)
        report.short = [k.hex() for k in short]
        damaged = self._damaged(files, set(lost))
        if report.datanodes_down:
            report.unavailable = damaged
        else:
            report.lost = damaged

        if repair:
            fixed = RepairReport(volume=volume)
            await self.repairer.repair_keys(volume, short, fixed)
            report.shards_rebuilt = fixed.shards_rebuilt
            report.errors.extend(fixed.unrecoverable + fixed.errors)
            if report.lost:
                await self._detach(volume, set(lost), report)
        log.info("fsck of %s: %d files, %d blocks, %d short, %d lost, %d unavailable", volume, report.files,
                 report.blocks, len(report.short), len(report.lost), len(report.unavailable))
        return report

    async def _walk(self, volume: str, block_size: int, report: FsckReport) -> dict[int, _File]:
        files: dict[int, _File] = {}
        dirs = [(ROOT, "")]
        while dirs:
            ino, path = dirs.pop()
            cookie = 0
            while True:
                rows = await self.meta.query(Q.ReadDir(volume, ino, cookie, READDIR_PAGE))
                for name, attr, next_cookie in rows:
                    cookie = next_cookie
                    child = f"{path}/{os.fsdecode(name)}"
                    if attr.is_dir:
                        dirs.append((attr.ino, child))
                    elif attr.is_reg and attr.ino in files:
                        files[attr.ino].paths.append(child)  # another hard link
                    elif attr.is_reg:
                        report.files += 1
                        files[attr.ino] = _File([child], await self._parts(volume, attr, block_size))
                if len(rows) < READDIR_PAGE:
                    break
        return files

    async def _parts(self, volume: str, attr: Any, block_size: int) -> list[tuple[BlockKey, int, int]]:
        parts = []
        for chunk in range((attr.size + CHUNK_SIZE - 1) // CHUNK_SIZE):
            records = await self.meta.query(Q.ReadChunk(volume, attr.ino, chunk))
            parts.extend(_visible(records, chunk, attr.size, block_size))
        return parts

    async def _still_lost(self, volume: str, keys: list[BlockKey], policy: Any) -> list[BlockKey]:
        """Of ``keys`` (lost by the listing), those a stat of every slot still finds short of K."""
        out = []

        async def look(key: BlockKey) -> None:
            pg = self.view.placement(volume, key)
            held = await self.repairer.holdings(volume, key, pg, policy.n, ())
            if sum(bool(held.get(i)) for i in range(policy.n)) < policy.k:
                out.append(key)

        await run_all(functools.partial(look, k) for k in keys)
        return sorted(out)

    @staticmethod
    def _damaged(files: dict[int, _File], lost: set[BlockKey]) -> list[DamagedFile]:
        out = []
        for ino, f in sorted(files.items()):
            hit = [(key, off, length) for key, off, length in f.parts if key in lost]
            if hit:
                out.append(DamagedFile(ino, sorted(f.paths), sorted({k.hex() for k, _, _ in hit}),
                                       _merged([(off, length) for _, off, length in hit])))  # fmt: skip
        return out

    async def _detach(self, volume: str, lost: set[BlockKey], report: FsckReport) -> None:
        for damaged in report.lost:
            try:
                attr = await self.meta.query(Q.GetAttr(volume, damaged.ino))
                block_size = self.view.policy(volume).block_size
                parts = [(k, off, n) for k, off, n in await self._parts(volume, attr, block_size) if k in lost]
                ranges = _merged([(off, n) for _, off, n in parts])
                for offset, length in ranges:
                    await self.meta.mutate(C.Fallocate(volume, damaged.ino, PUNCH, offset, length))
            except CacheFSError as exc:
                report.errors.append(f"detaching the lost blocks of {damaged.paths[0]}: {exc}")
                continue
            if ranges:
                report.detached.append(DamagedFile(damaged.ino, damaged.paths, damaged.blocks, ranges))
                log.warning("fsck: %s lost %d range(s) of bytes, now holes (zeros): %s", damaged.paths[0],
                            len(ranges), ranges)  # fmt: skip


def _visible(records: list[Any], chunk: int, size: int, block_size: int) -> list[tuple[BlockKey, int, int]]:
    """``(block key, file offset, length)`` of every block part a read of the chunk needs."""
    end = min(CHUNK_SIZE, size - chunk * CHUNK_SIZE)
    out = []
    for seg in resolve(records, 0, end):
        if seg.slice_id == HOLE or is_repo_slice(seg.slice_id):
            continue
        for part in segment_blocks(seg, block_size):
            out.append((part.key, chunk * CHUNK_SIZE + part.pos, part.length))
    return out


def _merged(ranges: list[tuple[int, int]]) -> list[list[int]]:
    """Byte ranges sorted, with touching and overlapping ones joined."""
    out: list[list[int]] = []
    for off, length in sorted(ranges):
        if out and off <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], off + length - out[-1][0])
        else:
            out.append([off, length])
    return out
