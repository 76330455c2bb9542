"""One real cluster for the tests/api package (torn down when pytest leaves it), and a FUSE mount of it.

The cluster is the lab's (metanodes on Raft, datanodes with ec:2+1, cache
nodes in two zones), smaller than ``cachefs lab up``'s so that it starts in
seconds on two shared cores. Each module works in its own top directory.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefs.client.api import FileSystem, connect

needs_fuse = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"
)


def _ports_free(ports: list[int]) -> bool:
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _free_base() -> int:
    """A base port whose lab ports are all free now (other suites run labs too)."""
    for k in range(30):
        base = 21000 + ((os.getpid() + k) % 30) * 300
        if _ports_free([base + off for off in (1, 2, 3, 101, 102, 103, 201, 202)]):
            return base
    raise RuntimeError("no free port range for the lab in 21000-29999")


@pytest.fixture(scope="package")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from cachefs.lab.cluster import Lab, LabConfig

    root = tmp_path_factory.mktemp("apilab")
    base = _free_base()
    lab = Lab(LabConfig(root=str(root), metanodes=3, datanodes=3, cachenodes=2, zones=3, base_port=base,
                        policy="ec:2+1", metrics=False, data_capacity="4G", cache_capacity="1G",
                        cache_memory="32M"))  # fmt: skip
    try:
        # Lab.start hands its children to the state file, not to a Popen it
        # keeps; the dropped Popen's ResourceWarning is expected.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lab.up(timeout=120)
        yield lab
    finally:
        lab.down()


@pytest.fixture(scope="package")
def mount(lab) -> Iterator[Path]:
    """``cachefs mount -d`` of the lab's volume (short kernel caches)."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse")
    path = Path(tempfile.mkdtemp(prefix="cachefs-api-mnt-"))
    lab.mount(str(path), "--attr-timeout", "0.2", "--entry-timeout", "0.2")
    try:
        yield path
    finally:
        lab.umount()
        if not os.path.ismount(path):
            path.rmdir()
    log = (Path(lab.config.root) / "logs" / "mount.log").read_text(errors="replace")
    bad = [line for line in log.splitlines() if " ERROR " in line or line.startswith("Traceback")]
    assert not bad, log


@pytest.fixture(scope="module")
def fs(lab) -> Iterator[FileSystem]:
    with connect(lab.meta_addrs, "lab", secret=lab.secret, zone="z1") as client:
        yield client


def drop_page_cache() -> None:
    subprocess.run(["sync"], check=False)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
