"""Jobs: warm-ups the cluster runs on its own (``cachefs warmup --background``).

Theory of operation
-------------------

A job is replicated state (:class:`JobTable`, in the snapshot), so it
outlives the client that submitted it, a restart of every metanode and a
failover. Three log commands move it (``cachefs.commands``)::

    SubmitJob ──> queued ──JobProgress(attempt 1)──> running ──JobProgress──> done | failed
                     │                                  │  ▲
                     └──────────CancelJob───────────────┴──┼──> cancelled
                                                           └── JobProgress(attempt n+1): a new
                                                               leader starts it again

The runner (:class:`~.jobrunner.JobRunner`) lives on the leader, like the garbage
collector: while this replica leads, every job that is queued or running
and not already running here gets a task. Its first report opens a new
*attempt* (so a job that was running under a leader that died starts
again under the next one; a report of an older attempt is ignored, so a
deposed leader's late report cannot undo the new one's). The task resolves
the paths through the metanodes and has the owning cache nodes fetch the
blocks (:mod:`cachefs.warming`, the same code as the foreground warm-up,
so a block already cached costs one index lookup: a restarted job skips
what its predecessor warmed). Every ``report_every`` seconds it looks
at the job in its own state (the leader has applied every commit, a cancel
too) and stops if it was cancelled, else reports its counters if they
changed (a log entry only when there is news).
Blocks that failed (a cache node that died mid-job) are tried again, up to
``ROUNDS`` times, each after ``retry_wait`` seconds with a fresh cluster
map, in which a dead node is down by then and its blocks have new owners.
Losing the leadership cancels every task here; the new leader takes over.
An error that stops an attempt (a failover under it) leaves the job running
for the next tick to start again; after ``MAX_ATTEMPTS`` attempts, or on an
unexpected error, the job fails naming it.

Time in the table is the leader's ``now_ns`` stamped on each command. The
ETA is derived from the last report: elapsed time of the attempt times the
bytes left over the bytes done.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cachefs import commands as C
from cachefs.errors import NotFound

KEPT_FINISHED = 1000  # finished jobs kept for ``warmup status``; older ones are dropped


@dataclasses.dataclass(slots=True)
class Job:
    id: int
    volume: str
    paths: list[str]
    zones: list[str]
    pin_ttl: int
    threads: int
    submitted_ns: int
    state: str = "queued"
    attempt: int = 0
    runner: int = 0
    started_ns: int = 0
    updated_ns: int = 0
    finished_ns: int = 0
    files: int = 0
    files_done: int = 0
    bytes_total: int = 0
    bytes_done: int = 0
    blocks: int = 0
    cached: int = 0
    fetched: int = 0
    failed: int = 0
    error: str = ""

    @property
    def finished(self) -> bool:
        return self.state in C.JOB_FINISHED

    def to_dict(self) -> dict[str, Any]:
        """The keys ``cachefs warmup status --json`` prints (times in seconds since the epoch)."""
        eta = None
        if self.state == "running" and self.bytes_done and self.updated_ns > self.started_ns:
            elapsed = (self.updated_ns - self.started_ns) / 1e9
            eta = round(elapsed * (self.bytes_total - self.bytes_done) / self.bytes_done, 1)
        return {
            "id": self.id,
            "kind": "warmup",
            "volume": self.volume,
            "paths": list(self.paths),
            "zones": list(self.zones),
            "pin_ttl": self.pin_ttl,
            "threads": self.threads,
            "state": self.state,
            "attempt": self.attempt,
            "runner": self.runner,
            "submitted": self.submitted_ns / 1e9,
            "started": self.started_ns / 1e9 if self.started_ns else None,
            "updated": self.updated_ns / 1e9 if self.updated_ns else None,
            "finished": self.finished_ns / 1e9 if self.finished_ns else None,
            "files": self.files,
            "files_done": self.files_done,
            "bytes_total": self.bytes_total,
            "bytes_done": self.bytes_done,
            "progress": round(self.bytes_done / self.bytes_total, 4) if self.bytes_total else
                        (1.0 if self.state == "done" else 0.0),  # fmt: skip
            "eta": eta,
            "blocks": self.blocks,
            "cached": self.cached,
            "fetched": self.fetched,
            "failed": self.failed,
            "error": self.error,
        }


_FIELDS = [f.name for f in dataclasses.fields(Job)]


class JobTable:
    """Every job, by id (part of :class:`~.namespace.MetaState`)."""

    def __init__(self) -> None:
        self.jobs: dict[int, Job] = {}
        self.next_id = 1

    def submit(self, cmd: C.SubmitJob) -> dict[str, Any]:
        job = Job(self.next_id, cmd.volume, C.unpack_strings(cmd.paths, "paths", C.MAX_JOB_PATHS),
                  C.unpack_strings(cmd.zones, "zones", 64), cmd.pin_ttl, cmd.threads, cmd.now_ns)  # fmt: skip
        self.next_id += 1
        self.jobs[job.id] = job
        finished = [j.id for j in self.jobs.values() if j.finished]
        for old in finished[: max(0, len(finished) - KEPT_FINISHED)]:
            del self.jobs[old]
        return job.to_dict()

    def cancel(self, cmd: C.CancelJob) -> dict[str, Any]:
        job = self.jobs.get(cmd.job_id)
        if job is None or job.volume != cmd.volume:
            raise NotFound(f"no job {cmd.job_id} in volume {cmd.volume!r}")
        if not job.finished:
            job.state = "cancelled"
            job.finished_ns = job.updated_ns = cmd.now_ns
        return job.to_dict()

    def progress(self, cmd: C.JobProgress) -> dict[str, Any]:
        job = self.jobs.get(cmd.job_id)
        if job is None:
            raise NotFound(f"no job {cmd.job_id}")
        if job.finished or cmd.attempt < job.attempt:
            return job.to_dict()  # cancelled meanwhile, or a deposed runner's late word
        if cmd.attempt > job.attempt:
            job.attempt = cmd.attempt
            job.started_ns = cmd.now_ns
        job.state, job.runner, job.updated_ns, job.error = cmd.state, cmd.runner, cmd.now_ns, cmd.error
        for name in ("files", "files_done", "bytes_total", "bytes_done", "blocks", "cached", "fetched", "failed"):
            setattr(job, name, getattr(cmd, name))
        if job.finished:
            job.finished_ns = cmd.now_ns
        return job.to_dict()

    def active(self) -> list[Job]:
        return [j for j in self.jobs.values() if not j.finished]

    def listing(self, job_id: int = 0) -> list[dict[str, Any]]:
        if job_id:
            job = self.jobs.get(job_id)
            return [job.to_dict()] if job is not None else []
        return [j.to_dict() for j in self.jobs.values()]

    def drop_volume(self, volume: str) -> None:
        """A deleted volume's jobs end (cancelled) so no runner chases its paths."""
        for job in self.jobs.values():
            if job.volume == volume and not job.finished:
                job.state, job.error = "cancelled", f"volume {volume!r} was deleted"

    def dump(self) -> list[Any]:
        return [self.next_id, [[getattr(j, n) for n in _FIELDS] for j in self.jobs.values()]]

    @classmethod
    def load(cls, raw: list[Any]) -> JobTable:
        table = cls()
        table.next_id, rows = raw
        table.jobs = {row[0]: Job(*row) for row in rows}
        return table
