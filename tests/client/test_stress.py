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
