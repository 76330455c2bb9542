"""fsck's block check for a volume whose blocks are objects (``--backing s3://``).

Such a volume has no shards, placement groups or datanodes to ask, so steps
3 and 4 of :mod:`cachefs.backing.fsck` become:

1. List the volume's prefix a page at a time (``ObjectBlocks.pages``, 1,000
   keys a page): a needed block seen there is *stored*; a stored block that
   no file needs is an orphan *candidate*. Only the needed keys and the
   candidates are held, never the whole listing.
2. A needed block the listing did not show is looked up once more (HEAD):
   the walk came before the listing, and S3 lists what it has acknowledged,
   so one still missing then is *missing*.
3. With ``verify``, every stored needed block is read whole and checked
   against the checksum in its object's metadata (``ObjectBlocks.verify``),
   ``BATCH`` at a time (the store's client bounds the calls in flight); one
   without that metadata, or failing it, is *corrupt*.
4. Orphans: the candidates' slices that the metanodes call unreferenced
   (below the commit floor, held by no file and no trash entry: leaks that
   gc's sweep deletes). Blocks of slices still referenced (hidden under newer
   writes) or in the trash (awaiting gc) are not orphans.

Missing and corrupt blocks are fsck's *lost* blocks: reported as the files and
byte ranges they serve, and with ``--repair`` detached (holes), as on the
datanodes. There is nothing to rebuild: the store keeps its objects redundant.
A listing that fails leaves the verdict open (an error, no block called lost).
It needs the caller's AWS credentials to list and get the prefix.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from cachefs.backing.gc import unreferenced
from cachefs.backing.objects import ObjectBlocks, ObjectTarget
from cachefs.errors import CacheFSError, NotFound
from cachefs.ids import BlockKey
from cachefs.tasks import run_all

BATCH = 256  # blocks checked at once: bounds the tasks and the bytes held
MAX_ORPHANS_LISTED = 1000  # orphan keys in the report (all are counted)


@dataclass(slots=True)
class ObjectsVerdict:
    lost: set[BlockKey] = field(default_factory=set)  # missing or corrupt
    verified: int = 0
    corrupt: list[str] = field(default_factory=list)  # what is wrong with each
    orphan_blocks: int = 0
    orphans: list[str] = field(default_factory=list)  # hex, the first MAX_ORPHANS_LISTED
    errors: list[str] = field(default_factory=list)


async def check_objects(meta: Any, objects: ObjectBlocks, volume: str, target: ObjectTarget,
                        needed: set[BlockKey], *, verify: bool) -> ObjectsVerdict:  # fmt: skip
    """Steps 1-4 of the module docstring for the blocks ``needed`` by the volume's files."""
    out = ObjectsVerdict()
    stored: set[BlockKey] = set()
    candidates: dict[int, list[BlockKey]] = {}  # slice id -> its stored blocks no file needs
    try:
        async for page in objects.pages(volume, target):
            for key in page:
                if key in needed:
                    stored.add(key)
                else:
                    candidates.setdefault(key.slice_id, []).append(key)
    except CacheFSError as exc:
        out.errors.append(f"listing {target.url}: {exc}")
        return out

    async def look_again(key: BlockKey) -> None:
        try:
            if await objects.stat(volume, target, key) is not None:
                stored.add(key)
        except CacheFSError as exc:
            out.errors.append(f"looking up block {key.hex()} in {target.url}: {exc}")

    async def check(key: BlockKey) -> None:
        try:
            problem = await objects.verify(volume, target, key)
        except NotFound:
            problem = f"block {key.hex()} is gone from {target.url} since the listing"
        except CacheFSError as exc:
            out.errors.append(str(exc))
            return
        out.verified += 1
        if problem:
            out.corrupt.append(problem)
            out.lost.add(key)

    await _batched(look_again, sorted(needed - stored))
    out.lost = needed - stored
    if verify:
        await _batched(check, sorted(stored))
    leaked = await unreferenced(meta, volume, set(candidates))
    orphans = sorted(k for s in leaked for k in candidates[s])
    out.orphan_blocks = len(orphans)
    out.orphans = [k.hex() for k in orphans[:MAX_ORPHANS_LISTED]]
    return out


async def _batched(fn: Any, keys: list[BlockKey]) -> None:
    for start in range(0, len(keys), BATCH):
        await run_all(functools.partial(fn, k) for k in keys[start:start + BATCH])
