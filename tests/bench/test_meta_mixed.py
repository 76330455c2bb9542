"""The mixed run of bench.meta_fs_bench on local disk: its figures, the load it
ran under, and the metanode calls per file made when it is given a counter."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.meta_fs_bench import dbench_available, run_dbench, run_mixed


def test_mixed_run_counts_client_calls_per_file(tmp_path: Path) -> None:
    calls = {"mknod": 0.0, "write_slice": 0.0, "raft_step": 0.0}

    def counter() -> dict[str, float]:
        """Stands in for the metanodes' /metrics: every read finds 7 more client
        calls than the last (and Raft traffic, which is not a client's)."""
        calls["mknod"] += 3
        calls["write_slice"] += 4
        calls["raft_step"] += 100
        return dict(calls)

    by_method: dict[str, float] = {}
    out = run_mixed(tmp_path / "m", 2, 0.3, counter, by_method)
    assert out["mixed_mb_s"] > 0 and out["mixed_ops_s"] > 0
    assert out["mixed_load"] >= 0
    per_file = out["rpcs_per_file_mixed"]
    assert 0 < per_file <= 7  # 7 calls over at least one file
    assert set(by_method) == {"mknod", "write_slice"}  # raft_ is a peer's
    assert abs(sum(by_method.values()) - per_file) < 0.01
    assert not (tmp_path / "m").exists()


def test_mixed_run_without_a_counter(tmp_path: Path) -> None:
    out = run_mixed(tmp_path / "m", 1, 0.2)
    assert set(out) == {"mixed_mb_s", "mixed_ops_s", "mixed_load"}


needs_dbench = pytest.mark.skipif(not dbench_available(), reason="dbench (Debian's package) is not installed")


@needs_dbench
def test_dbench_run_reports_its_throughput(tmp_path: Path) -> None:
    out = run_dbench(tmp_path / "d", 2, 2)
    assert set(out) == {"dbench_mb_s", "dbench_load"} and out["dbench_mb_s"] > 0
    assert not (tmp_path / "d").exists()


@needs_dbench
def test_a_dbench_run_that_fails_raises_with_its_output(tmp_path: Path) -> None:
    """On a full filesystem dbench's writes fail: the run raises, naming dbench's own error."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)], check=True)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)dbench in .* failed \(exit 1\).*No space left on device"):
            run_dbench(small / "d", 1, 2)
    finally:
        subprocess.run(["umount", str(small)], check=True)
