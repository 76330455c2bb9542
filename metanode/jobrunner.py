"""The leader's job runner: see the theory of operation in :mod:`.jobs`."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.errors import CacheFSError, NotFound
from cachefs.ring import CacheRouter
from cachefs.warming import WarmFile, resolve_paths, warm_files

from .jobs import Job, JobTable

if TYPE_CHECKING:
    from cachefs.rpc import RpcPool

    from .client import MetaClient

log = logging.getLogger(__name__)

ROUNDS = 3  # rounds over a job's failed blocks before it fails
MAX_ATTEMPTS = 50  # attempts (failovers, errors that stopped one) before a job fails


class JobRunner:
    """Runs the table's jobs while this replica leads (see the module docstring)."""

    def __init__(
        self,
        table: Callable[[], JobTable],
        propose: Callable[[C.Command[Any]], Awaitable[Any]],
        meta: MetaClient,
        pool: RpcPool,
        node_id: int,
        *,
        report_every: float = 0.25,
        retry_wait: float = 20.0,
    ) -> None:
        self._table = table  # the state's table: a snapshot install replaces it
        self.propose = propose
        self.meta = meta
        self.pool = pool
        self.node_id = node_id
        self.report_every = report_every
        self.retry_wait = retry_wait
        self._running: dict[int, trio.CancelScope] = {}

    async def run(
        self,
        leading: Callable[[], bool],
        *,
        tick: float = 1.0,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                if not leading():
                    for scope in self._running.values():
                        scope.cancel()
                else:
                    for job in self._table().active():
                        if job.id not in self._running:
                            self._running[job.id] = trio.CancelScope()
                            nursery.start_soon(self._run, job.id)
                await trio.sleep(tick)

    async def _run(self, job_id: int) -> None:
        attempt = _Attempt(self, self._table().jobs[job_id])
        try:
            with self._running[job_id]:
                await attempt.run()
        except Exception as exc:  # the job's boundary: nothing here may end the metanode
            if all(isinstance(e, CacheFSError) for e in _leaves(exc)):  # a failover under it, say
                log.warning("job %d: attempt %d stopped, the next tick retries: %s", job_id, attempt.attempt, exc)
            else:
                log.exception("job %d: attempt %d failed unexpectedly", job_id, attempt.attempt)
                with contextlib.suppress(CacheFSError):
                    await attempt.report("failed", f"internal error: {exc!r}")
        finally:
            del self._running[job_id]


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


class _Attempt:
    """One attempt at one job: its counters and the reports that carry them."""

    def __init__(self, runner: JobRunner, job: Job) -> None:
        self.r = runner
        self.job = job
        self.attempt = job.attempt + 1
        self.counts = dict.fromkeys(("files", "files_done", "bytes_total", "bytes_done", "blocks",
                                     "cached", "fetched", "failed"), 0)  # fmt: skip

    async def report(self, state: str, error: str = "") -> dict[str, Any]:
        cmd = C.JobProgress(self.job.id, self.attempt, state, self.r.node_id, **self.counts,
                            error=error[: C.MAX_JOB_ERROR], now_ns=time.time_ns())  # fmt: skip
        return await self.r.propose(cmd)

    async def run(self) -> None:
        job = self.job
        if self.attempt > MAX_ATTEMPTS:
            await self.report("failed", f"gave up after {MAX_ATTEMPTS} attempts (see the metanode logs)")
            return
        if (await self.report("running"))["state"] != "running":
            return
        log.info("job %d: warming %d paths of %s (attempt %d)", job.id, len(job.paths), job.volume, self.attempt)
        try:
            cmap = await self.r.meta.query(Q.ClusterMap())
            vol = cmap.get("volumes", {}).get(job.volume)
            if vol is None:
                raise NotFound(f"no volume {job.volume!r}")
            files = await resolve_paths(self.r.meta, job.volume, job.paths, int(vol["block_size"]),
                                        threads=job.threads)  # fmt: skip
        except NotFound as exc:
            await self.report("failed", str(exc))
            return
        self.counts["files"] = len(files)
        errors: list[str] = []
        for round_ in range(ROUNDS):
            router = CacheRouter(cmap, job.zones[0] if job.zones else "")
            unknown = [z for z in job.zones if z not in router.rings]
            if not router.rings or unknown:
                errors = [f"no cache nodes up in zone {unknown[0]!r}" if unknown else "no cache nodes are up"]
            else:
                warm = await self._warm(router, files)
                if warm is None:
                    log.info("job %d: cancelled", job.id)
                    return
                errors = warm
                if not errors:
                    break
            if round_ + 1 < ROUNDS:
                log.info("job %d: %s; trying again in %.0f s", job.id, errors[0], self.r.retry_wait)
                await trio.sleep(self.r.retry_wait)
                cmap = await self.r.meta.query(Q.ClusterMap())
        await self.report("failed" if errors else "done", "; ".join(errors[:5]))
        log.info("job %d: %s", job.id, "failed: " + errors[0] if errors else "done")

    async def _warm(self, router: CacheRouter, files: list[WarmFile]) -> list[str] | None:
        """One round over every file; the errors (none: all warm), or None if
        the job was cancelled meanwhile."""
        job, counts = self.job, self.counts
        copies = len(job.zones) if job.zones else len(router.rings)
        counts.update(files_done=0, bytes_done=0, bytes_total=sum(f.size for f in files) * copies)

        def on_bytes(n: int) -> None:
            counts["bytes_done"] += n

        def on_file(_: WarmFile) -> None:
            counts["files_done"] += 1

        cancelled = False
        async with trio.open_nursery() as nursery:

            async def reporting() -> None:
                nonlocal cancelled
                last: dict[str, int] = {}
                while True:
                    await trio.sleep(self.r.report_every)
                    # the leader's own state has every commit (a cancel too): a read is enough
                    now = self.r._table().jobs.get(job.id)
                    if now is None or now.state != "running":
                        cancelled = True
                    elif counts != last:  # a log entry only when there is news
                        last = dict(counts)
                        cancelled = (await self.report("running"))["state"] != "running"
                    if cancelled:
                        nursery.cancel_scope.cancel()  # stop fetching
                        return

            nursery.start_soon(reporting)
            pin_until = time.time() + job.pin_ttl if job.pin_ttl else 0.0
            result = await warm_files(self.r.pool, router, job.volume, files, zones=job.zones or None,
                                      threads=job.threads, pin_until=pin_until,
                                      on_bytes=on_bytes, on_file=on_file)  # fmt: skip
            nursery.cancel_scope.cancel()
        if cancelled:
            return None
        counts.update(blocks=result.blocks, cached=result.cached, fetched=result.fetched, failed=result.failed,
                      bytes_done=counts["bytes_total"])  # fmt: skip
        return result.errors if result.failed else []
