"""`lab down` stops every daemon even when the unmount fails (issue 14, item 12).

The mount daemon is stopped (SIGSTOP): it can neither commit nor answer the
kernel, as a daemon stuck on a dead cluster. ``down`` must still return
within its unmount timeout plus the daemons' stop time, with the mount gone
and no process of the lab left, the mount daemon included.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from cachefs.client.mount import pid_file
from cachefs.lab.cluster import Lab, LabConfig, _alive, _mounted
from cachefs.testing.ports import free_lab_base

pytestmark = pytest.mark.needs_fuse


def test_down_stops_everything_when_the_mount_hangs(needs_fuse, tmp_path: Path) -> None:
    config = LabConfig(root=str(tmp_path / "lab"), metanodes=1, datanodes=1, cachenodes=0, zones=1,
                       policy="replica:1", metrics=False, data_capacity="1G", cache_memory="0")  # fmt: skip
    config.base_port = free_lab_base(config)
    lab = Lab(config)
    mnt = str(tmp_path / "mnt")
    daemon = None
    try:
        lab.up(timeout=120)
        lab.mount(mnt, l2=False)
        (Path(mnt) / "dirty").write_bytes(b"d" * 1000)
        daemon = int(pid_file(mnt).read_text().split()[0])
        pids = [n.pid for n in lab.nodes] + [daemon]
        os.kill(daemon, signal.SIGSTOP)

        started = time.monotonic()
        lab.down(umount_timeout=3)
        elapsed = time.monotonic() - started
        assert not _mounted(mnt)
        assert [pid for pid in pids if _alive(pid)] == []
        assert elapsed < 3 + 10 + 15 + 10, f"down took {elapsed:.0f}s"  # umount, slack, SIGTERM, SIGKILL
    finally:
        if daemon is not None and _alive(daemon):
            os.kill(daemon, signal.SIGKILL)
        lab.down()
