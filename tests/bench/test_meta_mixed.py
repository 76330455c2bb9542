"""The mixed run of bench.meta_fs_bench on local disk: its figures, the load it
ran under, and the metanode calls per file made when it is given a counter."""

from __future__ import annotations

from pathlib import Path

from bench.meta_fs_bench import run_mixed


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
