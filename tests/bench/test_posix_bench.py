"""bench.posix_bench's calls run, and are counted, on a local file system."""

from __future__ import annotations

from pathlib import Path

from bench.posix_bench import COLUMNS, run_mode


def test_every_mode_runs_and_leaves_no_file(tmp_path: Path) -> None:
    for mode in COLUMNS:
        assert run_mode(tmp_path, mode, 20) > 0, mode
    assert list(tmp_path.iterdir()) == []
