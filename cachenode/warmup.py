"""``cachefs warmup PATH...``: push the blocks of a tree into the cache tier.

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
4. Report. A rich progress bar shows files, bytes and rate; the summary says
   how much was fetched and how much was already cached, so re-running on a
   warm tree finishes fast and says so.

``--check`` resolves and routes the same way, then asks each owner which of
its blocks it ``holds`` (from its index: nothing is fetched) and reports the
cached fraction per zone; ``--evict`` asks the owners to drop the blocks
instead. ``-f LIST`` reads the paths from a file, one a line.
"""

from __future__ import annotations

import logging
import os
import ssl
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import click
import trio

from cachefs import queries as Q
from cachefs.config import ADDRS, load_secret, load_tls, tls_options
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

log = logging.getLogger(__name__)

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

    async with trio.open_nursery() as nursery:
        for path in paths:
            await walk(path, await lookup(path), nursery)
    return files


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
    on_bytes: Callable[[int], None] | None = None,
    on_file: Callable[[WarmFile], None] | None = None,
) -> WarmupReport:
    """Prefetch every block of ``files`` into its owner in each target zone."""
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
                        | ({"source": b.source} if b.source else {}),
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


# ---------------------------------------------------------------- the command


async def run_warmup(
    meta: list[str],
    volume: str,
    paths: Sequence[str],
    *,
    secret: bytes | None,
    threads: int,
    zones: Sequence[str] | None,
    quiet: bool = False,
    tls: ssl.SSLContext | None = None,
    check: str | None = None,
) -> WarmupReport | dict[str, ZoneCache]:
    """Warm ``paths``; with ``check`` "check" or "evict", report or drop what is cached instead."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    from cachefs.metanode.client import MetaClient

    console = Console(stderr=True, quiet=quiet)
    async with RpcPool(secret=secret, tls=tls) as pool:
        reader = MetaClient(pool, meta, deadline=20.0)
        cmap = await reader.query(Q.ClusterMap())
        vol = cmap.get("volumes", {}).get(volume)
        if vol is None:
            raise click.UsageError(f"no volume {volume!r} in the cluster map")
        router = CacheRouter(cmap, zones[0] if zones else "")
        if not router.rings:
            raise click.UsageError("the cluster map lists no cache nodes that are up")
        unknown = [z for z in zones or () if z not in router.rings]
        if unknown:
            raise click.UsageError(
                f"no cache nodes up in zone {unknown[0]!r} (zones: {', '.join(sorted(router.rings))})"
            )
        with console.status("resolving paths: 0 files") as status:
            count = [0]

            def resolved(_: WarmFile) -> None:
                count[0] += 1
                status.update(f"resolving paths: {count[0]} files")

            files = await resolve_paths(
                reader, volume, paths, int(vol["block_size"]), threads=threads, on_file=resolved
            )
        if check is not None:
            return await check_files(pool, router, volume, files, zones=zones, evict=check == "evict")
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[files]}"),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            copies = len(zones) if zones else len(router.rings)
            task = progress.add_task(
                "warming", total=sum(f.size for f in files) * copies, files=f"0/{len(files)} files"
            )
            done = [0]

            def file_done(_: WarmFile) -> None:
                done[0] += 1
                progress.update(task, files=f"{done[0]}/{len(files)} files")

            report = await warm_files(
                pool,
                router,
                volume,
                files,
                zones=zones,
                threads=threads,
                on_bytes=lambda n: progress.advance(task, n),
                on_file=file_done,
            )
            progress.update(task, completed=sum(f.size for f in files) * copies)
    return report


def _paths_from(list_file: str | None, paths: Sequence[str]) -> list[str]:
    """PATH arguments, then the lines of ``-f LIST`` (blank lines and ``#`` comments skipped)."""
    out = list(paths)
    if list_file is not None:
        try:
            with open(list_file, encoding="utf-8", errors="surrogateescape") as f:
                out += [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
        except OSError as exc:
            raise click.BadParameter(f"cannot read {list_file}: {exc.strerror}", param_hint="-f") from None
    if not out:
        raise click.UsageError("no paths: give PATH... or -f LIST")
    return out


@click.command("warmup")
@click.argument("paths", nargs=-1)
@click.option("-f", "--file", "list_file", type=click.Path(dir_okay=False),
              help="Read paths (inside the volume) from this file, one a line.")
@click.option("--check", is_flag=True, help="Fetch nothing: report what fraction of the paths each zone caches.")
@click.option("--evict", is_flag=True, help="Drop the paths' blocks from the cache nodes instead of warming them.")
@click.option("--volume", required=True, help="Volume the paths are in.")
@click.option(
    "--meta",
    type=ADDRS,
    required=True,
    envvar="CACHEFS_META",
    help="Metanode addresses (comma separated).",
)
@click.option(
    "--threads",
    type=click.IntRange(1, 1024),
    default=8,
    show_default=True,
    help="Batches of blocks prefetched in parallel.",
)
@click.option(
    "--zone",
    "zones",
    multiple=True,
    help="Warm only this zone's cache nodes (repeatable; default: every zone).",
)
@click.option(
    "--secret-file",
    envvar="CACHEFS_SECRET_FILE",
    type=click.Path(dir_okay=False),
    help="A client credential for the volume (cachefs credential issue) or the cluster secret (or set CACHEFS_SECRET).",
)
@click.option(
    "--insecure",
    is_flag=True,
    envvar="CACHEFS_INSECURE",
    help="Talk to a cluster that runs without authentication.",
)
@click.option("--quiet", is_flag=True, help="No progress bar, only the summary.")
@tls_options
def command(
    paths: tuple[str, ...],
    list_file: str | None,
    check: bool,
    evict: bool,
    volume: str,
    meta: list[str],
    threads: int,
    zones: tuple[str, ...],
    secret_file: str | None,
    insecure: bool,
    quiet: bool,
    tls_cert: str | None,
    tls_key: str | None,
    tls_ca: str | None,
) -> None:
    """Prefetch the blocks of PATH... (paths inside the volume) into the cache tier
    (or, with --check, report how much is cached; with --evict, drop it)."""
    if check and evict:
        raise click.UsageError("--check and --evict exclude each other")
    all_paths = _paths_from(list_file, paths)
    secret = load_secret(secret_file, insecure)
    _, tls = load_tls(tls_cert, tls_key, tls_ca)
    mode = "check" if check else "evict" if evict else None
    try:
        report = trio.run(
            lambda: run_warmup(
                meta,
                volume,
                all_paths,
                secret=secret,
                threads=threads,
                zones=list(zones) or None,
                quiet=quiet,
                tls=tls,
                check=mode,
            )
        )
    except CacheFSError as exc:
        raise click.ClickException(str(exc)) from None
    if isinstance(report, dict):
        failed = False
        for zone, z in report.items():
            if evict:
                click.echo(f"zone {zone}: evicted {z.cached_blocks} of {z.blocks} blocks")
            else:
                click.echo(f"zone {zone}: {100 * z.fraction:.1f}% cached ({z.cached_blocks} of {z.blocks} blocks, "
                           f"{z.cached_bytes} of {z.bytes} bytes)")  # fmt: skip
            for line in z.errors[:10]:
                click.echo(f"  {line}", err=True)
            failed |= bool(z.errors)
        if failed:
            sys.exit(1)
        return
    click.echo(report.summary())
    for line in report.errors[:10]:
        click.echo(f"  {line}", err=True)
    if report.failed:
        sys.exit(1)
