"""Only the FUSE front end needs pyfuse3: the engine, the native API and its
adapters import (in a fresh interpreter) with pyfuse3 made unimportable."""

from __future__ import annotations

import subprocess
import sys

import pytest

# ``sys.modules[name] = None`` makes every ``import name`` raise ImportError.
IMPORT_WITHOUT_PYFUSE3 = """
import importlib, sys
sys.modules["pyfuse3"] = None
importlib.import_module(sys.argv[1])
"""


def _import(module: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", IMPORT_WITHOUT_PYFUSE3, module],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    "module",
    [
        "cachefs.client.volume",
        "cachefs.client.api",
        "cachefs.client.adapters.fsspec",
        "cachefs.client.adapters.torch",
    ],
)
def test_imports_without_pyfuse3(module: str) -> None:
    if module.endswith(".torch"):
        pytest.importorskip("torch")
    proc = _import(module)
    assert proc.returncode == 0, proc.stderr


def test_the_fuse_front_end_does_need_it() -> None:
    """The block is real: the FUSE handlers fail to import under it."""
    proc = _import("cachefs.client.fs")
    assert proc.returncode != 0 and "pyfuse3" in proc.stderr
