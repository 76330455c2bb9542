"""What every test suite shares.

- ``@pytest.mark.needs_fuse`` (and the ``needs_fuse`` fixture, for fixtures
  that mount): skipped unless this host can run real FUSE mounts.
- ``power_cut_disk``: a fresh mounted :class:`~cachefs.testing.powercut.PowerCutDisk`
  (a directory that loses what was not made durable when its power is cut).
- ``small_lab`` and ``small_mnt``: one small lab of real processes (every
  kind of server) and a FUSE mount of it, for the whole session (the
  bad-input and security suites share it).

Free ports, the FUSE check and dict block storage are in
:mod:`cachefs.testing`, which the benchmarks share; conftests never import
each other.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefs.testing.fuse import fuse_unavailable


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("needs_fuse") is not None and (reason := fuse_unavailable()):
        pytest.skip(reason)


@pytest.fixture(name="needs_fuse", scope="session")
def needs_fuse_fixture() -> None:
    """For fixtures that mount: skips every test that uses them where FUSE cannot run."""
    if reason := fuse_unavailable():
        pytest.skip(reason)


@pytest.fixture(scope="session")
def small_lab(needs_fuse, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """1 metanode, 3 datanodes (ec:2+1), 1 cache node, metrics on: every kind of server, cheaply."""
    from cachefs.lab.cluster import Lab, LabConfig
    from cachefs.testing.ports import free_lab_base

    config = LabConfig(root=str(tmp_path_factory.mktemp("smalllab")), metanodes=1, datanodes=3, cachenodes=1,
                       zones=3, policy="ec:2+1", metrics=True, data_capacity="2G", cache_capacity="256M",
                       cache_memory="0")
    config.base_port = free_lab_base(config)
    lab = Lab(config)
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
def small_mnt(small_lab) -> Iterator[Path]:
    """A FUSE mount of ``small_lab``'s volume with short kernel caches."""
    path = Path(tempfile.mkdtemp(prefix="cachefs-small-mnt-"))
    small_lab.mount(str(path), "--attr-timeout", "0.1", "--entry-timeout", "0.1")
    try:
        yield path
    finally:
        small_lab.umount()
        if not os.path.ismount(path):
            path.rmdir()


@pytest.fixture
def power_cut_disk(needs_fuse, tmp_path: Path) -> Iterator[object]:
    from cachefs.testing.powercut import PowerCutDisk

    disk = PowerCutDisk(tmp_path / "disk", tmp_path / "data")
    disk.mount()
    try:
        yield disk
    finally:
        disk.cut()
