"""Warm-up jobs in the replicated state (metanode/jobs.py): submission, the
attempts a failover starts, cancellation, and the snapshot that keeps them."""

from __future__ import annotations

import errno

import pytest

from cachefs import commands as C
from cachefs import queries as Q
from cachefs.errors import CacheFSError
from cachefs.metanode.namespace import MetaState

from .nsdriver import VOL, Driver


def submit(ns: Driver, *paths: str, **kw) -> dict:
    return ns.do(C.SubmitJob, VOL, C.pack_strings(list(paths)), **kw)


def test_a_job_runs_in_attempts_and_a_deposed_runners_reports_change_nothing() -> None:
    ns = Driver().volume()
    job = submit(ns, "/train", "/val", pin_ttl=3600, zones=C.pack_strings(["z1"]))
    assert (job["id"], job["state"], job["paths"], job["zones"], job["pin_ttl"]) == (1, "queued", ["/train", "/val"],
                                                                                      ["z1"], 3600)  # fmt: skip
    first = ns.do(C.JobProgress, 1, 1, "running", 1, files=4, bytes_total=400, bytes_done=100)
    assert first["state"] == "running" and first["attempt"] == 1 and first["progress"] == 0.25
    assert first["eta"] is None  # no time has passed in this attempt yet
    later = ns.do(C.JobProgress, 1, 1, "running", 1, files=4, bytes_total=400, bytes_done=200)
    assert later["eta"] == 0.0  # elapsed (1 µs of this clock) times left over done, to 0.1 s
    # leader 1 died; leader 2 starts attempt 2 from the top
    second = ns.do(C.JobProgress, 1, 2, "running", 2, files=4, bytes_total=400)
    assert (second["attempt"], second["runner"], second["bytes_done"]) == (2, 2, 0)
    stale = ns.do(C.JobProgress, 1, 1, "done", 1, files=4, bytes_total=400, bytes_done=400)
    assert stale["state"] == "running" and stale["attempt"] == 2
    done = ns.do(C.JobProgress, 1, 2, "done", 2, files=4, files_done=4, bytes_total=400, bytes_done=400, fetched=3,
                 cached=1)  # fmt: skip
    assert done["state"] == "done" and done["finished"] is not None and done["progress"] == 1.0
    assert ns.do(C.CancelJob, VOL, 1)["state"] == "done"  # a finished job stays as it is
    assert ns.state.jobs.active() == []


def test_cancel_stops_a_job_and_names_a_missing_one() -> None:
    ns = Driver().volume()
    submit(ns, "/a")
    assert ns.do(C.CancelJob, VOL, 1)["state"] == "cancelled"
    assert ns.do(C.JobProgress, 1, 1, "running", 1)["state"] == "cancelled"  # the runner sees it and stops
    with pytest.raises(CacheFSError) as err:
        ns.do(C.CancelJob, VOL, 7)
    assert err.value.errno == errno.ENOENT and "no job 7" in str(err.value)
    ns.do(C.CreateVolume, "other", "replica:3", "none", 4 << 20, 8)
    with pytest.raises(CacheFSError, match="no job 1 in volume 'other'"):
        ns.do(C.CancelJob, "other", 1)


def test_bad_jobs_are_refused_before_the_log() -> None:
    ns = Driver().volume()
    with pytest.raises(CacheFSError, match="no volume 'nope'"):
        ns.do(C.SubmitJob, "nope", C.pack_strings(["/a"]))
    for paths, match in ((b"\xc1", "undecodable paths"), (C.pack_strings([]), "at least one path"),
                         (C.pack_strings([1]), "list of at most"), (C.pack_strings(["x" * 5000]), "path must be")):  # fmt: skip
        with pytest.raises(CacheFSError, match=match):
            C.SubmitJob(VOL, paths)
    with pytest.raises(CacheFSError, match="pin_ttl"):
        C.SubmitJob(VOL, C.pack_strings(["/a"]), pin_ttl=-1)
    with pytest.raises(CacheFSError, match="state must be"):
        C.JobProgress(1, 1, "queued")


def test_jobs_survive_a_snapshot_and_a_deleted_volume_cancels_its_jobs() -> None:
    ns = Driver().volume()
    submit(ns, "/a")
    submit(ns, "/b")
    ns.do(C.JobProgress, 2, 1, "running", 3, files=2, bytes_total=10, bytes_done=5)
    restored = MetaState()
    restored.restore(ns.state.snapshot())
    assert Q.ListJobs().run(restored) == Q.ListJobs().run(ns.state)
    assert [j["id"] for j in Q.ListJobs(2).run(restored)] == [2] and Q.ListJobs(9).run(restored) == []
    assert restored.jobs.next_id == 3
    again = Driver(restored, client="u")
    again.do(C.DeleteVolume, VOL, True)
    assert [j["state"] for j in Q.ListJobs().run(restored)] == ["cancelled", "cancelled"]
    assert Q.ListJobs().confine(Q.ListJobs().run(restored), frozenset({"other"})) == []
