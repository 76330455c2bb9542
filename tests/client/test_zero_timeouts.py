"""``cachefs mount --attr-timeout 0 --entry-timeout 0`` becomes ready and serves.

With no kernel attribute cache every stat is a FUSE request; the readiness
step once resolved the mount point from the FUSE loop's own thread and so
waited on itself forever (issue 9).
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.client.conftest import ClusterMount


def test_zero_timeouts_mount_stat_and_read(cluster, tmp_path: Path) -> None:
    m = ClusterMount(cluster, tmp_path, "--attr-timeout", "0", "--entry-timeout", "0")
    try:
        assert os.stat(m.path).st_ino == 1
        f = m.path / "zero-timeouts.bin"
        data = os.urandom(200_000)
        f.write_bytes(data)
        assert os.stat(f).st_size == len(data)
        assert f.read_bytes() == data
        assert "zero-timeouts.bin" in os.listdir(m.path)
        f.unlink()
        assert not f.exists()
    finally:
        m.stop()
    m.check_log()
