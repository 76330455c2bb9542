"""What every test suite shares.

- ``@pytest.mark.needs_fuse`` (and the ``needs_fuse`` fixture, for fixtures
  that mount): skipped unless this host can run real FUSE mounts.
- No test may log a WARNING (or worse) from our own loggers (``cachefs.*``)
  unless it says it expects that: ``@pytest.mark.allow_log(LOGGER, MATCH)``
  allows records of LOGGER (and its children) whose message matches the
  regular expression MATCH (any message when omitted). A warning nobody
  expected is a bug, or a test that provokes one without saying so.
  Daemons run as processes log to their own files; this sees what runs in
  the test's own process (clients, in-process servers, the lab harness).
- ``power_cut_disk``: a fresh mounted :class:`~cachefs.testing.powercut.PowerCutDisk`
  (a directory that loses what was not made durable when its power is cut).
- ``small_lab`` and ``small_mnt``: one small lab of real processes (every
  kind of server) and a FUSE mount of it, for the whole session (the
  bad-input and security suites share it).

Free ports, the FUSE check, dict block storage and metanode and datanode
processes are in :mod:`cachefs.testing`, which the benchmarks share;
conftests never import each other.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefs.testing.fuse import fuse_unavailable

pytest_plugins = ["pytester"]  # tests/testing/test_log_fixture.py runs pytest on this conftest

OUR_LOGGERS = "cachefs"


# `make test` runs the suite in two worker processes (pytest-xdist, ``--dist loadfile``: a module's
# tests stay together, since many share a module-scoped cluster). Modules that use a host-wide
# resource (network namespaces on the lab's default subnet, and the check that none is left behind)
# hold this lock while they run, so two of them never overlap.
HOST_WIDE = {"tests/fault/test_netns_faults.py", "tests/lab/test_netns_lab.py", "tests/lab/test_netns_peers.py",
             "tests/lab/test_netns_plan.py", "tests/lab/test_lab_cli.py"}
HOST_WIDE_LOCK = Path(tempfile.gettempdir()) / "cachefs-tests-host-wide.lock"


@pytest.fixture(autouse=True, scope="module")
def _host_wide_lock(request: pytest.FixtureRequest) -> Iterator[None]:
    module = Path(str(request.node.path)).relative_to(request.config.rootpath).as_posix()
    if module not in HOST_WIDE:
        yield
        return
    with open(HOST_WIDE_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("needs_fuse") is not None and (reason := fuse_unavailable()):
        pytest.skip(reason)


@pytest.fixture(name="needs_fuse", scope="session")
def needs_fuse_fixture() -> None:
    """For fixtures that mount: skips every test that uses them where FUSE cannot run."""
    if reason := fuse_unavailable():
        pytest.skip(reason)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _allowance(logger: str, match: str | None = None) -> tuple[str, str | None]:
    """The arguments of ``@pytest.mark.allow_log``."""
    return logger, match


def _allowed(record: logging.LogRecord, markers: list[pytest.Mark]) -> bool:
    for mark in markers:
        logger, match = _allowance(*mark.args, **mark.kwargs)
        if (record.name == logger or record.name.startswith(logger + ".")) and (
                match is None or re.search(match, record.getMessage())):
            return True
    return False


@pytest.fixture(autouse=True)
def _no_unexpected_warning_logs(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the test on a WARNING+ record of ours it did not declare (see the module docstring)."""
    handler = _Records()
    logger = logging.getLogger(OUR_LOGGERS)
    level = logger.level
    if logger.getEffectiveLevel() > logging.WARNING:  # e.g. a CLI run in-process set the root to ERROR
        logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    markers = list(request.node.iter_markers("allow_log"))
    unexpected = [r for r in handler.records if not _allowed(r, markers)]
    if unexpected:
        lines = "\n".join(f"  {r.levelname} {r.name}: {r.getMessage()}" for r in unexpected[:20])
        pytest.fail(f"{len(unexpected)} unexpected WARNING+ log record(s) from cachefs loggers "
                    f"(fix the cause, or mark the test @pytest.mark.allow_log(logger, match)):\n{lines}",
                    pytrace=False)


@pytest.fixture(scope="session")
def small_lab(needs_fuse, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """1 metanode, 3 datanodes (ec:2+1), 1 cache node, metrics on: every kind of server, cheaply."""
    from cachefs.testing.labs import running_lab

    with running_lab(tmp_path_factory.mktemp("smalllab"), metrics=True) as lab:
        yield lab


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
