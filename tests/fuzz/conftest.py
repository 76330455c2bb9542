"""One small lab of real processes for the bad-input suites (and a FUSE mount of it)."""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefs.testing.ports import free_lab_base


def small_lab(root: str):
    """1 metanode, 3 datanodes (ec:2+1), 1 cache node: every kind of server, cheaply."""
    from cachefs.lab.cluster import Lab, LabConfig

    config = LabConfig(root=root, metanodes=1, datanodes=3, cachenodes=1, zones=3, policy="ec:2+1",
                       metrics=True, data_capacity="2G", cache_capacity="256M", cache_memory="0")
    config.base_port = free_lab_base(config)
    return Lab(config)


@pytest.fixture(scope="session")
def lab(needs_fuse, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    lab = small_lab(str(tmp_path_factory.mktemp("fuzzlab")))
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
    path = Path(tempfile.mkdtemp(prefix="cachefs-fuzz-mnt-"))
    lab.mount(str(path), "--attr-timeout", "0.1", "--entry-timeout", "0.1")
    try:
        yield path
    finally:
        lab.umount()
        if not os.path.ismount(path):
            path.rmdir()
