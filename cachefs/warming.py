"""Warming the cache tier: resolve paths to blocks and have their owners fetch them.

Used by ``cachefs warmup`` (:mod:`cachefs.cachenode.warmup`) in the
foreground and by the metanode leader's job runner (:mod:`cachefs.metanode.jobs`)
for ``warmup --background``.

Theory of operation
-------------------

1. Resolve. The paths (inside the volume) are walked through the metanodes
   (:class:`cachefs.metanode.client.MetaClient`):
   ``lookup`` from the root, ``readdir`` for directories, and for each regular
   file ``read_chunk`` per 64 MiB chunk. :func:`file_blocks` turns a file's
   slice lists into the blocks a full read of the file touches (newest slice
   wins, holes need nothing), with the bytes of the file each block carries.
2. Route. Each block goes to its owner on every target zone's ring
   (:class:`cachefs.ring.CacheRouter`; by default every zone, so training in
   any zone reads warm). Keys are grouped per cache node into batches.
3. Prefetch. ``--threads`` workers send batches as
   ``prefetch(volume, keys, wait=True)``; the cache node reads the missing
   blocks through from backing storage (bypassing its admission rule) and
   answers with how many were already cached, fetched, or failed. A node
   that cannot be reached is marked down and its batches count as failed.
   The first target zone (in name order) is warmed first, then the others
   at once, each prefetch naming the first zone's owner of its keys as the
   ``source`` that the owner copies from before it tries backing storage
   (``cachenode/peers.py``), so each block is read from backing storage (for
   a linked bucket: one ranged GET) once for the whole cache group, however
   many zones keep a copy.
4. Report. :class:`WarmupReport` says how much was fetched and how much
   was already cached (so re-running on a warm tree finishes fast and says
   so); ``on_bytes``/``on_file`` feed the caller's progress bar or job record.

``pin_until`` (a wall-clock time) has each owner pin the blocks until then
(``BlockStore.pin``), so its LRU keeps them for the epoch that needs them.

:func:`check_files` resolves and routes the same way, then asks each owner
which of its blocks it ``holds`` (from its index: nothing is fetched) for
the cached fraction per zone; with ``evict`` it has them drop the blocks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from cachefs import queries as Q
from cachefs.errors import (
    CacheFSError,
    ConnectionLost,
    NotFound,
    TimedOut,
    Unreachable,
)
from cachefs.ids import CHUNK_SIZE, BlockKey
from cachefs.layout import HOLE, Slice, resolve, segment_blocks
from cachefs.messages import Attr
from cachefs.ring import CacheRouter
from cachefs.rpc import RpcPool

if TYPE_CHECKING:
    from cachefs.metanode.client import MetaClient

ROOT_INO = 1
BATCH = 64
READDIR_LIMIT = 1000

# ---------------------------------------------------------------- block resolution (pure)


def file_blocks(
    size: int,
    chunks: Mapping[int, Sequence[Slice]],
    block_size: int,
    chunk_size: int = CHUNK_SIZE,
) -> dict[BlockKey, int]:
    """The blocks a full read of a ``size``-byte file touches, with its bytes in each.

    ``chunks`` maps a chunk index to its slice list as ``read_chunk`` returns
    it (in commit order, newest last).
    The values sum to the file's non-hole bytes.
    """
    if block_size <= 0:
        raise ValueError(f"block size must be positive, got {block_size}")
    out: dict[BlockKey, int] = {}
    for chunk in range(-(-size // chunk_size)):
        end = min(chunk_size, size - chunk * chunk_size)
        for seg in resolve(chunks.get(chunk, ()), 0, end):
            if seg.slice_id == HOLE:
                continue
            for part in segment_blocks(seg, block_size):
                out[part.key] = out.get(part.key, 0) + part.length
    return out


@dataclass(frozen=True, slots=True)
class WarmFile:
    path: str
    size: int
    blocks: Mapping[BlockKey, int]


# ---------------------------------------------------------------- resolving paths via the metanodes


async def resolve_paths(
    meta: MetaClient,
    volume: str,
    paths: Iterable[str],
    block_size: int,
    *,
    threads: int = 8,
    on_file: Callable[[WarmFile], None] | None = None,
) -> list[WarmFile]:
    """Walk ``paths`` (inside ``volume``) and resolve every regular file to its blocks."""
    files: list[WarmFile] = []
    limiter = trio.CapacityLimiter(threads)

    async def lookup(path: str) -> Attr:
        attr = await meta.query(Q.GetAttr(volume, ROOT_INO))
        for name in (p for p in path.split("/") if p and p != "."):
            try:
                attr = await meta.query(Q.Lookup(volume, attr.ino, os.fsencode(name)))
            except NotFound:
                raise NotFound(f"{path}: no such file or directory in volume {volume!r}") from None
        return attr

    async def resolve_file(path: str, attr: Attr) -> None:
        async with limiter:
            chunks = {}
            for chunk in range(-(-attr.size // CHUNK_SIZE)):
                chunks[chunk] = await meta.query(Q.ReadChunk(volume, attr.ino, chunk))
        warm = WarmFile(path, attr.size, file_blocks(attr.size, chunks, block_size))
        files.append(warm)
        if on_file is not None:
            on_file(warm)

    async def walk(path: str, attr: Attr, nursery: trio.Nursery) -> None:
        if attr.is_reg:
            nursery.start_soon(resolve_file, path, attr)
        elif attr.is_dir:
            cookie = 0
            while True:
                async with limiter:
                    rows = await meta.query(Q.ReadDir(volume, attr.ino, cookie, READDIR_LIMIT))
                for name, child, next_cookie in rows:
                    text = os.fsdecode(name)
                    if text in (".", ".."):
                        continue
                    await walk(f"{path.rstrip('/')}/{text}", child, nursery)
                    cookie = next_cookie
                if len(rows) < READDIR_LIMIT:
                    break

    try:
        async with trio.open_nursery() as nursery:
            for path in paths:
                await walk(path, await lookup(path), nursery)
    except* CacheFSError as group:  # the typed error (a missing path names itself), not trio's group
        raise _first_leaf(group) from None
    return files


def _first_leaf(group: BaseExceptionGroup[CacheFSError]) -> CacheFSError:
    first: BaseException = group
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    assert isinstance(first, CacheFSError)
    return first


# ---------------------------------------------------------------- prefetching


@dataclass(slots=True)
class WarmupReport:
    files: int = 0
    blocks: int = 0
    bytes: int = 0
    cached: int = 0
    fetched: int = 0
    failed: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def already_warm(self) -> bool:
        return self.blocks > 0 and self.cached == self.blocks

    def summary(self) -> str:
        rate = self.bytes / self.seconds / (1 << 20) if self.seconds > 0 else 0.0
        head = (
            f"{self.files} files, {self.blocks} block copies, {self.bytes / (1 << 20):.1f} MiB "
            f"in {self.seconds:.2f}s ({rate:.1f} MiB/s): "
        )
        if self.already_warm:
            return head + "everything was already cached"
        return head + (
            f"{self.fetched} fetched from backing storage, {self.cached} already cached, "
            f"{self.failed} failed"
        )


@dataclass(slots=True)
class _Batch:
    addr: str
    keys: list[BlockKey]
    nbytes: int
    file: _FileState
    source: str | None = None  # the first zone's owner, which the owner copies from


@dataclass(slots=True)
class _FileState:
    warm: WarmFile
    pending: int


def _by_owner(router: CacheRouter, files: Sequence[WarmFile],
              targets: Sequence[str]) -> dict[tuple[str, str], dict[BlockKey, int]]:  # fmt: skip
    """``(zone, node address) -> {key: bytes of the files in it}``: where each block belongs."""
    out: dict[tuple[str, str], dict[BlockKey, int]] = {}
    for warm in files:
        for key, nbytes in warm.blocks.items():
            for node in router.owners(key):
                if node.zone in targets:  # a key named twice (a path given twice, hard links) counts once
                    out.setdefault((node.zone, node.addr), {})[key] = nbytes
    return out


@dataclass(slots=True)
class ZoneCache:
    """How much of the files one zone's cache nodes hold (``--check``), or dropped (``--evict``)."""

    blocks: int = 0
    bytes: int = 0
    cached_blocks: int = 0
    cached_bytes: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return self.cached_bytes / self.bytes if self.bytes else 1.0


