"""Real datanode processes (:class:`cachefs.testing.datanodes.Datanodes`) for the backing-storage tests.

The standard layout is 6 datanodes in 3 zones (a, a, b, b, c, c). The
processes are shared by the whole test session; tests that kill, stop or wipe
one bring it back before they finish, and every test uses its own volume name
so their shards never meet.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest

from cachefs.testing.datanodes import Datanodes

ZONES = ["a", "a", "b", "b", "c", "c"]
_volume_ids = itertools.count()


@pytest.fixture(scope="session")
def datanodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Datanodes]:
    nodes = Datanodes(tmp_path_factory.mktemp("datanodes"), ZONES)
    nodes.start()
    try:
        yield nodes
    finally:
        nodes.stop_all()


@pytest.fixture
def cluster(datanodes: Datanodes) -> Iterator[Datanodes]:
    """The shared datanodes, all running again after the test."""
    datanodes.ensure_running()
    yield datanodes
    datanodes.ensure_running()


@pytest.fixture
def volume() -> str:
    return f"vol{os.getpid()}x{next(_volume_ids)}"
