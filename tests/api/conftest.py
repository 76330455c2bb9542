"""One real cluster for the tests/api package (torn down when pytest leaves it), and a FUSE mount of it.

The cluster is the lab's (metanodes on Raft, datanodes with ec:2+1, cache
nodes in two zones), smaller than ``cachefs lab up``'s so that it starts in
seconds on two shared cores. Each module works in its own top directory.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefs.client.api import FileSystem, connect
from cachefs.testing.labs import running_lab


@pytest.fixture(scope="package")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:

    with running_lab(tmp_path_factory.mktemp("apilab"), metanodes=3, cachenodes=2, data_capacity="4G",
                     cache_capacity="1G", cache_memory="32M") as lab:  # fmt: skip
        yield lab


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
