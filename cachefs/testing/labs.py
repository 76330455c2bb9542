"""Labs for tests: the small shape most of them need, free ports, and a
bring-up and teardown that do not trip the suite's warnings-as-errors.

``Lab.start`` hands its children to the lab's state file, not to a Popen
object it keeps, so every dropped Popen raises a ResourceWarning: expected
here, and silenced around ``up``, ``down`` and node restarts only.
"""

from __future__ import annotations

import contextlib
import gc
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from cachefs.lab.cluster import Lab, LabConfig
from cachefs.testing.ports import free_lab_base

# 1 metanode, 3 datanodes (ec:2+1) in 3 zones, 1 cache node: every kind of server, cheaply.
SMALL: dict[str, Any] = {"metanodes": 1, "datanodes": 3, "cachenodes": 1, "zones": 3, "policy": "ec:2+1",
                         "metrics": False, "data_capacity": "2G", "cache_capacity": "256M", "cache_memory": "0"}  # fmt: skip


@contextlib.contextmanager
def lab_processes() -> Iterator[None]:
    """Around what starts or stops lab processes (see the module docstring)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            yield
        finally:
            gc.collect()  # any dropped Popen still in a cycle warns now, not in a later test


@contextlib.contextmanager
def running_lab(root: str | Path, *, env: Mapping[str, str] | None = None, timeout: float = 120.0,
                **fields: Any) -> Iterator[Lab]:  # fmt: skip
    """A lab of :data:`SMALL`'s shape with ``fields`` changed, on free ports
    under ``root``, up for the ``with`` block; ``env`` is added to this
    process's environment meanwhile (the nodes inherit it, as on a host)."""
    config = LabConfig(root=str(root), **{**SMALL, **fields})
    config.base_port = free_lab_base(config)
    saved = dict(os.environ)
    os.environ.update(env or {})
    lab = Lab(config)
    try:
        with lab_processes():
            lab.up(timeout=timeout)
        yield lab
    finally:
        with lab_processes():
            lab.down()
        os.environ.clear()
        os.environ.update(saved)