async def check_files(pool: RpcPool, router: CacheRouter, volume: str, files: Sequence[WarmFile], *,
                      zones: Sequence[str] | None = None, evict: bool = False,
                      batch: int = 10_000) -> dict[str, ZoneCache]:  # fmt: skip
    """Per target zone, how many of the files' blocks (and their bytes) its owners hold;
    with ``evict``, have them drop those blocks and count what they dropped."""
    targets = list(zones) if zones else list(router.rings)
    out = {zone: ZoneCache() for zone in sorted(targets)}

    async def ask(zone: str, addr: str, keys: dict[BlockKey, int]) -> None:
        z = out[zone]
        order = list(keys)
        z.blocks += len(order)
        z.bytes += sum(keys.values())
        for i in range(0, len(order), batch):
            part = order[i : i + batch]
            args = {"volume": volume, "keys": [k.to_bytes() for k in part]}
            try:
                reply = await pool.call(addr, "evict" if evict else "holds", args, timeout=60.0)
            except CacheFSError as exc:
                z.errors.append(f"{addr}: {exc}")
                continue
            if evict:
                z.cached_blocks += reply.result["evicted"]
                continue
            for key, has in zip(part, reply.result, strict=True):
                if has:
                    z.cached_blocks += 1
                    z.cached_bytes += keys[key]

    async with trio.open_nursery() as nursery:
        for (zone, addr), keys in _by_owner(router, files, targets).items():
            nursery.start_soon(ask, zone, addr, keys)
    return out


