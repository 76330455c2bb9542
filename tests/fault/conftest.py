"""The fault suites' lab: a quick Chaos lab, up and mounted."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from cachefs.testing.ports import free_lab_base


def running_chaos(root: Path, *, seed: int, netns_subnet: str | None = None) -> Iterator[object]:
    """A quick Chaos lab, up and mounted, with a short workload (bench.chaos runs
    the long version); torn down and its mount point removed afterwards."""
    from bench.chaos import Chaos, quick_config

    mnt = Path(tempfile.mkdtemp(prefix="cachefs-fault-mnt-"))
    config = quick_config(str(root), 0)
    config.netns = netns_subnet or ""
    config.base_port = free_lab_base(config)
    c = Chaos(config, mnt, quick=True, seed=seed)
    c._ops = 15  # keep CI short
    try:
        c.up()
        yield c
    finally:
        c.down()
        if not mnt.is_mount():
            shutil.rmtree(mnt, ignore_errors=True)
