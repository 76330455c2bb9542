"""One small lab of real processes for the bad-input suites (and a FUSE mount of it)."""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fault.conftest import free_base


def small_lab(root: str, base: int):
    """1 metanode, 3 datanodes (ec:2+1), 1 cache node: every kind of server, cheaply."""
    from cachefs.lab.cluster import Lab, LabConfig

    return Lab(LabConfig(root=root, metanodes=1, datanodes=3, cachenodes=1, zones=3, base_port=base,
                         policy="ec:2+1", metrics=True, data_capacity="2G", cache_capacity="256M",
                         cache_memory="0"))


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    if os.geteuid() != 0:
        pytest.skip("needs root (the lab's FUSE mount)")
    lab = small_lab(str(tmp_path_factory.mktemp("fuzzlab")), free_base(26000))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lab.up(timeout=120)
        yield lab
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lab.down()


@pytest.fixture(scope="session")
def mnt(lab) -> Iterator[Path]:
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        pytest.skip("needs /dev/fuse and fusermount3")
    path = Path(tempfile.mkdtemp(prefix="cachefs-fuzz-mnt-"))
    lab.mount(str(path), "--attr-timeout", "0.1", "--entry-timeout", "0.1")
    try:
        yield path
    finally:
        lab.umount()
        if not os.path.ismount(path):
            path.rmdir()
