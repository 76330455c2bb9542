"""Repair and scrub: bring every block back to full redundancy.

Theory of operation. For each volume, repair takes an inventory: every
datanode lists its shards (paged), giving ``key -> index -> {nodes}``. With
``scrub`` on, each datanode first re-reads and checks every shard it holds;
corrupt ones are dropped (and marked), so they show up as missing.

Then it walks the placement groups in order. For each block of a PG, shard
``i`` belongs on ``pg[i]``:

- missing: ``pg[i]`` lacks it. Read any K intact shards (from wherever they
  sit), check that they decode to the block's checksum, recreate the lost
  shards bit for bit (pyeclib ``reconstruct``; a copy for replicas) and write
  each to its datanode.
- misplaced: a node other than ``pg[i]`` holds shard ``i`` (placement changed
  when a datanode joined or left, or a put handed the shard off while
  ``pg[i]`` was down). Once ``pg[i]`` has it, the stray copy is deleted.
- unrecoverable: fewer than K shards exist anywhere. Reported, never deleted.

Slots on datanodes that are down are skipped (counted), since nothing can be
written there; the next pass finishes them. Writes are throttled to
``rate`` bytes/s and scrub reads to ``scrub_rate`` bytes/s (all datanodes
together: they are scrubbed one after the other, in pages of a quarter
second's worth of bytes), so a background repair leaves bandwidth and disk
time to clients. The ``cachefs repair`` command is in cachefs/cli/repair.py.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import trio
from prometheus_client import Counter, Gauge

from cachefs.backing.client import BackingClient, MissingShard
from cachefs.backing.placement import pg_of
from cachefs.errors import CacheFSError
from cachefs.ids import BlockKey
from cachefs.tasks import run_all

log = logging.getLogger(__name__)

LIST_PAGE = 2000
MAX_REPORTED_KEYS = 100

_REBUILT = Counter("cachefs_repair_shards_rebuilt_total", "Shards rebuilt by repair")
_REBUILT_BYTES = Counter("cachefs_repair_written_bytes_total", "Bytes written by repair")
_UNRECOVERABLE = Counter("cachefs_repair_unrecoverable_blocks_total", "Blocks repair found with too few shards")
_CHECKED = Counter("cachefs_repair_checked_blocks_total", "Blocks repair checked (progress of a pass)")
_PROGRESS = Gauge("cachefs_repair_progress_ratio",
                  "Placement groups of a volume done in the current or last repair pass, over all of them",
                  ["volume"])


@dataclass
class RepairReport:
    volume: str = ""
    pgs_total: int = 0
    pgs_done: int = 0
    blocks_checked: int = 0
    shards_scrubbed: int = 0
    bytes_scrubbed: int = 0
    shards_corrupt: int = 0
    shards_missing: int = 0
    shards_rebuilt: int = 0
    shards_moved: int = 0
    slots_skipped: int = 0
    bytes_written: int = 0
    unrecoverable: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return (not self.unrecoverable and not self.errors and not self.slots_skipped
                and self.shards_rebuilt == self.shards_missing)


class Throttle:
    """A byte-rate limit: callers sleep so the long-run rate stays under ``rate``."""

    def __init__(self, rate: int | None, burst_seconds: float = 0.5) -> None:
        self.rate = rate or None
        self.burst = burst_seconds
        self._free_at = 0.0

    async def __call__(self, nbytes: int) -> None:
        if self.rate is None:
            return
        now = trio.current_time()
        self._free_at = max(self._free_at, now - self.burst) + nbytes / self.rate
        if self._free_at > now:
            await trio.sleep(self._free_at - now)


class Repairer:
    SCRUB_STEP = 0.25  # seconds of scrub reads per page when rate-limited

    def __init__(self, client: BackingClient, *, rate: int | None = None,
                 scrub_rate: int | None = None,
                 progress: Callable[[RepairReport], None] | None = None) -> None:
        self.client = client
        self.throttle = Throttle(rate)
        self.scrub_throttle = Throttle(scrub_rate)
        self.progress = progress

    @property
    def view(self) -> Any:
        return self.client.view

    async def _up_nodes(self) -> dict[str, str]:
        return {n.id: n.addr for n in self.view.datanodes.values() if n.state == "up"}

    async def scrub(self, volume: str, report: RepairReport) -> set[BlockKey]:
        """Have every datanode verify its shards of ``volume`` end to end.

        Returns the keys with corrupt shards, so that a block whose every
        shard went bad is still reported rather than silently gone.
        """
        bad: set[BlockKey] = set()
        rate = self.scrub_throttle.rate
        step = {"max_bytes": max(1, int(rate * self.SCRUB_STEP))} if rate else {}
        for node, addr in (await self._up_nodes()).items():
            cursor = ""
            try:
                while True:
                    reply = await self.client.pool.call(
                        addr, "scrub", {"volume": volume, "cursor": cursor, **step}, timeout=120.0)
                    await self.scrub_throttle(reply.result["bytes"])
                    report.shards_scrubbed += reply.result["checked"]
                    report.bytes_scrubbed += reply.result["bytes"]
                    report.shards_corrupt += len(reply.result["corrupt"])
                    for key, index in reply.result["corrupt"]:
                        bad.add(BlockKey.from_bytes(key))
                        log.warning("scrub: %s shard %s.%d corrupt on %s", volume,
                                    BlockKey.from_bytes(key).hex(), index, node)
                    cursor = reply.result["cursor"]
                    if not cursor:
                        break
            except CacheFSError as exc:
                report.errors.append(f"scrub on {node}: {exc}")
        return bad

    async def inventory(self, volume: str, report: RepairReport) -> dict[BlockKey, dict[int, set[str]]]:
        """Which node holds which shard of every block of ``volume``."""
        holdings: dict[BlockKey, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
        for node, addr in (await self._up_nodes()).items():
            cursor = ""
            try:
                while True:
                    reply = await self.client.pool.call(
                        addr, "list", {"volume": volume, "cursor": cursor, "limit": LIST_PAGE},
                        timeout=60.0)
                    for key, index, _size in reply.result["shards"]:
                        holdings[BlockKey.from_bytes(key)][index].add(node)
                    cursor = reply.result["cursor"]
                    if not cursor:
                        break
            except CacheFSError as exc:
                report.errors.append(f"listing {node}: {exc}")
        return holdings

    async def repair_volume(self, volume: str, *, scrub: bool = False) -> RepairReport:
        report = RepairReport(volume=volume)
        pgs = self.view.pgs(volume)
        report.pgs_total = len(pgs)
        corrupt = await self.scrub(volume, report) if scrub else set()
        holdings = await self.inventory(volume, report)
        for key in corrupt:
            holdings[key]  # noqa: B018 - a defaultdict entry: the block is checked even with no shard left
        by_pg: dict[int, list[BlockKey]] = defaultdict(list)
        for key in holdings:
            by_pg[pg_of(key, len(pgs))].append(key)
        for pg_index in range(len(pgs)):
            for key in sorted(by_pg.get(pg_index, ())):
                await self.repair_block(volume, key, pgs[pg_index], holdings[key], report)
            report.pgs_done += 1
            _PROGRESS.labels(volume).set(report.pgs_done / report.pgs_total)
            if self.progress is not None:
                self.progress(report)
        log.info("repair of %s: %s", volume, {k: v for k, v in asdict(report).items() if v})
        return report

    async def repair_missing(self, missing: Iterable[MissingShard]) -> RepairReport:
        """Repair just the blocks a client recorded as stored short (``BackingClient.missing``)."""
        report = RepairReport(volume="(recorded)")
        hints: dict[str, dict[BlockKey, set[tuple[int, str]]]] = defaultdict(lambda: defaultdict(set))
        for m in missing:
            holders = hints[m.volume][m.key]  # every recorded block, handed off or not
            if m.handoff is not None:
                holders.add((m.index, m.handoff))
        for volume, blocks in sorted(hints.items()):
            await self.repair_keys(volume, sorted(blocks), report, hints=blocks)
        return report

    async def repair_keys(self, volume: str, keys: Iterable[BlockKey], report: RepairReport, *,
                          hints: Mapping[BlockKey, Iterable[tuple[int, str]]] | None = None) -> list[BlockKey]:
        """Check and repair the named blocks of ``volume``: the fast path for blocks known
        to be short (after a node outage), with no listing of whole datanodes.

        Each shard slot takes one ``stat``; a slot found empty is also looked
        for on its handoff substitutes (and on the holders ``hints`` name), so
        a handed-off copy is moved rather than rebuilt. Returns the keys that
        are whole now: every shard on its placement-group member.
        """
        whole = []
        for key in keys:
            pg = self.view.placement(volume, key)
            n = self.view.policy(volume).n
            held = await self.holdings(volume, key, pg, n, (hints or {}).get(key, ()))
            await self.repair_block(volume, key, pg, held, report)
            if all(pg[i] in held[i] for i in range(n)):
                whole.append(key)
        return whole

    async def holdings(self, volume: str, key: BlockKey, pg: tuple[str, ...], n: int,
                        hints: Iterable[tuple[int, str]]) -> dict[int, set[str]]:
        """Who holds which shard of one block: its PG members, then for an empty
        slot the hinted holders and the handoff substitutes (all slots at once)."""
        held: dict[int, set[str]] = defaultdict(set)
        extra: dict[int, set[str]] = defaultdict(set)
        for i, node in hints:
            extra[i].add(node)

        async def find(i: int) -> None:
            if await self._has(pg[i], volume, key, i):
                held[i].add(pg[i])
                return
            for node in dict.fromkeys([*sorted(extra[i]), *self.client._substitutes(key, i, pg)]):
                if node != pg[i] and await self._has(node, volume, key, i):
                    held[i].add(node)

        await run_all(functools.partial(find, i) for i in range(n))
        return held

    async def _has(self, node: str, volume: str, key: BlockKey, index: int) -> bool:
        """Whether ``node`` holds an intact-looking shard (its header checks out)."""
        try:
            await self.client.pool.call(self.client._addr(node), "stat",
                                        {"volume": volume, "key": key.to_bytes(), "index": index},
                                        timeout=self.client.timeout)
        except CacheFSError:
            return False  # missing, corrupt or unreachable: repair_block sorts it out
        return True

    async def repair_block(self, volume: str, key: BlockKey, pg: tuple[str, ...],
                           held: dict[int, set[str]], report: RepairReport) -> None:
        policy = self.view.policy(volume)
        up = await self._up_nodes()
        report.blocks_checked += 1
        _CHECKED.inc()
        missing, skipped = [], 0
        for i in range(policy.n):
            if pg[i] in held.get(i, ()):
                continue
            if pg[i] not in up:
                skipped += 1
                continue
            missing.append(i)
        report.slots_skipped += skipped
        if missing:
            report.shards_missing += len(missing)
            sources = {}
            for i, nodes in held.items():
                if 0 <= i < policy.n and nodes:
                    sources[i] = pg[i] if pg[i] in nodes else sorted(nodes)[0]
            try:
                header, shards = await self.client.read_shards(volume, key, pg=pg, sources=sources,
                                                               avoid=missing)
                rebuilt = self.client.codec(policy).rebuild(header, shards, missing)
            except CacheFSError as exc:
                _UNRECOVERABLE.inc()
                if len(report.unrecoverable) < MAX_REPORTED_KEYS:
                    report.unrecoverable.append(f"{key.hex()}: {exc}")
                log.error("repair: block %s/%s cannot be rebuilt: %s", volume, key.hex(), exc)
                return
            for i, shard in rebuilt.items():
                await self.throttle(len(shard))
                try:
                    await self.client.write_shard(pg[i], volume, key, i, header, shard)
                except CacheFSError as exc:
                    report.errors.append(f"writing {key.hex()}.{i} to {pg[i]}: {exc}")
                    continue
                held.setdefault(i, set()).add(pg[i])
                report.shards_rebuilt += 1
                report.bytes_written += len(shard)
                _REBUILT.inc()
                _REBUILT_BYTES.inc(len(shard))
        # Stray copies: shard i somewhere other than pg[i], once pg[i] has it.
        for i, nodes in held.items():
            for node in sorted(nodes):
                in_place = 0 <= i < policy.n and node == pg[i]
                if in_place or node not in up:
                    continue
                if 0 <= i < policy.n and pg[i] not in held[i]:
                    continue
                try:
                    await self.client.pool.call(
                        up[node], "delete", {"volume": volume, "key": key.to_bytes(), "index": i},
                        timeout=self.client.timeout)
                    report.shards_moved += 1
                except CacheFSError as exc:
                    report.errors.append(f"removing stray {key.hex()}.{i} from {node}: {exc}")