async def warm_files(
    pool: RpcPool,
    router: CacheRouter,
    volume: str,
    files: Sequence[WarmFile],
    *,
    zones: Sequence[str] | None = None,
    threads: int = 8,
    batch: int = BATCH,
    timeout: float = 600.0,
    pin_until: float = 0.0,
    on_bytes: Callable[[int], None] | None = None,
    on_file: Callable[[WarmFile], None] | None = None,
) -> WarmupReport:
    """Prefetch every block of ``files`` into its owner in each target zone
    (pinned there until ``pin_until``, if set)."""
    report = WarmupReport(files=len(files))
    started = time.perf_counter()
    targets = list(zones) if zones else list(router.rings)
    first = min(targets) if targets else ""
    batches: list[_Batch] = []
    for warm in files:
        state = _FileState(warm, 0)
        per_addr: dict[tuple[str, str | None], list[BlockKey]] = {}  # (owner, its source) -> keys
        for key in warm.blocks:
            owners = [node for node in router.owners(key) if node.zone in targets]
            source = next((node.addr for node in owners if node.zone == first), None)
            for node in owners:
                per_addr.setdefault((node.addr, None if node.zone == first else source), []).append(key)
        for (addr, source), keys in per_addr.items():
            for i in range(0, len(keys), batch):
                part = keys[i : i + batch]
                batches.append(_Batch(addr, part, sum(warm.blocks[k] for k in part), state, source))
                state.pending += 1
        report.blocks += sum(len(k) for k in per_addr.values())
        report.bytes += sum(warm.blocks[k] for keys in per_addr.values() for k in keys)
        if state.pending == 0 and on_file is not None:
            on_file(warm)
    # the first zone from backing storage, then the others, each copying from it (``source``)
    waves = [[b for b in batches if b.source is None], [b for b in batches if b.source is not None]]

    async def worker(recv: trio.MemoryReceiveChannel[_Batch]) -> None:
        async with recv:
            async for b in recv:
                await run_batch(b)

    async def run_batch(b: _Batch) -> None:
        if router.is_down(b.addr):
            report.failed += len(b.keys)
            report.errors.append(f"{b.addr}: marked down, {len(b.keys)} blocks skipped")
        else:
            try:
                answer = (
                    await pool.call(
                        b.addr,
                        "prefetch",
                        {"volume": volume, "keys": [k.to_bytes() for k in b.keys], "wait": True}
                        | ({"source": b.source} if b.source else {})
                        | ({"pin_until": pin_until} if pin_until else {}),
                        timeout=timeout,
                    )
                ).result
                report.cached += answer["cached"]
                report.fetched += answer.get("done", 0)
                report.failed += answer.get("failed", 0)
                if answer.get("failed"):
                    report.errors.append(
                        f"{b.addr}: {answer['failed']} blocks could not be fetched"
                    )
            except (Unreachable, ConnectionLost, TimedOut) as exc:
                router.mark_down(b.addr)
                report.failed += len(b.keys)
                report.errors.append(f"{b.addr}: {exc}")
            except CacheFSError as exc:
                report.failed += len(b.keys)
                report.errors.append(f"{b.addr}: {exc}")
        if on_bytes is not None:
            on_bytes(b.nbytes)
        b.file.pending -= 1
        if b.file.pending == 0 and on_file is not None:
            on_file(b.file.warm)

    for wave in waves:
        send, recv = trio.open_memory_channel[_Batch](len(wave) or 1)
        for b in wave:
            send.send_nowait(b)
        send.close()
        async with trio.open_nursery() as nursery:
            for _ in range(max(1, threads)):
                nursery.start_soon(worker, recv.clone())
            recv.close()
    report.seconds = time.perf_counter() - started
    return report
