"""Shared by the fault, fuzz and security suites: where a lab may run, and a free port range."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def needs_fuse_root() -> None:
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse")
    if shutil.which("fusermount3") is None:
        pytest.skip("fusermount3 is not installed")


def _ports_free(ports: list[int]) -> bool:
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def free_base(first: int) -> int:
    """A lab base port in [first, first+3000) whose node ports are all free now."""
    for k in range(10):
        base = first + ((os.getpid() + k) % 10) * 300
        offsets = (1, 2, 3, 101, 102, 103, 104, 201, 202)
        if _ports_free([base + off + m for off in offsets for m in (0, 1000)]):  # metrics: port + 1000
            return base
    raise RuntimeError(f"no free lab port range in {first}-{first + 3000}")


def running_chaos(root: Path, *, seed: int, netns_subnet: str | None = None) -> Iterator[object]:
    """A quick Chaos lab, up and mounted, with a short workload (bench.chaos runs
    the long version); torn down and its mount point removed afterwards."""
    from bench.chaos import Chaos, quick_config

    mnt = Path(tempfile.mkdtemp(prefix="cachefs-fault-mnt-"))
    config = quick_config(str(root), free_base(23000))
    config.netns = netns_subnet
    c = Chaos(config, mnt, quick=True, seed=seed)
    c._ops = 15  # keep CI short
    try:
        c.up()
        yield c
    finally:
        c.down()
        if not mnt.is_mount():
            shutil.rmtree(mnt, ignore_errors=True)
