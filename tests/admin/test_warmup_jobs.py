"""``cachefs warmup --background`` / ``status`` / ``cancel`` on a lab of real
processes (3 metanodes, 3 datanodes with ec:2+1, 2 cache nodes in one zone):
the metanode leader runs the job, and a kill -9 of that leader mid-job
hands it to the next leader, which finishes it; the blocks end up cached
and pinned for ``--pin-ttl``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from cachefs.errors import CacheFSError
from cachefs.rpc import RpcPool

pytestmark = [pytest.mark.slow, pytest.mark.needs_fuse]

MiB = 1 << 20
# One 4 MiB block each. With --threads 1 a job runs for well over one progress
# report (0.25 s): with 16 the first report could already be the last.
FILES = 48


@pytest.fixture(scope="module")
def lab(needs_fuse, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from cachefs.lab.cluster import Lab, LabConfig
    from cachefs.testing.ports import free_lab_base

    config = LabConfig(root=str(tmp_path_factory.mktemp("joblab")), metanodes=3, datanodes=3, cachenodes=2,
                       zones=1, policy="ec:2+1", metrics=False, data_capacity="2G", cache_capacity="512M",
                       cache_memory="0")  # fmt: skip
    config.base_port = free_lab_base(config)
    lab = Lab(config)
    mnt = Path(tempfile.mkdtemp(prefix="cachefs-jobs-mnt-"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lab.up(timeout=120)
            lab.mount(str(mnt), "--attr-timeout", "0.1", "--entry-timeout", "0.1")
        top = mnt / "jobs"
        top.mkdir()
        for i in range(FILES):
            with open(top / f"f{i:02d}", "wb") as f:
                f.write(os.urandom(4 * MiB))
                os.fsync(f.fileno())
        yield lab
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lab.down()
        if not os.path.ismount(mnt):
            mnt.rmdir()


def warmup(lab: Any, *args: str, role: str = "client") -> subprocess.CompletedProcess[str]:
    sub = [] if args[0] in ("status", "cancel") else ["--volume", "lab", "--quiet"]
    argv = [sys.executable, "-m", "cachefs.cli", "warmup", *args, *sub, "--meta", ",".join(lab.meta_addrs),
            "--secret-file", str(lab.credential_file(role))]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def job_status(lab: Any, job: int) -> dict[str, Any]:
    r = warmup(lab, "status", str(job), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def wait_for(lab: Any, job: int, done: Any, timeout: float = 120.0) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while True:
        st = job_status(lab, job)
        if done(st):
            return st
        assert time.monotonic() < end, f"job {job} never got there: {st}"
        time.sleep(0.2)


def leader(lab: Any) -> tuple[str, int]:
    async def ask() -> list[tuple[str, int]]:
        found = []
        async with RpcPool(secret=lab.credential("admin")) as pool:
            for node in lab.of_kind("metanode"):
                if node.pid:
                    try:
                        st = (await pool.call(node.addr, "meta_status", timeout=2)).result
                    except CacheFSError:
                        continue
                    if st["is_leader"]:
                        found.append((node.name, st["id"]))
        return found

    end = time.monotonic() + 30
    while len(found := lab.run(ask)) != 1:
        assert time.monotonic() < end, "no single metanode leader"
        time.sleep(0.2)
    return found[0]


def pins(lab: Any) -> int:
    async def ask() -> int:
        async with RpcPool(secret=lab.credential("admin")) as pool:
            return sum([(await pool.call(n.addr, "stats", timeout=5)).result["pins"] for n in lab.of_kind("cachenode")])

    return lab.run(ask)


def cached_blocks(lab: Any, name: str) -> int:
    async def ask() -> int:
        async with RpcPool(secret=lab.credential("admin")) as pool:
            return (await pool.call(lab.node(name).addr, "stats", timeout=5)).result["blocks"]

    return lab.run(ask)


@contextlib.contextmanager
def held_mid_job(lab: Any, job: int) -> Iterator[dict[str, Any]]:
    """The job as soon as it has warmed something, with every cache node
    SIGSTOPped the moment that is seen (so it cannot finish meanwhile, however
    fast it would be), SIGCONTed (those still there) after. Polled from here:
    a CLI takes a second to start."""
    from cachefs import queries as Q

    nodes = lab.of_kind("cachenode")

    async def poll() -> dict[str, Any]:
        async with RpcPool(secret=lab.credential("client")) as pool:
            mc = lab.meta_client(pool, deadline=10)
            with trio.fail_after(120):
                while (st := (await mc.query(Q.ListJobs(job)))[0])["bytes_done"] == 0:
                    await trio.sleep(0.02)
            for node in nodes:
                os.kill(node.pid, signal.SIGSTOP)
            return st

    try:
        yield lab.run(poll)
    finally:
        for node in nodes:
            if node.pid:
                os.kill(node.pid, signal.SIGCONT)


def submit(lab: Any, *args: str) -> dict[str, Any]:
    r = warmup(lab, "--background", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_background_job_survives_a_kill_9_of_the_leader_that_runs_it(lab) -> None:
    assert warmup(lab, "--evict", "/jobs").returncode == 0  # what the writes put there
    assert pins(lab) == 0
    job = submit(lab, "--threads", "1", "--pin-ttl", "1h", "/jobs")
    assert job["state"] == "queued" and job["paths"] == ["/jobs"] and job["pin_ttl"] == 3600
    with held_mid_job(lab, job["id"]):  # so the kill lands mid-job
        running = job_status(lab, job["id"])
        assert running["state"] == "running" and running["bytes_done"] < running["bytes_total"], running
        name, node_id = leader(lab)
        assert running["runner"] == node_id and running["attempt"] == 1
        lab.kill(name)  # kill -9 of the runner
    try:
        done = wait_for(lab, job["id"], lambda st: st["state"] in ("done", "failed", "cancelled"))
        assert done["state"] == "done", done
        assert done["attempt"] >= 2 and done["runner"] != node_id, done
        assert (done["files"], done["files_done"], done["blocks"], done["failed"]) == (FILES, FILES, FILES, 0)
        assert done["cached"] + done["fetched"] == FILES and done["cached"] > 0  # the first attempt's blocks
        assert done["progress"] == 1.0 and done["eta"] is None
        r = warmup(lab, "--check", "/jobs")
        assert f"zone z1: 100.0% cached ({FILES} of {FILES} blocks" in r.stdout, r.stdout + r.stderr
        assert pins(lab) == FILES  # every block pinned on its owner, once
        r = warmup(lab, "status")
        assert f"job {job['id']} (lab): done 100.0%, {FILES}/{FILES} files" in r.stdout, r.stdout
        assert "pinned for 3600s" in r.stdout
    finally:
        lab.start(name)


def test_cancel_stops_a_running_job_and_bad_requests_name_what_is_wrong(lab) -> None:

    assert warmup(lab, "--evict", "/jobs").returncode == 0

    job = submit(lab, "--threads", "1", "/jobs")
    with held_mid_job(lab, job["id"]) as seen:  # the job cannot finish before the cancel lands
        r = warmup(lab, "cancel", str(job["id"]))
    assert r.returncode == 0 and f"job {job['id']}: cancelled" in r.stdout, r.stdout + r.stderr
    assert seen["state"] == "running", seen
    time.sleep(1)  # the runner stops at its next report
    first = job_status(lab, seen["id"])
    time.sleep(2)  # a runner that missed the cancel would go on
    later = job_status(lab, seen["id"])
    assert later["state"] == "cancelled" and later["bytes_done"] == first["bytes_done"], (first, later)
    r = warmup(lab, "--check", "/jobs")
    assert r.returncode == 0 and "zone z1: 100.0% cached" not in r.stdout, r.stdout  # it stopped short
    assert "z1: 0.0% cached" not in r.stdout, r.stdout
    r = warmup(lab, "status")
    assert f"job {seen['id']} (lab): cancelled" in r.stdout, r.stdout

    r = warmup(lab, "cancel", "999")
    assert r.returncode == 1 and "no job 999" in r.stderr, r.stderr
    r = warmup(lab, "status", "999")
    assert r.returncode == 1 and "no job 999" in r.stderr, r.stderr
    r = warmup(lab, "--background", "--check", "/jobs")
    assert r.returncode == 2 and "excludes --check" in r.stderr, r.stderr
    r = warmup(lab, "--background", "--pin-ttl", "soon", "/jobs")
    assert r.returncode == 2 and "'soon' is not a duration" in r.stderr, r.stderr
    failed = submit(lab, "/no-such-dir")
    st = wait_for(lab, failed["id"], lambda s: s["state"] not in ("queued", "running"))
    assert st["state"] == "failed" and "/no-such-dir: no such file or directory" in st["error"], st


def test_a_job_goes_on_past_a_cache_node_killed_under_it(lab) -> None:
    assert warmup(lab, "--evict", "/jobs").returncode == 0
    job = submit(lab, "--threads", "1", "/jobs")
    with held_mid_job(lab, job["id"]):  # the job cannot finish before the kill lands
        lab.kill("cache2")  # its blocks fail, and go to cache1 once the leader has it down
    try:
        done = wait_for(lab, job["id"], lambda st: st["state"] in ("done", "failed", "cancelled"))
        assert done["state"] == "done" and done["attempt"] == 1 and done["failed"] == 0, done
        assert cached_blocks(lab, "cache1") == FILES  # the dead node's share went to the one left
    finally:
        lab.start("cache2")
