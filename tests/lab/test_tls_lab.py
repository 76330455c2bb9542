"""`cachefs lab up --tls` end to end: the whole 15-process lab on mutual TLS, mounted.

The real command line starts every daemon and the FUSE mount with the
certificates it made; bytes written through the mount read back through the
native API with the lab's client certificate (and the other way round);
`lab status --json` reaches every daemon over TLS; plain TCP is refused;
`lab down` unmounts and stops everything.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachefs.client.api import connect
from cachefs.lab.cluster import Lab, LabConfig, _alive
from cachefs.testing.ports import free_lab_base

pytestmark = [pytest.mark.slow, pytest.mark.needs_fuse]
ROOT = Path(__file__).resolve().parents[2]


def _why_not() -> str | None:
    return "openssl is not installed" if shutil.which("openssl") is None else None


def _lab(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cachefs.cli", "lab", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))
def test_lab_up_tls_mount_status_down(tmp_path: Path) -> None:
    root, mnt = tmp_path / "lab", tmp_path / "mnt"
    base = free_lab_base(LabConfig(root=str(root)))  # the shape `lab up` starts
    up = _lab("up", "--tls", "--dir", str(root), "--base-port", str(base), "--mount", str(mnt),
              "--cache-capacity", "256M")  # fmt: skip
    lab = Lab.load(root) if (root / "lab.json").exists() else None
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert lab is not None and lab.config.tls
        assert "TLS on every link" in up.stdout and "--tls-ca" in up.stdout
        # Every daemon runs with its own certificate.
        for node in lab.nodes:
            cmdline = Path(f"/proc/{node.pid}/cmdline").read_bytes().split(b"\0")
            assert str(root / "tls" / f"{node.name}.pem").encode() in cmdline, node.name

        (mnt / "from-mount.bin").write_bytes(b"m" * 100_000)
        with connect(lab.meta_addrs, "lab", secret=lab.secret, zone="z2",
                     **lab.tls_files()) as fs:  # fmt: skip
            assert fs.read_bytes("/from-mount.bin") == b"m" * 100_000
            fs.write_bytes("/from-api.bin", b"a" * 5000)
        deadline = time.monotonic() + 30  # the mount's attribute cache may hold the old listing
        while not (mnt / "from-api.bin").exists():
            assert time.monotonic() < deadline, "the mount never saw the file the library wrote"
            time.sleep(0.2)
        assert (mnt / "from-api.bin").read_bytes() == b"a" * 5000

        status = _lab("status", "--dir", str(root), "--json", timeout=60)
        assert status.returncode == 0, status.stderr
        st = json.loads(status.stdout)
        assert st["leader"] in lab.meta_addrs
        for node in st["nodes"]:
            assert node["alive"] and "error" not in (node["health"] or {"error": "none"}), node
        table = _lab("status", "--dir", str(root), timeout=60)
        assert table.returncode == 0 and "unhealthy" not in table.stdout, table.stdout

        # Plain TCP with the right secret gets nowhere.
        with pytest.raises(TimeoutError, match="TLS cluster needs"):
            connect(lab.meta_addrs, "lab", secret=lab.secret, connect_timeout=2)
    finally:
        down = _lab("down", "--dir", str(root), timeout=120)
    assert down.returncode == 0, down.stderr
    assert not os.path.ismount(mnt)
    if lab is not None:
        assert not [n.name for n in lab.nodes if n.pid and _alive(n.pid)]
