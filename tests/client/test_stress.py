"""Mixed stress against a mount ends on time (issue 16, item 5).

The mix the issue saw hang: fanotify watches and file ioctls with create,
write, fallocate, rename and unlink traffic, two instances of each stressor
(stress-ng, from Debian). It must finish within its deadline, and the mount
must still serve and unmount cleanly, with no error in its log.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest

from bench.meta_fs_bench import DBENCH_LOADFILE, dbench_available
from cachefs.testing.ports import free_port

from .conftest import LocalMount

pytestmark = pytest.mark.needs_fuse

RUN = 10  # seconds per stressor
DEADLINE = RUN + 60  # stress-ng's own wind-down included, on a loaded 2-core machine
MIX = ["fanotify", "file-ioctl", "fallocate", "rename", "dentry", "hdd"]


@pytest.mark.skipif(shutil.which("stress-ng") is None, reason="stress-ng is not installed")
def test_fanotify_and_ioctls_with_file_traffic_finish(localmount) -> None:
    work = localmount.path / "stress"
    work.mkdir()
    argv = ["stress-ng", "--temp-path", str(work), "--timeout", f"{RUN}s", "--metrics-brief"]
    for stressor in MIX:
        argv += [f"--{stressor}", "2"]
    try:
        proc = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=DEADLINE)
    except subprocess.TimeoutExpired as exc:
        localmount.proc.send_signal(signal.SIGUSR1)  # the mount logs where each task waits
        raise AssertionError(f"stress-ng ran past {DEADLINE}s:\n{exc.stdout}\n{localmount.log()}") from None
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "successful run completed" in proc.stdout + proc.stderr
    data = os.urandom(100_000)
    (localmount.path / "after").write_bytes(data)
    assert (localmount.path / "after").read_bytes() == data
    shutil.rmtree(work)  # the fixture then unmounts: status 0, no ERROR logged


def test_the_mount_exports_its_resident_memory(tmp_path) -> None:
    """cachefs_mount_rss_bytes is the mount process's own RSS (issue 16, item 6)."""
    port = free_port()
    m = LocalMount(tmp_path, "--metrics-port", str(port))
    try:
        (m.path / "f").write_bytes(os.urandom(1 << 20))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        exported = float(re.search(r"^cachefs_mount_rss_bytes (\S+)$", text, re.M).group(1))
        own = int(Path(f"/proc/{m.proc.pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        assert exported > 20 << 20 and abs(exported - own) < 0.2 * own
    finally:
        assert m.stop() == 0, m.log()
    m.check_log()


DBENCH_RUN = 8  # seconds


@pytest.mark.skipif(not dbench_available(), reason="dbench (Debian's package) is not installed")
def test_dbench_on_a_cluster_mount_sees_every_result_it_expects(cluster_mount) -> None:
    """dbench (4 clients of its NetBench load file: creates with each
    disposition, writes, reads, renames, unlinks, stats, directory
    searches, locks, flushes) against a real cluster: it compares every
    call's result with the one the load file recorded (a name that must not
    exist, a rename onto a missing directory, ...) and exits 1 on the first
    that differs. It must also end on time, with the mount's log clean."""
    work = cluster_mount.path / "dbench"
    work.mkdir()
    argv = ["dbench", "-c", str(DBENCH_LOADFILE), "-D", str(work), "-t", str(DBENCH_RUN), "4"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=DBENCH_RUN + 120)
    except subprocess.TimeoutExpired as exc:
        os.kill(cluster_mount.pid, signal.SIGUSR1)  # the mount logs where each task waits
        raise AssertionError(f"dbench ran past {DBENCH_RUN + 120}s:\n{exc.stdout}\n{cluster_mount.log()}") from None
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"^Throughput [0-9.]+ MB/sec\s+4 clients", out, re.M), out[-2000:]
    data = os.urandom(100_000)
    (work / "after").write_bytes(data)
    assert (work / "after").read_bytes() == data
    shutil.rmtree(work)  # the fixture then unmounts and checks the log
