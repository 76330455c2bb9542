"""What every test suite shares.

- ``@pytest.mark.needs_fuse`` (and the ``needs_fuse`` fixture, for fixtures
  that mount): skipped unless this host can run real FUSE mounts.

Free ports, the FUSE check and dict block storage are in
:mod:`cachefs.testing`, which the benchmarks share; conftests never import
each other.
"""

from __future__ import annotations

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
