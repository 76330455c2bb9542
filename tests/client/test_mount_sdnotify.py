"""``cachefs mount`` in the foreground, as ``cachefs-mount@.service`` (Type=notify) runs it:
READY=1 only once the mount answers, watchdog pings from the FUSE loop, SIGTERM unmounts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from cachefs.client.mount import mount_entry
from cachefs.testing.notify import NotifySocket

from .conftest import REPO, mounted


def test_mount_notifies_ready_once_mounted_and_pings_the_watchdog(cluster, tmp_path: Path) -> None:
    mnt = Path(tempfile.mkdtemp(prefix="cachefs-mnt-"))
    notify = NotifySocket()
    log = tmp_path / "mount.log"
    argv = [sys.executable, "-m", "cachefs.cli", "mount", ",".join(cluster.meta_addrs), "lab", str(mnt),
            "--secret-file", str(cluster.secret_file), "--zone", "z1", "--log-file", str(log)]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=REPO, env=notify.env(watchdog_usec=400_000))
    try:
        ready = notify.wait_for("READY=1", 60, alive=lambda: proc.poll() is None)
        assert ready == f"READY=1\nSTATUS=mounted at {mnt}"
        entry = mount_entry(str(mnt))  # at READY the mount is there and serves
        assert entry is not None and entry[1] == "fuse.cachefs", entry
        name = f"sdnotify-{os.getpid()}"  # the cluster's volume is shared by the module's tests
        (mnt / name).write_bytes(b"ready")
        assert (mnt / name).read_bytes() == b"ready"
        (mnt / name).unlink()
        pings = notify.pings(1.5)
        assert len(pings) >= 4, notify.received
        proc.send_signal(signal.SIGTERM)  # systemctl stop
        assert proc.wait(timeout=60) == 0
        assert not mounted(mnt)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
        notify.close()
        if not mounted(mnt):
            os.rmdir(mnt)
    bad = [line for line in log.read_text().splitlines() if " ERROR " in line or line.startswith("Traceback")]
    assert not bad, log.read_text()
