"""One real cluster for the tests/api package (torn down when pytest leaves it), and a FUSE mount of it.

The cluster is the lab's (metanodes on Raft, datanodes with ec:2+1, cache
nodes in two zones), smaller than ``cachefs lab up``'s so that it starts in
seconds on two shared cores. Each module works in its own top directory.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefs.client.api import FileSystem, connect


@pytest.fixture(scope="package")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from cachefs.lab.cluster import Lab, LabConfig
    from cachefs.testing.ports import free_lab_base

    root = tmp_path_factory.mktemp("apilab")
    config = LabConfig(root=str(root), metanodes=3, datanodes=3, cachenodes=2, zones=3, policy="ec:2+1",
                       metrics=False, data_capacity="4G", cache_capacity="1G", cache_memory="32M")
    config.base_port = free_lab_base(config)
    lab = Lab(config)
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
def mount(needs_fuse, lab) -> Iterator[Path]:
    """``cachefs mount -d`` of the lab's volume (short kernel caches)."""
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
    with connect(lab.meta_addrs, "lab", secret=lab.credential("client"), zone="z1") as client:
        yield client


def drop_page_cache() -> None:
    subprocess.run(["sync"], check=False)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
